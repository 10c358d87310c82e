"""Export: write a model as a Hugging Face checkpoint folder that ``transformers`` loads.

:func:`export_hf` gathers the tensor-parallel shards and writes ``config.json`` and the safetensors files.
Import then export is bit-exact. :func:`init_hf` writes a new randomly initialised checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings
from trainer.checkpoint import unwrap
from trainer.hf.config import CONFIG, INDEX, WEIGHTS, config_from_hf
from trainer.hf.layout import Rule, _global_names, _table_for, _tp, split_qkv
from trainer.model import build_model

#: files of a checkpoint folder an export does not copy (weights are written, the config comes from the import)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _export_dtype(hf_config: Mapping[str, Any], fallback: torch.dtype) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return _DTYPES.get(str(name), fallback)


def _split(rule: Rule, shards: list[torch.Tensor], cfg: ModelSettings) -> dict[str, torch.Tensor]:
    """The HF tensors of one megatron tensor from its tensor-parallel shards (rank order)."""
    if rule.kind == "copy":
        return {rule.hf[0]: shards[0]}
    if rule.kind == "row":
        return {rule.hf[0]: torch.cat(shards, dim=1)}
    if rule.kind == "vocab":
        return {rule.hf[0]: torch.cat(shards)[: cfg.vocab_size]}
    if rule.kind == "gate_up":
        halves = [s.chunk(2) for s in shards]
        return {rule.hf[0]: torch.cat([g for g, _ in halves]), rule.hf[1]: torch.cat([u for _, u in halves])}
    return dict(zip(rule.hf, split_qkv(torch.cat(shards), cfg), strict=True))


def _gather_tp(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The shards of ``t`` from every tensor-parallel rank, on tp rank 0 (None on the others)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, r = _tp()
    if tp == 1:
        return [t]
    group = ps.get_tensor_model_parallel_group()
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(tp)] if r == 0 else None
    dist.gather(t, out, dst=ps.get_tensor_model_parallel_src_rank(), group=group)
    return out


def export_hf(model, cfg: ModelSettings, out: str | os.PathLike) -> Path:
    """Write ``model`` as a Hugging Face checkpoint folder ``out`` (collective: every rank calls it).

    ``config.json`` is ``cfg.hf_config`` as imported; the tensors are gathered from the tensor-parallel ranks
    (data-parallel rank 0 only) and written in the config's ``dtype`` (else the parameters'): ``model.safetensors``,
    or with pp > 1 one file per pipeline stage and ``model.safetensors.index.json``. The padded vocabulary rows are
    cut off; a tied model writes no ``lm_head.weight``. Other files of the source folder (tokenizer, generation
    config) are copied. ``out`` must be absent or empty."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    if cfg.hf_config is None:
        raise ConfigError("export_hf needs the config.json the model was imported from (cfg.hf_config is None)")
    model = unwrap(model)
    out = Path(out)
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    pp = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    stage = ps.get_pipeline_model_parallel_rank() if pp > 1 else 0
    dp_rank = ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0
    tp, tp_rank = _tp()
    err = None
    if rank == 0 and out.exists() and (not out.is_dir() or any(out.iterdir())):
        err = f"export folder {out} exists and is not empty; export to a new folder"
    if initialized:
        flag = [err]
        dist.broadcast_object_list(flag, src=0)
        err = flag[0]
    if err:
        raise FileExistsError(err)

    names = _global_names(model)
    table = _table_for(cfg, names)
    params = model.state_dict(keep_vars=True)
    tensors: dict[str, torch.Tensor] = {}
    if dp_rank == 0:
        for key, gname in names.items():
            if cfg.tie_embeddings and gname == "output_layer.weight":
                continue  # the last stage's copy of the embedding, which the first stage writes
            shards = _gather_tp(params[key].detach())  # on the parameter's device: NCCL gathers no CPU tensors
            if shards is not None:
                dtype = _export_dtype(cfg.hf_config, params[key].dtype)
                for name, t in _split(table[gname], shards, cfg).items():
                    # its own storage: q, k and v of a single query group would be views of one tensor,
                    # which safetensors refuses to write
                    tensors[name] = t.to("cpu", dtype).clone(memory_format=torch.contiguous_format)
    file = WEIGHTS if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
    writer = dp_rank == 0 and tp_rank == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    mine = {name: (file, t.numel() * t.element_size()) for name, t in tensors.items()} if writer else {}
    every = [mine]
    if initialized:
        every = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, mine)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if pp > 1:
            weight_map = {n: f for part in every for n, (f, _) in part.items()}
            size = sum(b for part in every for _, b in part.values())
            index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (out / CONFIG).write_text(json.dumps(cfg.hf_config, indent=2, sort_keys=True) + "\n")
        src = Path(cfg.hf_path) if cfg.hf_path else None
        if src is not None and src.is_dir():
            for f in src.iterdir():
                if f.is_file() and f.name not in (CONFIG, INDEX) and not f.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(f, out / f.name)
    if initialized:
        dist.barrier()
    return out


def init_hf(out: str | os.PathLike, hf_config: Mapping[str, Any], seed: int = 1234) -> Path:
    """A new Hugging Face checkpoint folder ``out`` with ``hf_config`` and randomly initialised weights (megatron's
    init with ``seed``), written by :func:`export_hf`: for trying a loop on a Hugging Face model without one."""
    cfg = config_from_hf(hf_config, seed=seed)
    return export_hf(build_model(cfg), cfg, out)
