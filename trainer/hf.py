"""Hugging Face <-> Megatron-Core conversion for the dense Llama, Qwen2 and Qwen3 families.

- :func:`config_from_hf` reads a checkpoint's ``config.json`` into a :class:`~trainer.config.ModelConfig`
  (layers, width, heads, GQA groups, head width, FFN width, vocabulary, RMSNorm epsilon, SwiGLU, RoPE base
  and scaling, QKV bias, Qwen3's QK-norm, tied embeddings, positions) and refuses, with a
  :class:`~rtrl.errors.ConfigError` naming the field, what megatron-core's ``GPTModel`` cannot represent
  (mixture of experts, sliding windows, RoPE types other than default/linear/llama3, ...).
  :func:`config_from_settings` is what ``model.hf_path`` does.
- :func:`name_table` maps every megatron tensor to the Hugging Face tensors it is made of, for the local
  layer spec (CPU) and the Transformer Engine spec (GPU: the norms before attention and MLP are fused into
  ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``).
- :func:`load_hf` fills a built model (any tp, pp) from the safetensors files: each rank reads only its own
  shard of each tensor through ``safe_open(...).get_slice(name)[...]``; no full tensor is materialised and no
  rank talks to another.
- :func:`export_hf` gathers the tensor-parallel shards and writes ``config.json`` (the one imported, as read)
  and ``model.safetensors`` (one file per pipeline stage plus ``model.safetensors.index.json`` when pp > 1),
  which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Import then export is bit-exact.

Layouts (per layer; ``ng`` query groups = KV heads, ``qpg`` query heads per group, ``d`` head width):

- ``linear_qkv`` is laid out per query group: ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1,
  ...]`` (megatron's ``SelfAttention.get_query_key_value_tensors`` views it as ``[ng, (qpg + 2) * d]``); the
  HF ``q_proj``/``k_proj``/``v_proj`` rows are interleaved so on import and taken apart on export. Tensor
  parallelism splits it by whole groups: rank r holds groups ``r * ng/tp .. (r+1) * ng/tp - 1``, so it reads
  three contiguous row ranges (its groups' q heads, k heads, v heads). Biases alike.
- ``linear_fc1`` is ``[gate; up]`` (SwiGLU: ``silu(x W_gate) * (x W_up)``); rank r holds
  ``[gate rows of r; up rows of r]``, read as two row ranges.
- Row-parallel ``linear_proj`` (``o_proj``) and ``linear_fc2`` (``down_proj``): rank r reads its column range.
- Vocab-parallel embedding and output layer: the vocabulary is padded to ``cfg.padded_vocab_size`` (a multiple of
  lcm(:data:`VOCAB_MULTIPLE`, tp), Megatron-LM's ``make_vocab_size_divisible_by`` = 128 without the tp factor
  for power-of-two tp, so the padded size and hence checkpoints do not depend on tp); rank r holds rows
  ``r * Vp/tp ..``, reads the real ones among them and leaves the padding rows zero. Their logits are masked
  (:func:`trainer.model.mask_padded_vocab`); export cuts them off.
- Norms (and row-parallel biases) are replicated: every rank reads them whole.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from rtrl.errors import ConfigError
from trainer.checkpoint import unwrap
from trainer.config import ModelConfig, ParallelConfig

log = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3")
#: the vocabulary is padded to a multiple of lcm(VOCAB_MULTIPLE, tp) (Megatron-LM's default make_vocab_size_divisible_by)
VOCAB_MULTIPLE = 128
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: top-level keys that mean a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek)
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
#: RoPE types megatron-core's GPTModel represents (llama3 only with Llama 3.1's frequency factors)
ROPE_TYPES = ("default", "linear", "llama3")
#: the llama3 scaling megatron-core's RotaryEmbedding._apply_scaling hard-codes (only the factor is a parameter)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: files of a checkpoint folder an export does not copy (weights are written, the config comes from the import)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

Kind = Literal["copy", "vocab", "qkv", "gate_up", "row"]


# --------------------------------------------------------------------------- config


def read_hf_config(src: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """(the config dict, where it came from) for a checkpoint folder, a ``config.json`` path or a dict."""
    if isinstance(src, Mapping):
        return dict(src), "Hugging Face config"
    path = Path(src)
    file = path / CONFIG if path.is_dir() else path
    where = f"Hugging Face checkpoint {path}"
    if not file.is_file():
        raise ConfigError(f"{where}: no {CONFIG} (expected a folder with config.json and *.safetensors)")
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"{where}: {file.name} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {file.name} holds {type(data).__name__}, not an object")
    return data, where


def _folder(src: str | os.PathLike | Mapping[str, Any]) -> str:
    if isinstance(src, Mapping):
        return ""
    path = Path(src)
    return str(path if path.is_dir() else path.parent)


def _refuse(where: str, name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: config.json {name} = {value!r} {why}")


def _rope(d: Mapping[str, Any], where: str) -> tuple[float, str, float]:
    """(theta, megatron scaling "" | "llama3" | "linear", factor) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rp = d.get(key) or {}
    if not isinstance(rp, Mapping):
        raise _refuse(where, key, rp, "must be an object")
    theta = rp.get("rope_theta") or d.get("rope_theta") or 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise _refuse(where, "rope_theta", theta, "must be a number > 0")
    partial = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(where, "partial_rotary_factor", partial, "is not supported (RoPE on every head dimension only)")
    rtype = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
    if rtype not in ROPE_TYPES:
        raise _refuse(
            where,
            f"{key}.rope_type",
            rtype,
            f"cannot be represented by megatron-core's GPTModel (supported: {', '.join(ROPE_TYPES)})",
        )
    if rtype == "default":
        return float(theta), "", 1.0
    factor = rp.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise _refuse(where, f"{key}.factor", factor, "must be a number > 0")
    if rtype == "llama3":
        for name, want in LLAMA3_FIXED.items():
            if float(rp.get(name, want)) != want:
                raise _refuse(
                    where,
                    f"{key}.{name}",
                    rp.get(name),
                    f"cannot be represented: megatron-core's llama3 RoPE scaling fixes it at {want:g}",
                )
        return float(theta), "llama3", float(factor)
    return float(theta), "linear", float(factor)


def config_from_hf(src: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a dense Llama, Qwen2 or Qwen3 checkpoint (folder, config.json or dict).

    ``overrides`` set what a checkpoint does not decide: ``parallel``, ``seq_length`` (default:
    ``max_position_embeddings``), ``hidden_dropout``, ``attention_dropout``, ``init_method_std``, ``seed``,
    ``vocab_multiple`` (default :data:`VOCAB_MULTIPLE`). Unsupported configs raise ConfigError naming the field.
    """
    d, where = read_hf_config(src)
    allowed = {
        "parallel",
        "seq_length",
        "hidden_dropout",
        "attention_dropout",
        "init_method_std",
        "seed",
        "vocab_multiple",
    }
    if bad := sorted(set(overrides) - allowed):
        raise TypeError(f"config_from_hf: {', '.join(bad)} come from the checkpoint, not from overrides")
    for name in MOE_FIELDS:
        if d.get(name):
            raise _refuse(
                where, name, d[name], "means mixture of experts: only dense Llama, Qwen2 and Qwen3 are supported"
            )
    family = d.get("model_type")
    if family not in FAMILIES:
        raise _refuse(where, "model_type", family, f"is not supported (dense {', '.join(FAMILIES)})")
    if d.get("quantization_config"):
        raise _refuse(where, "quantization_config", "...", "is set: quantized weights are not supported")
    if d.get("use_sliding_window"):
        raise _refuse(where, "use_sliding_window", d["use_sliding_window"], "is not supported (full attention only)")
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(where, "layer_types", sorted(set(layer_types)), "is not supported (full_attention only)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, "hidden_act", act, "is not supported (SwiGLU: silu)")

    def need(name: str) -> Any:
        v = d.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise _refuse(where, name, v, "must be a positive integer")
        return v

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv = d.get("num_key_value_heads") or heads
    head_dim = d.get("head_dim") or (128 if family == "qwen3" else hidden // heads)
    if family == "llama":
        attn_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            name = "attention_bias" if attn_bias else "mlp_bias"
            raise _refuse(
                where,
                name,
                True,
                "without the other (attention_bias, mlp_bias) cannot be represented: megatron's add_bias_linear "
                "puts biases on o_proj and the MLP together",
            )
        qkv_bias = linear_bias = attn_bias
    elif family == "qwen2":
        qkv_bias, linear_bias = True, False  # q/k/v always have biases, o_proj and the MLP none
    else:
        if d.get("attention_bias"):
            raise _refuse(
                where,
                "attention_bias",
                True,
                "cannot be represented: it also puts a bias on o_proj, which megatron has only together with MLP "
                "biases (add_bias_linear)",
            )
        qkv_bias = linear_bias = False
    theta, scaling, factor = _rope(d, where)
    max_pos = need("max_position_embeddings") if "max_position_embeddings" in d else None
    seq_length = overrides.pop("seq_length", None) or max_pos or 4096
    if max_pos is not None and seq_length > max_pos:
        raise ConfigError(
            f"model.seq_length = {seq_length} exceeds {where}'s max_position_embeddings = {max_pos}; fix: "
            f"lower model.seq_length to at most {max_pos}"
        )
    overrides.setdefault("vocab_multiple", VOCAB_MULTIPLE)
    return ModelConfig(
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv,
        head_dim=None if head_dim * heads == hidden else head_dim,
        ffn_hidden_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        seq_length=seq_length,
        position_embedding_type="rope",
        rope_base=theta,
        rope_scaling=scaling,  # type: ignore[arg-type]
        rope_scaling_factor=factor,
        normalization="RMSNorm",
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        qk_layernorm=family == "qwen3",
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        hf_path=_folder(src),
        hf_config=d,
        **overrides,
    )


#: model.* shape settings that model.hf_path decides: (setting, config.json field, value of a ModelConfig)
_SHAPE_SETTINGS: tuple[tuple[str, str, Any], ...] = (
    ("num_layers", "num_hidden_layers", lambda c: c.num_layers),
    ("hidden_size", "hidden_size", lambda c: c.hidden_size),
    ("num_attention_heads", "num_attention_heads", lambda c: c.num_attention_heads),
    ("num_query_groups", "num_key_value_heads", lambda c: c.num_query_groups or c.num_attention_heads),
    ("ffn_hidden_size", "intermediate_size", lambda c: c.ffn_hidden_size),
    ("vocab_size", "vocab_size", lambda c: c.vocab_size),
    ("normalization", "(RMSNorm)", lambda c: c.normalization),
    ("activation", "hidden_act (silu: swiglu)", lambda c: c.activation),
    ("position_embedding_type", "(rope)", lambda c: c.position_embedding_type),
    ("rope_base", "rope_theta", lambda c: c.rope_base),
    ("tie_embeddings", "tie_word_embeddings", lambda c: c.tie_embeddings),
    ("qkv_bias", "attention_bias / model_type", lambda c: c.qkv_bias),
    ("linear_bias", "attention_bias, mlp_bias", lambda c: c.linear_bias),
)


def config_from_settings(m: Any, parallel: ParallelConfig) -> ModelConfig:
    """The model of ``model.hf_path`` (``m`` is the settings' ``model`` section): the architecture from the
    checkpoint; ``seq_length`` (when set), dropouts, init std and seed from the settings. A shape setting the
    user set (config file or environment) that disagrees with the checkpoint is refused, naming both."""
    explicit = m.model_fields_set
    cfg = config_from_hf(
        m.hf_path,
        parallel=parallel,
        seq_length=m.seq_length if "seq_length" in explicit else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        seed=m.seed,
    )
    for name, hf_name, of in _SHAPE_SETTINGS:
        if name not in explicit:
            continue
        have = of(cfg)
        want = getattr(m, name)
        if name == "num_query_groups":
            want = want or cfg.num_attention_heads
        elif name == "ffn_hidden_size":
            want = want or 4 * cfg.hidden_size
        if want != have:
            raise ConfigError(
                f"model.{name} = {getattr(m, name)!r} disagrees with model.hf_path = {m.hf_path!r}, whose "
                f"config.json gives {have!r} ({hf_name}); fix: remove model.{name} (the checkpoint decides the "
                f"architecture) or set it to {have!r}"
            )
    return cfg


# --------------------------------------------------------------------------- name mapping


@dataclass(frozen=True)
class Rule:
    """How one megatron tensor is made of Hugging Face tensors."""

    kind: Kind
    """copy (replicated), vocab (vocab-parallel rows, padded), qkv (per-group interleave, split by groups),
    gate_up ([gate; up], each split by rows), row (row-parallel: split by columns)."""
    hf: tuple[str, ...]


def name_table(cfg: ModelConfig, spec: Literal["local", "te"] = "local") -> dict[str, Rule]:
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


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of a model of ``cfg`` (what a checkpoint must hold)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    kv, d = cfg.num_query_groups or heads, cfg.head_dim or cfg.hidden_size // heads
    f = cfg.ffn_hidden_size or 4 * h
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


def _table_for(cfg: ModelConfig, names: dict[str, str]) -> dict[str, Rule]:
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


# --------------------------------------------------------------------------- fused layouts


def qkv_geometry(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query groups = KV heads, query heads per group, head width) of ``linear_qkv``'s per-group layout."""
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return groups, cfg.num_attention_heads // groups, cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``linear_qkv`` rows from the rows of ``groups`` consecutive query groups of q, k and v (HF ``q_proj``,
    ``k_proj``, ``v_proj`` weights, biases or any tensor with their rows): ``[q heads of group 0, k_0, v_0,
    q heads of group 1, ...]``. Trailing dims are kept."""
    tail = q.shape[1:]
    parts = [q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)]
    return torch.cat(parts, 1).reshape(-1, *tail)


def split_qkv(full: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`interleave_qkv` for a whole (tp = 1 layout) ``linear_qkv`` tensor: (q, k, v) rows."""
    groups, qpg, d = qkv_geometry(cfg)
    tail = full.shape[1:]
    q, k, v = full.reshape(groups, (qpg + 2) * d, *tail).split([qpg * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# --------------------------------------------------------------------------- reading


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


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _shard(ck: _Checkpoint, rule: Rule, cfg: ModelConfig, tp: int, r: int) -> torch.Tensor:
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


def _check_tensors(ck: _Checkpoint, cfg: ModelConfig, path: Path) -> None:
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


def check_hf(cfg: ModelConfig, path: str | os.PathLike | None = None) -> None:
    """Refuse (ConfigError) a Hugging Face checkpoint folder ``path`` (default ``cfg.hf_path``) that :func:`load_hf`
    would refuse for ``cfg``: no safetensors, a missing or extra tensor, a shape its config does not give. Reads
    only the files' headers, so a job can check its model before it deletes or starts anything."""
    path = Path(path or cfg.hf_path)
    if not str(path) or not path.is_dir():
        raise ConfigError(f"Hugging Face checkpoint {path} is not a folder")
    with ExitStack() as stack:
        _check_tensors(_Checkpoint(path, stack, LoadReport()), cfg, path)


def load_hf(model, cfg: ModelConfig, path: str | os.PathLike | None = None) -> LoadReport:
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


# --------------------------------------------------------------------------- export


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _export_dtype(hf_config: Mapping[str, Any], fallback: torch.dtype) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return _DTYPES.get(str(name), fallback)


def _split(rule: Rule, shards: list[torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
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


def export_hf(model, cfg: ModelConfig, out: str | os.PathLike) -> Path:
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


def new_hf_config(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    rms_norm_eps: float = 1e-6,
) -> dict[str, Any]:
    """A ``config.json`` for a new model of ``family`` (llama, qwen2, qwen3) with this shape, as transformers
    writes one (``torch_dtype`` float32); :func:`config_from_hf` reads it back."""
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is not supported; use one of {', '.join(FAMILIES)}")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    d: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "llama":
        d |= {"attention_bias": False, "mlp_bias": False, "head_dim": hidden_size // num_attention_heads}
    elif family == "qwen2":
        d |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers}
    else:
        d |= {
            "attention_bias": False,
            "head_dim": hidden_size // num_attention_heads,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": num_layers,
        }
    return d


def init_hf(out: str | os.PathLike, hf_config: Mapping[str, Any], seed: int = 1234) -> Path:
    """A new Hugging Face checkpoint folder ``out`` with ``hf_config`` and randomly initialised weights (megatron's
    init with ``seed``), written by :func:`export_hf`: for trying a loop on a Hugging Face model without one."""
    from trainer.model import build_model

    cfg = config_from_hf(hf_config, seed=seed)
    return export_hf(build_model(cfg), cfg, out)
