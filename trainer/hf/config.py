"""A Hugging Face checkpoint's ``config.json`` <-> :class:`~rtrl.sections.trainer.ModelSettings`, the model section.

:func:`config_from_hf` reads one and refuses what megatron-core's ``GPTModel`` cannot represent.
:func:`config_from_settings` is what ``model.hf_path`` does. :func:`new_hf_config` writes one for a new model.
The folder's file names live here too: the import and the export share them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings, ParallelSettings

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


def config_from_hf(src: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> ModelSettings:
    """The :class:`ModelSettings` of a dense Llama, Qwen2 or Qwen3 checkpoint (folder, config.json or dict).

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
    try:
        return ModelSettings(
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=kv,
            head_dim=0 if head_dim * heads == hidden else head_dim,
            ffn_hidden_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            seq_length=seq_length,
            position_embedding_type="rope",
            rope_base=theta,
            rope_scaling=scaling,
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
    except ValidationError as e:  # a value megatron cannot take (rms_norm_eps 0 ...): named as a setting
        err = e.errors(include_url=False)[0]
        text = f"model.{'.'.join(map(str, err['loc']))} = {err.get('input')!r}: {err['msg']}"
        raise ConfigError(f"{where}: {err['ctx']['error'] if err['type'] == 'value_error' else text}") from None


#: model.* shape settings that model.hf_path decides: (setting, config.json field, value of a ModelSettings)
_SHAPE_SETTINGS: tuple[tuple[str, str, Any], ...] = (
    ("num_layers", "num_hidden_layers", lambda c: c.num_layers),
    ("hidden_size", "hidden_size", lambda c: c.hidden_size),
    ("num_attention_heads", "num_attention_heads", lambda c: c.num_attention_heads),
    ("num_query_groups", "num_key_value_heads", lambda c: c.kv_heads),
    ("head_dim", "head_dim", lambda c: c.kv_channels),
    ("ffn_hidden_size", "intermediate_size", lambda c: c.ffn_width),
    ("vocab_size", "vocab_size", lambda c: c.vocab_size),
    ("normalization", "(RMSNorm)", lambda c: c.normalization),
    ("norm_eps", "rms_norm_eps", lambda c: c.norm_eps),
    ("activation", "hidden_act (silu: swiglu)", lambda c: c.activation),
    ("position_embedding_type", "(rope)", lambda c: c.position_embedding_type),
    ("rope_base", "rope_theta", lambda c: c.rope_base),
    ("rope_scaling", "rope_scaling.rope_type", lambda c: c.rope_scaling),
    ("rope_scaling_factor", "rope_scaling.factor", lambda c: c.rope_scaling_factor),
    ("tie_embeddings", "tie_word_embeddings", lambda c: c.tie_embeddings),
    ("qkv_bias", "attention_bias / model_type", lambda c: c.qkv_bias),
    ("linear_bias", "attention_bias, mlp_bias", lambda c: c.linear_bias),
    ("qk_layernorm", "model_type (qwen3: QK-norm)", lambda c: c.qk_layernorm),
)
#: what a shape setting of 0 means, from the checkpoint's model
_DERIVED: dict[str, Any] = {
    "num_query_groups": lambda c: c.num_attention_heads,
    "head_dim": lambda c: c.hidden_size // c.num_attention_heads,
    "ffn_hidden_size": lambda c: 4 * c.hidden_size,
}


def config_from_settings(m: ModelSettings, parallel: ParallelSettings) -> ModelSettings:
    """The model of ``model.hf_path`` (``m`` is the settings' ``model`` section): the architecture from the
    checkpoint; ``seq_length`` (when set), ``vocab_multiple``, dropouts, init std and seed from the settings.
    A shape setting the user set (config file or environment) that disagrees with the checkpoint is refused,
    naming both."""
    explicit = m.model_fields_set
    cfg = config_from_hf(
        m.hf_path,
        parallel=parallel,
        seq_length=m.seq_length if "seq_length" in explicit else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        seed=m.seed,
        vocab_multiple=m.vocab_multiple or VOCAB_MULTIPLE,
    )
    for name, hf_name, of in _SHAPE_SETTINGS:
        if name not in explicit:
            continue
        have = of(cfg)
        want = getattr(m, name)
        if name in _DERIVED:
            want = want or _DERIVED[name](cfg)
        if want != have:
            raise ConfigError(
                f"model.{name} = {getattr(m, name)!r} disagrees with model.hf_path = {m.hf_path!r}, whose "
                f"config.json gives {have!r} ({hf_name}); fix: remove model.{name} (the checkpoint decides the "
                f"architecture) or set it to {have!r}"
            )
    return cfg


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
    head_dim: int = 0,
) -> dict[str, Any]:
    """A ``config.json`` for a new model of ``family`` (llama, qwen2, qwen3) with this shape, as transformers
    writes one (``torch_dtype`` float32); :func:`config_from_hf` reads it back. ``head_dim`` 0 is hidden / heads;
    Qwen2 has no head width of its own."""
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
    head_dim = head_dim or hidden_size // num_attention_heads
    if family == "qwen2" and head_dim * num_attention_heads != hidden_size:
        raise ConfigError(f"model.head_dim = {head_dim}: a Qwen2 model's head width is hidden / heads; fix: unset it")
    if family == "llama":
        d |= {"attention_bias": False, "mlp_bias": False, "head_dim": head_dim}
    elif family == "qwen2":
        d |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers}
    else:
        d |= {
            "attention_bias": False,
            "head_dim": head_dim,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": num_layers,
        }
    return d
