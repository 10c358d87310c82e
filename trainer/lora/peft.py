"""Hugging Face PEFT folders of an adapter: :func:`export_peft` writes one, :func:`load_peft` reads one back.

:func:`export_peft` writes a Hugging Face PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``)
for Llama/Qwen2/Qwen3 models (what :mod:`trainer.hf` converts): ``linear_qkv`` becomes ``q_proj``, ``k_proj``,
``v_proj`` (each a copy of the shared ``A`` and its rows of ``B``, taken apart with :func:`trainer.hf.layout.split_qkv`),
``linear_fc1`` ``gate_proj`` and ``up_proj``, ``linear_proj`` ``o_proj``, ``linear_fc2`` ``down_proj``,
``output_layer`` ``lm_head`` (``B`` without the padded vocabulary rows, which :func:`load_peft` fills with zeros).
It is exact: each HF delta ``B_x @ A`` is the rows of the fused ``B @ A``. :func:`load_peft` fuses such a folder back
(q, k and v, and gate and up, must share one ``A``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rtrl.errors import ConfigError
from rtrl.sections.trainer import LoraConfig, ModelSettings
from trainer.hf.layout import interleave_qkv, name_table, qkv_geometry, split_qkv
from trainer.lora.adapters import (
    _pairs,
    adapter_config,
    adapter_state_dict,
    add_adapter,
    load_adapter_state_dict,
    remove_adapter,
)
from trainer.lora.layers import MODEL_TARGETS, TARGETS

#: the Hugging Face modules each target becomes in a PEFT export (under ``model.layers.{i}.``; a model target's
#: at the top)
HF_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
    "output_layer": ("lm_head",),
}
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _hf_modules(target: str, layer: int) -> tuple[str, ...]:
    if target in MODEL_TARGETS:
        return HF_MODULES[target]
    return tuple(f"model.layers.{layer}.{m}" for m in HF_MODULES[target])


def _check_hf(model_cfg: ModelSettings) -> None:
    name_table(model_cfg)  # RMSNorm + SwiGLU + RoPE (Llama, Qwen2, Qwen3) or ConfigError


def export_peft(
    model: nn.Module, model_cfg: ModelSettings, name: str, out_dir: str | os.PathLike, base_model_name_or_path: str = ""
) -> Path:
    """Write adapter ``name`` as a Hugging Face PEFT LoRA folder ``out_dir`` (collective over tp; rank 0 writes).

    ``adapter_config.json`` (``peft_type`` LORA, ``task_type`` CAUSAL_LM, r, lora_alpha, lora_dropout, the HF
    ``target_modules``) and ``adapter_model.safetensors`` with keys
    ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` / ``.lora_B.weight`` (and
    ``base_model.model.lm_head.lora_A.weight`` / ``.lora_B.weight``, the real vocabulary's rows), in the
    base weights' dtype: what ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loader read. For models
    :mod:`trainer.hf` converts (Llama, Qwen2, Qwen3). ``out_dir`` must be absent or empty."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    _check_hf(model_cfg)
    cfg = adapter_config(model, name)
    out = Path(out_dir)
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    err = None
    if rank == 0 and out.exists() and (not out.is_dir() or any(out.iterdir())):
        err = f"PEFT export folder {out} exists and is not empty; export to a new folder"
    flag = [err]
    if initialized:
        dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        raise FileExistsError(flag[0])
    full = adapter_state_dict(model, name)
    tensors: dict[str, torch.Tensor] = {}
    for slot, _ in _pairs(model, name):
        a, b = full[slot.key("lora_A")], full[slot.key("lora_B")]
        modules = _hf_modules(slot.target, slot.layer)
        if slot.target == "linear_qkv":
            bs: tuple[torch.Tensor, ...] = split_qkv(b, model_cfg)
        elif slot.target == "linear_fc1":
            bs = tuple(b.chunk(2))  # [gate; up], as trainer.hf takes the weight apart
        elif slot.target == "output_layer":
            bs = (b[: model_cfg.vocab_size],)  # the padded vocabulary rows are cut off, as export_hf does
        else:
            bs = (b,)
        for module, b_part in zip(modules, bs, strict=True):
            # own storage per tensor: q, k and v rows of one B are views, and A is shared
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.cpu().clone(memory_format=torch.contiguous_format)
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.cpu().clone(memory_format=torch.contiguous_format)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path or None,
            "r": cfg.rank,
            "lora_alpha": int(cfg.alpha) if cfg.alpha.is_integer() else cfg.alpha,  # PEFT and vLLM type it int
            "lora_dropout": cfg.dropout,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for t in cfg.targets for m in HF_MODULES[t]}),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "lora_bias": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": None,
        }
        save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
        (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if initialized:
        dist.barrier()
    return out


def _peft_refuse(folder: Path, what: str) -> ConfigError:
    return ConfigError(f"PEFT adapter {folder}: {what}")


def load_peft(model: nn.Module, model_cfg: ModelSettings, name: str, folder: str | os.PathLike) -> LoraConfig:
    """Add adapter ``name`` to ``model`` from a PEFT LoRA folder (as :func:`export_peft` writes), re-fusing
    q/k/v into ``linear_qkv`` (with :func:`trainer.hf.layout.interleave_qkv`) and gate/up into ``linear_fc1``; each
    rank takes its slices. Fused modules share one ``A`` here, so their HF ``lora_A`` must be equal, and all of
    q/k/v (gate/up) must be targeted or none; anything else PEFT-specific (DoRA, rsLoRA, LoRA biases, rank or
    alpha patterns, modules_to_save, a subset of layers) is refused with a ConfigError. Returns the config."""
    from safetensors.torch import load_file

    _check_hf(model_cfg)
    folder = Path(folder)
    if not (folder / PEFT_CONFIG).is_file() or not (folder / PEFT_WEIGHTS).is_file():
        raise _peft_refuse(folder, f"needs {PEFT_CONFIG} and {PEFT_WEIGHTS}")
    c = json.loads((folder / PEFT_CONFIG).read_text())
    if c.get("peft_type") != "LORA":
        raise _peft_refuse(folder, f"peft_type = {c.get('peft_type')!r}, only LORA is supported")
    for key, ok in (
        ("bias", "none"),
        ("use_rslora", False),
        ("use_dora", False),
        ("lora_bias", False),
        ("fan_in_fan_out", False),
    ):
        if c.get(key, ok) != ok:
            raise _peft_refuse(folder, f"{key} = {c.get(key)!r} is not supported (only {ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "target_parameters"):
        if c.get(key):
            raise _peft_refuse(folder, f"{key} = {c.get(key)!r} is not supported")
    modules = c.get("target_modules")
    if not isinstance(modules, list):
        raise _peft_refuse(folder, f"target_modules = {modules!r} must be a list of module names")
    short = {t: {m.rsplit(".", 1)[-1] for m in ms} for t, ms in HF_MODULES.items()}
    allowed = set().union(*short.values())
    if unknown := sorted(set(modules) - allowed):
        raise _peft_refuse(folder, f"target_modules {unknown} have no megatron counterpart here")
    targets = []
    for target, names in short.items():
        have = names & set(modules)
        if have and have != names:
            raise _peft_refuse(
                folder,
                f"targets {sorted(have)} but not {sorted(names - have)}: megatron fuses them into {target}; "
                "fix: train the adapter on all of them or none",
            )
        if have:
            targets.append(target)
    cfg = LoraConfig(
        rank=int(c["r"]), alpha=float(c["lora_alpha"]), targets=tuple(targets), dropout=float(c.get("lora_dropout", 0))
    )
    raw = load_file(str(folder / PEFT_WEIGHTS))
    if bad := sorted(k for k in raw if not k.startswith(PEFT_PREFIX)):
        raise _peft_refuse(folder, f"tensor names without the {PEFT_PREFIX!r} prefix: {bad[:3]}")
    weights = {k[len(PEFT_PREFIX) :]: v for k, v in raw.items()}
    used: set[str] = set()

    def get(module: str, which: str) -> torch.Tensor:
        key = f"{module}.{which}.weight"
        if key not in weights:
            raise _peft_refuse(folder, f"tensor {PEFT_PREFIX}{key} is missing")
        used.add(key)
        return weights[key]

    state: dict[str, torch.Tensor] = {}
    for target in (t for t in targets if t in MODEL_TARGETS):  # lm_head: zero rows for the padded vocabulary
        (module,) = _hf_modules(target, -1)
        b = get(module, "lora_B")
        if b.shape[0] != model_cfg.vocab_size:
            raise _peft_refuse(
                folder,
                f"{module}.lora_B has {b.shape[0]} rows, this model's vocabulary {model_cfg.vocab_size}: an adapter "
                "of another vocabulary",
            )
        state[f"{TARGETS[target][0]}.lora_A"] = get(module, "lora_A")
        pad = model_cfg.padded_vocab_size - b.shape[0]
        state[f"{TARGETS[target][0]}.lora_B"] = torch.cat([b, b.new_zeros(pad, b.shape[1])]) if pad > 0 else b
    for layer in range(model_cfg.num_layers):
        for target in (t for t in targets if t not in MODEL_TARGETS):
            mods = _hf_modules(target, layer)
            a_s = [get(m, "lora_A") for m in mods]
            b_s = [get(m, "lora_B") for m in mods]
            if any(not torch.equal(a, a_s[0]) for a in a_s[1:]):
                raise _peft_refuse(
                    folder,
                    f"{', '.join(mods)} have different lora_A: megatron's fused {target} shares one A, so this adapter "
                    "cannot be fused exactly; fix: train it with one A for them (export_peft does) or merge it",
                )
            key = f"decoder.layers.{layer}.{TARGETS[target][0]}"
            state[f"{key}.lora_A"] = a_s[0]
            if target == "linear_qkv":
                state[f"{key}.lora_B"] = interleave_qkv(b_s[0], b_s[1], b_s[2], qkv_geometry(model_cfg)[0])
            else:
                state[f"{key}.lora_B"] = torch.cat(b_s)
    if extra := sorted(set(weights) - used):
        raise _peft_refuse(folder, f"tensors with no place in this model: {extra[:4]}")
    add_adapter(model, name, cfg)
    try:
        load_adapter_state_dict(model, name, state)
    except ValueError as e:
        remove_adapter(model, name)
        raise _peft_refuse(folder, str(e)) from None
    return cfg
