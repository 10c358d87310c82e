"""Which Hugging Face tensors make each megatron tensor, and megatron's fused layouts.

:func:`name_table` maps every tensor of a whole model to its Hugging Face tensors, for the local layer spec (CPU)
and the Transformer Engine spec (GPU). :func:`interleave_qkv` and :func:`split_qkv` convert ``linear_qkv``'s
per-group layout. The import, the export and the PEFT export of adapters all read these tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings

Kind = Literal["copy", "vocab", "qkv", "gate_up", "row"]


@dataclass(frozen=True)
class Rule:
    """How one megatron tensor is made of Hugging Face tensors."""

    kind: Kind
    """copy (replicated), vocab (vocab-parallel rows, padded), qkv (per-group interleave, split by groups),
    gate_up ([gate; up], each split by rows), row (row-parallel: split by columns)."""
    hf: tuple[str, ...]


def name_table(cfg: ModelSettings, spec: Literal["local", "te"] = "local") -> dict[str, Rule]:
    """Every tensor of a whole (pp = 1) megatron GPTModel of ``cfg`` -> the HF tensors it is made of.

    ``local``: megatron-core's local spec (``get_gpt_layer_local_spec``, CPU): separate ``input_layernorm`` and
    ``pre_mlp_layernorm``. ``te``: the Transformer Engine spec (``get_gpt_layer_with_transformer_engine_spec``):
    those norms live in ``TELayerNormColumnParallelLinear`` as ``self_attention.linear_qkv.layer_norm_weight``
    and ``mlp.linear_fc1.layer_norm_weight`` (the names the local spec's ``sharded_state_dict_keys_map`` maps
    its own to, so checkpoints of both specs interchange). Names use global layer numbers.
    """
    if spec not in ("local", "te"):
        raise ValueError(f"spec must be 'local' or 'te', not {spec!r}")
    if cfg.normalization != "RMSNorm" or cfg.activation != "swiglu" or cfg.position_embedding_type != "rope":
        raise ConfigError(
            "Hugging Face conversion covers RMSNorm + SwiGLU + RoPE models (Llama, Qwen2, Qwen3); this one has "
            f"model.normalization = {cfg.normalization!r}, model.activation = {cfg.activation!r}, "
            f"model.position_embedding_type = {cfg.position_embedding_type!r}"
        )
    t: dict[str, Rule] = {"embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",))}
    in_norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight"
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        a = h + "self_attn."
        t[m + in_norm] = Rule("copy", (h + "input_layernorm.weight",))
        t[m + "self_attention.linear_qkv.weight"] = Rule("qkv", tuple(a + f"{x}_proj.weight" for x in "qkv"))
        if cfg.qkv_bias:
            t[m + "self_attention.linear_qkv.bias"] = Rule("qkv", tuple(a + f"{x}_proj.bias" for x in "qkv"))
        if cfg.qk_layernorm:
            t[m + "self_attention.q_layernorm.weight"] = Rule("copy", (a + "q_norm.weight",))
            t[m + "self_attention.k_layernorm.weight"] = Rule("copy", (a + "k_norm.weight",))
        t[m + "self_attention.linear_proj.weight"] = Rule("row", (a + "o_proj.weight",))
        t[m + mlp_norm] = Rule("copy", (h + "post_attention_layernorm.weight",))
        t[m + "mlp.linear_fc1.weight"] = Rule("gate_up", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"))
        t[m + "mlp.linear_fc2.weight"] = Rule("row", (h + "mlp.down_proj.weight",))
        if cfg.linear_bias:
            t[m + "self_attention.linear_proj.bias"] = Rule("copy", (a + "o_proj.bias",))
            t[m + "mlp.linear_fc1.bias"] = Rule("gate_up", (h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"))
            t[m + "mlp.linear_fc2.bias"] = Rule("copy", (h + "mlp.down_proj.bias",))
    t["decoder.final_layernorm.weight"] = Rule("copy", ("model.norm.weight",))
    if not cfg.tie_embeddings:
        t["output_layer.weight"] = Rule("vocab", ("lm_head.weight",))
    return t


def hf_shapes(cfg: ModelSettings) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of a model of ``cfg`` (what a checkpoint must hold)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    kv, d, f = cfg.kv_heads, cfg.kv_channels, cfg.ffn_width
    by_suffix = {
        "q_proj.weight": (heads * d, h),
        "k_proj.weight": (kv * d, h),
        "v_proj.weight": (kv * d, h),
        "q_proj.bias": (heads * d,),
        "k_proj.bias": (kv * d,),
        "v_proj.bias": (kv * d,),
        "o_proj.weight": (h, heads * d),
        "o_proj.bias": (h,),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
        "gate_proj.bias": (f,),
        "up_proj.bias": (f,),
        "down_proj.bias": (h,),
        "layernorm.weight": (h,),
        "norm.weight": (h,),
        "embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    out = {}
    for rule in name_table(cfg).values():
        for name in rule.hf:
            out[name] = next(shape for suffix, shape in by_suffix.items() if name.endswith(suffix))
    return out


def _global_names(model) -> dict[str, str]:
    """This rank's parameter names -> names with global layer numbers (pipeline stages number theirs from 0)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    offset = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(layers)}
    out = {}
    for key in model.state_dict(keep_vars=True):
        if key.endswith("_extra_state"):
            continue
        if key.startswith("decoder.layers."):
            i, rest = key[len("decoder.layers.") :].split(".", 1)
            out[key] = f"decoder.layers.{offset[i]}.{rest}"
        else:
            out[key] = key
    return out


def _table_for(cfg: ModelSettings, names: dict[str, str]) -> dict[str, Rule]:
    """The table (local or TE spec) that holds every tensor of ``model``; a tied model's last pipeline stage
    has its own copy of the embedding as ``output_layer.weight``."""
    for spec in ("local", "te"):
        table = name_table(cfg, spec)  # type: ignore[arg-type]
        if cfg.tie_embeddings:
            table["output_layer.weight"] = table["embedding.word_embeddings.weight"]
        if all(g in table for g in names.values()):
            return table
    unknown = sorted(g for g in names.values() if g not in name_table(cfg, "local") and g not in name_table(cfg, "te"))
    raise ConfigError(f"model tensors with no Hugging Face counterpart: {', '.join(unknown[:6])}")


def qkv_geometry(cfg: ModelSettings) -> tuple[int, int, int]:
    """(query groups = KV heads, query heads per group, head width) of ``linear_qkv``'s per-group layout."""
    groups = cfg.kv_heads
    return groups, cfg.num_attention_heads // groups, cfg.kv_channels


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``linear_qkv`` rows from the rows of ``groups`` consecutive query groups of q, k and v (HF ``q_proj``,
    ``k_proj``, ``v_proj`` weights, biases or any tensor with their rows): ``[q heads of group 0, k_0, v_0,
    q heads of group 1, ...]``. Trailing dims are kept."""
    tail = q.shape[1:]
    parts = [q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)]
    return torch.cat(parts, 1).reshape(-1, *tail)


def split_qkv(full: torch.Tensor, cfg: ModelSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`interleave_qkv` for a whole (tp = 1 layout) ``linear_qkv`` tensor: (q, k, v) rows."""
    groups, qpg, d = qkv_geometry(cfg)
    tail = full.shape[1:]
    q, k, v = full.reshape(groups, (qpg + 2) * d, *tail).split([qpg * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
