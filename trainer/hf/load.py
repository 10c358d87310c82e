"""Import: fill a built model with a Hugging Face checkpoint's weights, each rank reading only its own shards.

:func:`load_hf` reads each tensor through ``safe_open(...).get_slice(name)[...]``: no full tensor is materialised
and no rank talks to another. :func:`check_hf` refuses a folder that :func:`load_hf` would refuse, reading only
the files' headers. The factory (:mod:`trainer.factory`) calls it; the model builder does not.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings
from trainer.checkpoint import unwrap
from trainer.hf.config import INDEX, WEIGHTS
from trainer.hf.layout import (
    Rule,
    _global_names,
    _table_for,
    _tp,
    hf_shapes,
    interleave_qkv,
    name_table,
    qkv_geometry,
)


@dataclass
class LoadReport:
    """What :func:`load_hf` read on this rank."""

    files: list[str] = field(default_factory=list)
    reads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """(HF tensor, shape of the slice read), in order."""
    elements_read: int = 0
    elements_in_checkpoint: int = 0
    """Elements of every tensor of the checkpoint (what reading it whole would cost)."""


class _Checkpoint:
    """The safetensors files of a checkpoint folder, opened lazily; every read is a slice."""

    def __init__(self, path: Path, stack: ExitStack, report: LoadReport):
        self.path, self.stack, self.report = path, stack, report
        self.handles: dict[str, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        index = path / INDEX
        if index.is_file():
            self.where = dict(json.loads(index.read_text())["weight_map"])
        elif (path / WEIGHTS).is_file():
            self.handles[WEIGHTS] = self._open(WEIGHTS)
            self.where = {name: WEIGHTS for name in self.handles[WEIGHTS].keys()}
        else:
            raise ConfigError(
                f"Hugging Face checkpoint {path}: neither {WEIGHTS} nor {INDEX} (only safetensors are read; "
                "convert pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
            )

    def _open(self, file: str):
        handle = self.stack.enter_context(safe_open(str(self.path / file), framework="pt", device="cpu"))
        self.report.files.append(file)
        return handle

    def slice(self, name: str):
        if name not in self.where:
            raise ConfigError(f"Hugging Face checkpoint {self.path}: tensor {name} is missing")
        file = self.where[name]
        if file not in self.handles:
            self.handles[file] = self._open(file)
        sl = self.handles[file].get_slice(name)
        self.shapes[name] = tuple(sl.get_shape())
        return sl

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            self.slice(name)
        return self.shapes[name]

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        sl = self.slice(name)
        if cols is not None:
            t = sl[:, cols[0] : cols[1]]
        elif rows is not None:
            t = sl[rows[0] : rows[1]]
        else:
            t = sl[:]
        self.report.reads.append((name, tuple(t.shape)))
        self.report.elements_read += t.numel()
        return t


def _shard(ck: _Checkpoint, rule: Rule, cfg: ModelSettings, tp: int, r: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of one megatron tensor, read slice by slice."""
    if rule.kind == "copy":
        return ck.read(rule.hf[0])
    if rule.kind == "row":
        cols = ck.shape(rule.hf[0])[1] // tp
        return ck.read(rule.hf[0], cols=(r * cols, (r + 1) * cols))
    if rule.kind == "gate_up":
        gate, up = rule.hf
        n = ck.shape(gate)[0] // tp
        return torch.cat([ck.read(gate, rows=(r * n, (r + 1) * n)), ck.read(up, rows=(r * n, (r + 1) * n))])
    if rule.kind == "vocab":
        rows = cfg.padded_vocab_size // tp
        lo, hi = r * rows, (r + 1) * rows
        real = ck.read(rule.hf[0], rows=(lo, min(hi, cfg.vocab_size))) if lo < cfg.vocab_size else None
        shape = (rows, *ck.shape(rule.hf[0])[1:])
        out = torch.zeros(shape, dtype=real.dtype if real is not None else torch.float32)
        if real is not None:
            out[: real.shape[0]] = real
        return out
    # qkv: this rank's query groups, each [q heads of the group, k, v]
    all_groups, qpg, d = qkv_geometry(cfg)
    groups = all_groups // tp
    g0 = r * groups
    q = ck.read(rule.hf[0], rows=(g0 * qpg * d, (g0 + groups) * qpg * d))
    k = ck.read(rule.hf[1], rows=(g0 * d, (g0 + groups) * d))
    v = ck.read(rule.hf[2], rows=(g0 * d, (g0 + groups) * d))
    return interleave_qkv(q, k, v, groups)


def _check_tensors(ck: _Checkpoint, cfg: ModelSettings, path: Path) -> None:
    """Every tensor of ``cfg`` is in the checkpoint with its shape, and nothing else is: ConfigError otherwise.
    Reads only the files' headers."""
    known = {h for rule in name_table(cfg).values() for h in rule.hf}
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied checkpoints store the copy
    extra = sorted(n for n in ck.where if n not in known and n not in ignorable and "rotary_emb.inv_freq" not in n)
    if extra:
        raise ConfigError(
            f"Hugging Face checkpoint {path}: {len(extra)} tensors have no place in this model "
            f"({', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}); is config.json the checkpoint's own?"
        )
    missing = sorted(known - set(ck.where))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"Hugging Face checkpoint {path}: tensor {missing[0]} is missing{more}; fix: give the whole checkpoint"
        )
    want = hf_shapes(cfg)
    wrong = [f"{n} {ck.shape(n)} (config: {want[n]})" for n in ck.where if n in want and ck.shape(n) != want[n]]
    if wrong:
        raise ConfigError(
            f"Hugging Face checkpoint {path}: tensors do not fit its config.json: {'; '.join(wrong[:4])}"
            f"{' ...' if len(wrong) > 4 else ''}"
        )


def check_hf(cfg: ModelSettings, path: str | os.PathLike | None = None) -> None:
    """Refuse (ConfigError) a Hugging Face checkpoint folder ``path`` (default ``cfg.hf_path``) that :func:`load_hf`
    would refuse for ``cfg``: no safetensors, a missing or extra tensor, a shape its config does not give. Reads
    only the files' headers, so a job can check its model before it deletes or starts anything."""
    path = Path(path or cfg.hf_path)
    if not str(path) or not path.is_dir():
        raise ConfigError(f"Hugging Face checkpoint {path} is not a folder")
    with ExitStack() as stack:
        _check_tensors(_Checkpoint(path, stack, LoadReport()), cfg, path)


def load_hf(model, cfg: ModelSettings, path: str | os.PathLike | None = None) -> LoadReport:
    """Fill ``model`` (this rank's megatron GPTModel, any tp/pp, local or TE spec) with the weights of the
    Hugging Face checkpoint folder ``path`` (default ``cfg.hf_path``). Each rank reads only its own shards
    (``get_slice``), converts them to the parameters' dtype and copies them in; nothing is communicated.
    A checkpoint tensor with no place in the model, or a missing one, is a ConfigError."""
    path = Path(path or cfg.hf_path)
    if not str(path) or not path.is_dir():
        raise ConfigError(f"Hugging Face checkpoint {path} is not a folder")
    model = unwrap(model)
    tp, r = _tp()
    if tp != cfg.parallel.tp:
        raise ConfigError(f"the model is split over tp = {tp} ranks but parallel.tp = {cfg.parallel.tp}")
    names = _global_names(model)
    table = _table_for(cfg, names)
    params = model.state_dict(keep_vars=True)
    report = LoadReport()
    with ExitStack() as stack:
        ck = _Checkpoint(path, stack, report)
        _check_tensors(ck, cfg, path)
        report.elements_in_checkpoint = sum(math.prod(ck.shape(n)) for n in ck.where)
        for key, gname in names.items():
            param = params[key]
            shard = _shard(ck, table[gname], cfg, tp, r)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConfigError(
                    f"Hugging Face checkpoint {path}: {', '.join(table[gname].hf)} give {gname} the shape "
                    f"{tuple(shard.shape)} on tensor-parallel rank {r}, the model has {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(shard)
    return report
