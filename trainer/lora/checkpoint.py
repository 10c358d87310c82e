"""Adapter checkpoints: one adapter's full tensors, its optimizer state and every rank's RNG states, at any tp.

Adapter checkpoints (:func:`save_adapter`, :func:`load_adapter`, :func:`latest_adapter`) hold the full
(tp-independent) adapter tensors, the AdamW moments over only the adapter's parameters (also full), the
step, the caller's ``extra`` dict (Kafka offsets ...), the name of the base model they were trained on,
and each rank's RNG states; a checkpoint saved at one tp loads at any other. Folders follow
:mod:`trainer.checkpoint`'s conventions: written under a hidden temporary name, renamed into place, then
marked ``COMPLETE``; :func:`latest_adapter` skips anything unmarked, so a kill -9 at any point leaves the
previous checkpoint the one to resume from.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rtrl.errors import ConfigError
from rtrl.sections.trainer import LoraConfig
from trainer import checkpoint
from trainer.checkpoint import unwrap
from trainer.lora.adapters import (
    _full_tensors,
    _pairs,
    adapter_config,
    adapter_names,
    adapter_parameters,
    adapter_state_dict,
    add_adapter,
    load_adapter_state_dict,
)
from trainer.lora.layers import _tp

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
FORMAT_VERSION = 1


@dataclass
class AdapterCheckpoint:
    """What :func:`load_adapter` restored."""

    path: Path
    step: int
    base: str
    """The base model (name/version) the adapter was trained on."""
    extra: dict[str, Any] = field(default_factory=dict)
    config: LoraConfig = field(default_factory=LoraConfig)


def _opt_entries(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"adapter checkpoints support torch.optim.Adam/AdamW, got {type(optimizer).__name__}")
    have = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if have != {id(p) for p in params}:
        raise ValueError("the optimizer must hold exactly the adapter's parameters (adapter_parameters(model, name))")


def _moment_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")


def _jsonable_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for g in optimizer.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            d[k] = list(v) if isinstance(v, tuple) else v
        out.append(d)
    return out


def save_adapter(
    root: str | os.PathLike,
    model: nn.Module,
    name: str,
    step: int,
    base: str,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save adapter ``name`` (and ``optimizer``'s state over exactly its parameters) as ``root/step_<step>``.

    Collective (every rank of the model calls it; rank 0 writes the tensors, every rank its RNG state).
    ``base`` names the base model the adapter is trained on; ``extra`` must be JSON (Kafka offsets ...).
    Written under a hidden name, renamed into place, then marked complete; an incomplete folder of the same
    step (an interrupted save) is replaced, a complete one is refused (FileExistsError). Hidden folders that
    interrupted saves left under ``root`` are removed: one training process saves under a ``root``."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    model = unwrap(model)
    extra = dict(extra or {})
    extra_text = json.dumps(extra, sort_keys=True)  # fail before touching the disk
    cfg = adapter_config(model, name)
    params = adapter_parameters(model, name)
    if optimizer is not None:
        _opt_entries(optimizer, params)
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    root = Path(root).absolute()
    final = checkpoint.step_dir(root, step)

    tensors = {k: v.cpu().contiguous() for k, v in adapter_state_dict(model, name).items()}
    moments: dict[str, torch.Tensor] = {}
    opt_meta: dict[str, Any] | None = None
    if optimizer is not None:
        steps = {float(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state[p]}
        for key in _moment_keys(optimizer):

            def of(p: torch.Tensor, key: str = key) -> torch.Tensor:
                st = optimizer.state.get(p, {})
                return st[key].detach() if key in st else torch.zeros_like(p)

            for k, v in _full_tensors(model, name, of).items():
                moments[f"{k}/{key}"] = v.cpu().contiguous()
        opt_meta = {
            "type": type(optimizer).__name__,
            "step": max(steps, default=0.0),
            "param_groups": _jsonable_groups(optimizer),
        }

    tmp = None
    err = None
    if rank == 0:
        if checkpoint.is_complete(final):
            err = f"adapter checkpoint {final} already exists and is complete; save another step"
        else:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-step_*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
            (tmp / checkpoint.RNG_DIR).mkdir(parents=True)
    shared = [err, str(tmp) if tmp else None]
    if initialized:
        dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise FileExistsError(shared[0])
    tmp = Path(str(shared[1]))
    layout = {"world_size": dist.get_world_size() if initialized else 1, "tp": _tp()[0]}
    rng = json.dumps({"layout": layout, "rng": checkpoint.rng_state()})
    checkpoint._write_atomic(tmp / checkpoint.RNG_DIR / f"rank{rank}.json", rng)
    if rank == 0:
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        if moments:
            save_file(moments, str(tmp / OPTIMIZER_FILE), metadata={"format": "pt"})
        state = {
            "format": FORMAT_VERSION,
            "adapter": name,
            "config": asdict(cfg),
            "base": base,
            "step": step,
            "optimizer": opt_meta,
            "layout": layout,
            "extra": json.loads(extra_text),
        }
        checkpoint._write_atomic(tmp / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))
        for f in (ADAPTER_FILE, OPTIMIZER_FILE):
            if (tmp / f).exists():
                checkpoint.fsync_path(tmp / f)
    if initialized:
        dist.barrier()  # every rank's RNG file is in the folder
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)  # an interrupted save of this step (no marker: checked above)
        os.replace(tmp, final)
        checkpoint.fsync_path(root)
        marker = {"format": FORMAT_VERSION, "step": step, "saved_at": time.time(), "adapter": name, "base": base}
        checkpoint._write_atomic(final / checkpoint.MARKER, json.dumps(marker, sort_keys=True))
    if initialized:
        dist.barrier()
    return final


def latest_adapter(root: str | os.PathLike) -> Path | None:
    """The newest complete adapter checkpoint under ``root`` (highest step), None if there is none.
    Hidden temporary folders and folders without the ``COMPLETE`` marker are skipped."""
    return checkpoint.latest(root)


def read_adapter_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The ``state.json`` of a complete adapter checkpoint (step, base, config, extra ...), no tensors."""
    path = Path(path)
    if not checkpoint.is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete adapter checkpoint (no {checkpoint.MARKER} marker)")
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
    return state


def load_adapter(
    path: str | os.PathLike,
    model: nn.Module,
    name: str,
    optimizer: torch.optim.Optimizer | None = None,
    base: str | None = None,
    restore_rng: bool = True,
) -> AdapterCheckpoint:
    """Load the adapter checkpoint ``path`` into adapter ``name`` of ``model`` (added with the checkpoint's config
    if absent; an existing one must have that config) and its optimizer state into ``optimizer`` (holding exactly
    the adapter's parameters). Any tp: every rank takes its slices. ``base``, when given, must equal the base
    the checkpoint was trained on (ConfigError otherwise). RNG states are restored when the layout is the same.
    Not collective (reads only)."""
    from safetensors.torch import load_file

    path = Path(path)
    state = read_adapter_checkpoint(path)
    if base is not None and state["base"] != base:
        raise ConfigError(
            f"adapter checkpoint {path} was trained on base {state['base']!r}, this model is {base!r}; "
            "fix: load it on that base, or start the adapter afresh"
        )
    saved = state["config"]
    cfg = LoraConfig(
        rank=saved["rank"], alpha=saved["alpha"], targets=tuple(saved["targets"]), dropout=saved["dropout"]
    )
    if name not in adapter_names(model):
        add_adapter(model, name, cfg)
    elif adapter_config(model, name) != cfg:
        raise ConfigError(f"adapter {name!r} has {adapter_config(model, name)}, checkpoint {path} holds {cfg}")
    load_adapter_state_dict(model, name, load_file(str(path / ADAPTER_FILE)))
    if optimizer is not None:
        meta = state.get("optimizer")
        if not meta:
            raise ValueError(f"adapter checkpoint {path} holds no optimizer state; load it with optimizer=None")
        params = adapter_parameters(model, name)
        _opt_entries(optimizer, params)
        moments = load_file(str(path / OPTIMIZER_FILE))
        keys = _moment_keys(optimizer)
        for slot, pair in _pairs(model, name):
            for which in ("lora_A", "lora_B"):
                p = getattr(pair, which)
                st: dict[str, Any] = {"step": torch.tensor(float(meta["step"]), dtype=torch.float32)}
                for key in keys:
                    full = moments.get(f"{slot.key(which)}/{key}")
                    if full is None:
                        raise ValueError(f"adapter checkpoint {path} has no {key} for {slot.key(which)}")
                    st[key] = slot.local(which, full).to(p.device, p.dtype).clone()
                optimizer.state[p] = st
        groups = meta.get("param_groups") or []
        if len(groups) == len(optimizer.param_groups):
            for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
                for k, v in saved_group.items():
                    if k in group and not isinstance(group[k], torch.Tensor):
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v
    if restore_rng:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        rng_file = path / checkpoint.RNG_DIR / f"rank{rank}.json"
        if rng_file.is_file():
            rng = json.loads(rng_file.read_text())
            world = dist.get_world_size() if dist.is_initialized() else 1
            if rng["layout"] == {"world_size": world, "tp": _tp()[0]}:
                checkpoint.set_rng_state(rng["rng"])
    return AdapterCheckpoint(path=path, step=int(state["step"]), base=state["base"], extra=state["extra"], config=cfg)
