"""The trainer's sections of the settings tree, and its typed configs: the model's architecture, parallel layout
and precision, and how a run trains.

The sections (``loss``, ``train``, ``model``, ``parallel``, ``precision``, ``adapters``) are what the settings
file and the environment set. The loss, model, parallel and precision sections are themselves the configs their
code takes. Their checks name the setting (``model.hidden_size`` ...) and the fix.
``ModelSettings.tiny()`` is the preset the CPU tests and the local simulator train: a few seconds per step on 2 cores.
:class:`TrainConfig` is how a run trains, made from the ``train`` and ``loss`` sections.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import NoDecode

from rtrl.errors import ConfigError
from rtrl.section import Section, setting

if TYPE_CHECKING:
    from rtrl.settings import Settings


class LossSettings(Section):
    """Dr. GRPO clipped ratio, truncated importance weights, k3 KL."""

    # the config trainer.loss.policy_loss takes; frozen, as trainer.loss.GUARDED and PLAIN are shared
    model_config = Section.model_config | ConfigDict(frozen=True)

    eps_low: float = setting(0.2, "clip range below a ratio of 1", gt=0, lt=1)
    eps_high: float = setting(0.28, "clip range above a ratio of 1 (clip-higher)", gt=0)
    is_cap: float = setting(2.0, "cap of an off-policy token's importance weight", ge=1)
    kl_coef: float = setting(0.01, "weight of the k3 KL term to the reference model (0 = off)", ge=0)
    norm_tokens: int = setting(
        0, "constant loss normaliser (Dr. GRPO); 0 = micro-batches x rows x seq_len of a step", ge=0
    )
    log_ratio_clamp: float = setting(
        20.0, "clamp log-ratios (trainer vs behaviour, reference vs trainer) to +-this before exp (0 = off)", ge=0
    )
    dual_clip: float = setting(
        3.0, "dual-clip: a negative-advantage token's loss is at most this x |advantage| (> 1; 0 = off)", ge=0
    )
    k3_clamp: float = setting(10.0, "clamp each token's KL term (k3 or full) to at most this (0 = off)", ge=0)
    kl_estimator: Literal["k3", "full"] = setting(
        "k3",
        "the KL term per trained token: k3 (on the sampled token; cheap, but blind to mass moved onto tokens the "
        "policy rarely samples) or full (the exact KL over the whole vocabulary; costs the reference's [B, S, V] "
        "log-softmax per micro-batch)",
    )
    seq_ratio_guard: Literal["off", "mask", "truncate"] = setting(
        "off",
        "per-sequence importance-ratio guard on the geometric-mean ratio to the behaviour policy: "
        "mask (drop sequences outside [seq_ratio_low, seq_ratio_high]), truncate (cap a sequence's "
        "weight at seq_ratio_high) or off",
    )
    seq_ratio_low: float = setting(0.5, "lower end of the sequence guard's band of geometric-mean ratios", gt=0, le=1)
    seq_ratio_high: float = setting(2.0, "upper end of the sequence guard's band of geometric-mean ratios", ge=1)
    delayed_correction: Literal["truncated_is", "none"] = setting(
        "truncated_is",
        "how a delayed sample (policy lag over train.max_policy_lag, within train.max_delayed_lag) is corrected: "
        "truncated_is (each token's gradient weighted by min(ratio to its behaviour policy, delayed_is_cap)) or "
        "none (no correction: plain advantage x grad log-prob, an experiment's control arm)",
    )
    delayed_is_cap: float = setting(
        1.0,
        "cap of a delayed token's importance weight (>= 1: a cap below 1 would shrink even a token whose "
        "probability did not change; 1 = delayed tokens are only ever down-weighted)",
        ge=1,
    )

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip(cls, v: float) -> float:
        if v != 0 and not v > 1:
            raise ValueError("must be > 1 (a bound below the ratio 1 would clip on-policy tokens), or 0 = off")
        return v


class TrainSettings(Section):
    """The optimizer and the training run."""

    run_id: str = setting("", "training run id kept across resumes; empty = derived from the checkpoint folder")
    steps: int = setting(20, "optimizer steps to take (a resumed run continues to this total)", gt=0)
    micro_batches_per_step: int = setting(2, "micro-batches accumulated into one optimizer step", gt=0)
    updates_per_step: int = setting(
        1,
        "optimizer updates on each step's micro-batches (PPO's epochs): the first is what one update does, the "
        "later ones reuse the samples' behaviour log-probs, the clip bounding how far they move; 1 = each "
        "micro-batch trains once",
        gt=0,
        le=64,
    )
    lr: float = setting(1e-3, "AdamW peak learning rate", gt=0)
    beta1: float = setting(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = setting(0.999, "AdamW beta2", ge=0, lt=1)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay", ge=0)
    warmup_steps: int = setting(0, "steps of linear learning-rate warm-up from 0 to lr", ge=0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off); on by default", ge=0)
    max_policy_lag: int = setting(
        1,
        "samples older than this many policy versions are dropped (counted) or, within max_delayed_lag, delayed",
        ge=0,
    )
    max_delayed_lag: int = setting(
        4,
        "samples with a policy lag over max_policy_lag but at most this train on the delayed path (their own "
        "baseline, a truncated importance weight: loss.delayed_correction); older ones are dropped (counted); "
        "0 = no delayed path (every sample over max_policy_lag is dropped)",
        ge=0,
    )
    checkpoint_every: int = setting(10, "steps between checkpoints (one is also written at the end)", gt=0)
    checkpoint_dir: str = setting("", "where checkpoints go; empty = <data_dir>/checkpoints")
    idle_timeout_s: float = setting(30.0, "stop when no micro-batch arrives for this long", gt=0)
    torch_threads: int = setting(
        0, "CPU threads for torch; 0 = auto: all cores but one on a CPU-only machine (the broker needs one)", ge=0
    )

    @model_validator(mode="after")
    def _delayed_beyond_near(self) -> TrainSettings:
        if 0 < self.max_delayed_lag <= self.max_policy_lag:
            raise ValueError(
                f"train.max_delayed_lag = {self.max_delayed_lag} is not above train.max_policy_lag = "
                f"{self.max_policy_lag}, so no sample would take the delayed path; fix: set train.max_delayed_lag "
                "above train.max_policy_lag, or to 0 to drop every sample over train.max_policy_lag"
            )
        return self


class ParallelSettings(Section):
    """How one model replica is split over ranks: world size = tp x pp x dp."""

    # the model config holds this very object (trainer.factory.model_config): frozen, so no copy is needed
    model_config = Section.model_config | ConfigDict(frozen=True)

    tp: int = setting(1, "tensor-parallel size: each matmul and the vocabulary split over this many ranks", gt=0)
    pp: int = setting(1, "pipeline-parallel size: the layers split into this many stages", gt=0)
    dp: int = setting(0, "data-parallel size; 0 = derived as world_size / (tp x pp)", ge=0)
    sequence_parallel: bool = setting(
        False,
        "split layer-norm and dropout activations along the sequence over the tensor-parallel ranks (needs tp > 1)",
    )

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; error if the layout does not fit."""
        mp = self.tp * self.pp
        if world_size % mp:
            raise ConfigError(
                f"parallel.tp * parallel.pp = {mp} does not divide the world size {world_size}; "
                "launch a multiple of tp*pp ranks or change parallel.tp/parallel.pp"
            )
        dp = world_size // mp
        if self.dp and self.dp != dp:
            raise ConfigError(
                f"parallel.dp = {self.dp} but world size {world_size} / (tp {self.tp} * pp {self.pp}) = {dp}; "
                "set parallel.dp to 0 (derived) or launch tp*pp*dp ranks"
            )
        return dp

    @model_validator(mode="after")
    def _sp(self) -> ParallelSettings:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1; fix: raise parallel.tp or turn it off")
        return self


class PrecisionSettings(Section):
    """Number formats. FP8 needs Transformer Engine and a GPU (the trainer refuses it otherwise)."""

    # the trainer holds this very object (trainer.factory.model_config): frozen, so no copy is needed
    model_config = Section.model_config | ConfigDict(frozen=True)

    bf16: bool = setting(False, "parameters and activations in bfloat16 (on CPU ~10x slower than fp32)")
    fp8: Literal["", "hybrid", "e4m3"] = setting(
        "", "FP8 GEMMs through Transformer Engine: hybrid (e4m3 forward, e5m2 backward) or e4m3; empty = off"
    )
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = setting(
        "delayed", "FP8 scaling recipe (mxfp8 needs Blackwell); read only when fp8 is set"
    )

    @model_validator(mode="after")
    def _fp8_needs_bf16(self) -> PrecisionSettings:
        if self.fp8 and not self.bf16:
            raise ValueError(
                f"precision.fp8 = {self.fp8!r} needs precision.bf16 = true (FP8 training keeps bf16 "
                "parameters); fix: set precision.bf16 = true"
            )
        return self


class ModelSettings(Section):
    """The policy's architecture: a megatron-core GPTModel. Defaults: the tiny CPU model.

    This section is also the model's config. :func:`trainer.factory.model_config` joins the ``parallel`` section in.
    """

    hf_path: str = setting(
        "",
        "a Hugging Face checkpoint folder (config.json + safetensors; dense Llama, Qwen2 or Qwen3): the "
        "architecture comes from its config.json (a shape setting below that disagrees is refused) and the "
        "weights of the policy and its KL reference from its tensors; empty = the shape settings, random init",
    )

    @field_validator("hf_path")
    @classmethod
    def _absolute_hf_path(cls, v: str) -> str:
        """Absolute, so every part of the loop (started in the repository's folder) finds the same checkpoint."""
        return os.path.abspath(os.path.expanduser(v)) if v else v

    num_layers: int = setting(2, "transformer layers", gt=0)
    hidden_size: int = setting(64, "model width", gt=0)
    num_attention_heads: int = setting(4, "attention heads", gt=0)
    num_query_groups: int = setting(0, "key/value heads for grouped-query attention; 0 = one per attention head", ge=0)
    head_dim: int = setting(
        0, "width of one attention head (megatron's kv_channels); 0 = hidden_size / num_attention_heads", ge=0
    )
    ffn_hidden_size: int = setting(0, "MLP width; 0 = 4 x hidden_size", ge=0)
    vocab_size: int = setting(256, "vocabulary size", gt=0)
    vocab_multiple: int = setting(
        0,
        "pad the vocabulary (embedding and output rows) up to a multiple of lcm(vocab_multiple, parallel.tp), so "
        "checkpoints reshard over tp; the padded rows' logits are masked out; 0 = none (vocab_size must then divide "
        "by parallel.tp), or 128 with model.hf_path (Megatron-LM's default)",
        ge=0,
    )
    seq_length: int = setting(64, "longest sequence (packed micro-batch row) the model is built for", gt=0)
    normalization: Literal["LayerNorm", "RMSNorm"] = setting("LayerNorm", "LayerNorm or RMSNorm")
    norm_eps: float = setting(1e-5, "epsilon of every LayerNorm or RMSNorm (megatron's layernorm_epsilon)", gt=0)
    activation: Literal["gelu", "swiglu"] = setting("gelu", "MLP activation: gelu, or swiglu (gated SiLU)")
    position_embedding_type: Literal["rope", "learned_absolute"] = setting("rope", "rope or learned_absolute")
    rope_base: float = setting(10000.0, "RoPE base frequency (theta)", gt=0)
    rope_scaling: Literal["", "llama3", "linear"] = setting(
        "",
        "RoPE frequency scaling: llama3 (Llama 3.1's low and high frequency factors 1 and 4 over 8192 original "
        "positions) or linear (positions divided by rope_scaling_factor); empty = none",
    )
    rope_scaling_factor: float = setting(1.0, "the factor of rope_scaling; read only when rope_scaling is set", gt=0)
    tie_embeddings: bool = setting(False, "share the input embedding and output layer weights")
    qkv_bias: bool = setting(False, "bias on the query/key/value projections (Qwen2 style)")
    linear_bias: bool = setting(True, "biases on the other linear layers (GPT-2 style; Llama and Qwen: false)")
    qk_layernorm: bool = setting(
        False, "normalise queries and keys per head before RoPE, with the model's normalization (Qwen3's QK-norm)"
    )
    hidden_dropout: float = setting(0.0, "dropout after attention and MLP (RL compares log-probs: keep 0)", ge=0, lt=1)
    attention_dropout: float = setting(0.0, "dropout of attention probabilities", ge=0, lt=1)
    init_method_std: float = setting(0.02, "standard deviation of the weight init", gt=0)
    seed: int = setting(1234, "seed of the weight init and megatron's RNG tracker (the same model on any tp)")

    _parallel: ParallelSettings = PrivateAttr(default_factory=ParallelSettings)
    _hf_config: dict[str, Any] | None = PrivateAttr(default=None)

    def __init__(
        self,
        /,
        *,
        parallel: ParallelSettings | None = None,
        hf_config: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        """The model of ``settings`` (the section's fields), split over ``parallel``.

        ``parallel`` and ``hf_config`` (the config.json the model was read from) are not settings.
        A size of 0 means derived: read it through :attr:`ffn_width`, :attr:`kv_heads` and :attr:`kv_channels`.
        Shape errors are pydantic's ValidationError. A shape that does not fit ``parallel`` is a ConfigError
        naming both settings."""
        super().__init__(**settings)
        if parallel is not None:
            self._parallel = parallel
        if hf_config is not None:
            self._hf_config = dict(hf_config)
        why = (self._shape_error() if self.hf_path else None) or self._layout_error()
        if why:
            raise ConfigError(why)

    @property
    def parallel(self) -> ParallelSettings:
        """How the model is split over ranks: the settings' ``parallel`` section. Not a model setting."""
        return self._parallel

    @property
    def hf_config(self) -> dict[str, Any] | None:
        """The Hugging Face ``config.json`` the model was read from, kept so an export writes it back unchanged.
        None for a model of the shape settings. Not a setting."""
        return self._hf_config

    @property
    def ffn_width(self) -> int:
        """The MLP width: ``ffn_hidden_size``, or 4 x ``hidden_size`` when it is 0."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        """The key/value heads: ``num_query_groups``, or one per attention head when it is 0."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """The width of one attention head: ``head_dim``, or ``hidden_size / num_attention_heads`` when it is 0."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layers: ``vocab_size`` rounded up to a multiple of
        lcm(vocab_multiple, parallel.tp) (``vocab_size`` itself when ``vocab_multiple`` is 0). For
        power-of-two tp up to ``vocab_multiple`` the result does not depend on tp, so checkpoints reshard.
        The padded rows are zeros after an import, their logits are masked out (:func:`trainer.model.build_model`)
        and an export cuts them off."""
        if not self.vocab_multiple:
            return self.vocab_size
        m = math.lcm(self.vocab_multiple, self.parallel.tp)
        return -(-self.vocab_size // m) * m

    def _shape_error(self) -> str | None:
        """What is wrong with the shape settings together, naming them; None if nothing."""
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            return (
                f"model.hidden_size = {self.hidden_size} must be divisible by model.num_attention_heads = "
                f"{self.num_attention_heads}"
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            return (
                f"model.num_query_groups = {self.num_query_groups} must divide model.num_attention_heads = "
                f"{self.num_attention_heads}"
            )
        if self.rope_scaling and self.position_embedding_type != "rope":
            return f"model.rope_scaling = {self.rope_scaling!r} needs model.position_embedding_type = 'rope'"
        return None

    @model_validator(mode="after")
    def _shape(self) -> ModelSettings:
        """The shape settings fit together. With ``hf_path`` the checkpoint decides: it is checked when read."""
        why = None if self.hf_path else self._shape_error()
        if why:
            raise ValueError(why)
        return self

    def _layout_error(self) -> str | None:
        """What does not divide over ``parallel``'s tensor and pipeline ranks, naming both settings; None if nothing."""
        tp, pp = self.parallel.tp, self.parallel.pp
        for name, v in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.kv_heads),
            ("ffn_hidden_size", self.ffn_width),
            ("vocab_size", self.padded_vocab_size),
        ):
            if v % tp:
                return f"model.{name} = {v!r} must be divisible by parallel.tp = {tp}"
        if self.num_layers % pp:
            return f"model.num_layers = {self.num_layers!r} must be divisible by parallel.pp = {pp}"
        return None

    def check_precision(self, precision: PrecisionSettings) -> None:
        """Shape constraints that only apply under a given precision (FP8 GEMMs want multiples of 16)."""
        if not precision.fp8:
            return
        for name, v in (("hidden_size", self.hidden_size), ("ffn_hidden_size", self.ffn_width)):
            if v % 16:
                _fail(f"model.{name}", v, f"must be a multiple of 16 for precision.fp8 = {precision.fp8!r}")

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelSettings:
        """2 layers, hidden 64, 4 heads, vocab 256, seq 64: trains in well under a second per step on 2 CPU cores.
        These are the defaults. ``overrides`` are fields, ``parallel`` or ``hf_config``."""
        base: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64)
        return cls(**(base | overrides))

    def replace(self, **changes: Any) -> ModelSettings:
        """A validated copy with ``changes`` (fields, ``parallel`` or ``hf_config``), like dataclasses.replace.
        What was set stays marked as set."""
        new = type(self)(**(dict(self) | {"parallel": self.parallel, "hf_config": self.hf_config} | changes))
        object.__setattr__(new, "__pydantic_fields_set__", self.model_fields_set | (changes.keys() & set(dict(self))))
        return new

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy through :meth:`replace`, so it is checked and keeps ``parallel`` and ``hf_config`` (pydantic's
        own copy would skip the shape checks and drop both from ``update``)."""
        copy = self.replace(**(update or {}))
        return super(ModelSettings, copy).model_copy(deep=True) if deep else copy  # type: ignore[return-value]

    def with_parallel(self, tp: int = 1, pp: int = 1, dp: int = 0, sequence_parallel: bool = False) -> ModelSettings:
        """A copy of this model with another parallel layout (checkpoints reshard between them)."""
        return self.replace(parallel=ParallelSettings(tp=tp, pp=pp, dp=dp, sequence_parallel=sequence_parallel))


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
"""The megatron linears a LoRA adapter may target (in every layer attention's fused QKV and output projections and
the MLP's two; and the model's output layer)."""


@dataclass(frozen=True)
class LoraConfig:
    """One adapter's shape: the record an adapter is made with, saved in its checkpoints and PEFT exports.

    An adapter keeps its shape when the settings change, and one read from a file is checked like a setting.
    :meth:`AdapterSettings.shape` makes one from the ``adapters`` section.
    """

    rank: int = 8
    """``r``: the inner width of ``B @ A``."""
    alpha: float = 16.0
    """The term added is ``alpha / rank * B(A(x))``."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Which linears get the adapter (megatron names: linear_qkv, linear_proj, linear_fc1, linear_fc2 of every layer;
    output_layer, the model's)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 = none: tp-independent, deterministic)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ConfigError(f"adapters.rank = {self.rank!r} must be a positive integer (e.g. 8); fix: set it so")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ConfigError(
                f"adapters.alpha = {self.alpha!r} must be a number > 0; fix: set it, e.g. to 2 * adapters.rank"
            )
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ConfigError(
                f"adapters.targets = {list(targets)!r}: "
                + (f"unknown {', '.join(map(repr, unknown))}; " if unknown else "")
                + f"fix: a non-empty list without repeats of {', '.join(LORA_TARGETS)}"
            )
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"adapters.dropout = {self.dropout!r} must be in [0, 1) (0 = off); fix: set it so")
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank


class AdapterSettings(Section):
    """Per-organisation LoRA adapters on the shared policy (issue 17): which orgs get one, their shape, and what the
    shared policy trains on. An org's adapter trains only on that org's samples; it is gated and promoted on its own."""

    orgs: Annotated[list[str], NoDecode] = setting(
        [],
        "organisations that get their own adapter once they pass adapters.min_samples; '*' = every org that does; "
        "empty = no adapters (comma-separated in the environment)",
    )
    min_samples: int = setting(
        256,
        "samples an org must have sent through the batch flow before its adapter stream starts (the "
        "minimum-traffic threshold); until then its samples train only the shared policy",
        ge=0,
    )
    shared_traffic: Literal["all", "unadapted", "served"] = setting(
        "served",
        "what the shared policy trains on: all traffic with each adapted org's samples trained through the "
        "adapter version that served them, frozen (served: the importance ratio compares with the real behaviour "
        "policy, and the base is not pulled towards an org's own habit where its adapter follows it); all traffic "
        "on the base alone (all: the global orgs lost about 0.03 of P(solve), bench/RESULTS.md); or only the orgs "
        "without an adapter (unadapted)",
    )
    revalidate_scales: Annotated[list[float], NoDecode] = setting(
        [0.5],
        "when a serving adapter's re-validation on a new base is refused, the adapter is judged again with its "
        "effect scaled by each of these in turn (its lora_B times the factor: the base may have learnt part of "
        "what the adapter does) and the first that passes serves, as a new version; empty = retire it at once "
        "(comma-separated in the environment)",
    )
    rank: int = setting(8, "LoRA rank r of every adapter", gt=0, le=1024)
    alpha: float = setting(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank", gt=0)
    targets: Annotated[list[str], NoDecode] = setting(
        list(LORA_TARGETS),
        "megatron linears that carry the adapter: linear_qkv, linear_proj, linear_fc1, linear_fc2 of every layer "
        "and the output layer (output_layer, Hugging Face's lm_head: with it an adapter can raise one token without "
        "those whose output rows lie near it; leave it out for an engine that serves no lm_head LoRA); "
        "comma-separated in the environment",
        min_length=1,
    )
    dropout: float = setting(0.0, "dropout on the adapter's input (RL compares log-probs: keep 0)", ge=0, lt=1)
    lr: float = setting(0.0, "AdamW learning rate of an adapter; 0 = train.lr", ge=0)
    updates_per_step: int = setting(
        4,
        "optimizer updates on each step's micro-batches of an adapter run (train.updates_per_step for adapters: an "
        "org's adapter sees a fraction of the traffic, so it reuses each batch); 0 = train.updates_per_step",
        ge=0,
        le=64,
    )
    kl_coef: float = setting(
        0.3,
        "weight of an adapter run's KL term to the base alone (it keeps what the org does not ask for, such as "
        "the broken-call rate, at the base's); 0 = loss.kl_coef",
        ge=0,
    )
    kl_estimator: Literal["", "k3", "full"] = setting(
        "full",
        "an adapter run's KL estimator (loss.kl_estimator's choices): full by default, as k3 on the sampled token "
        "does not see the broken tool calls an adapter's updates make likelier; '' = loss.kl_estimator",
    )
    max_loaded: int = setting(
        64, "adapters the policy server holds in memory at once (least recently used leave)", gt=0
    )

    @field_validator("orgs", "targets", "revalidate_scales", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("revalidate_scales")
    @classmethod
    def _scales(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not 0 < x < 1]
        if bad:
            raise ValueError(
                f"holds {bad}: each factor must lie between 0 and 1 (exclusive); fix: e.g. 0.5 or 0.75,0.5"
            )
        return v

    @field_validator("targets")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"names unknown modules {bad}; fix: choose among {list(LORA_TARGETS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"names a module twice: {v}")
        return v

    def wants(self, org: str) -> bool:
        """Whether ``org`` may get an adapter (traffic threshold apart)."""
        return "*" in self.orgs or org in self.orgs

    def shape(self) -> LoraConfig:
        """The shape of a new adapter: this section's settings of each :class:`LoraConfig` field."""
        return LoraConfig(**{f.name: getattr(self, f.name) for f in fields(LoraConfig)})


class TransformerEngineMissing(ConfigError):
    """FP8 was asked for but Transformer Engine cannot be imported (megatron would silently use bf16)."""


def _fail(name: str, value, why: str) -> None:
    raise ConfigError(f"{name} = {value!r} {why}")


def check_input_shapes(settings: Settings) -> None:
    """What the packed micro-batches (``batching.rows`` x ``batching.seq_len``; the model sees
    ``seq_len - 1`` positions: each predicts the next token) must satisfy for the configured model:
    learned positions cover them, sequence parallelism splits them evenly over ``parallel.tp``, FP8
    GEMMs get token counts that are multiples of 8 (Transformer Engine). Errors name the settings."""
    b, m, par, pr = settings.batching, settings.model, settings.parallel, settings.precision
    positions = b.seq_len - 1
    if m.position_embedding_type == "learned_absolute" and positions > m.seq_length:
        _fail(
            "batching.seq_len",
            b.seq_len,
            f"gives {positions} positions but model.seq_length = {m.seq_length} "
            "learned ones exist; fix: raise model.seq_length or lower batching.seq_len",
        )
    if par.sequence_parallel and positions % par.tp:
        _fail(
            "batching.seq_len",
            b.seq_len,
            f"- 1 = {positions} positions must divide evenly over parallel.tp = "
            f"{par.tp} with parallel.sequence_parallel; fix: make batching.seq_len - 1 a multiple of {par.tp}",
        )
    if pr.fp8 and (b.rows * positions) % 8:
        _fail(
            "batching.seq_len",
            b.seq_len,
            f"gives {b.rows} x {positions} tokens per micro-batch; FP8 GEMMs need a "
            "multiple of 8; fix: make batching.rows x (batching.seq_len - 1) a multiple of 8",
        )


def world_from_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain process."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


class TrainConfig(TrainSettings):
    """One training run: the ``train`` section, the loss, and what the caller owns (the model's shape is
    :class:`ModelSettings`). A new ``train`` setting reaches the run with no other change."""

    loss: LossSettings = Field(default_factory=LossSettings)
    """The loss, its guards and its normaliser: the settings' ``loss`` section."""
    reward_version: str = ""
    """Train only micro-batches of this reward version (others are skipped: the batch flow may make batches for
    several, :meth:`rtrl.sections.rewards.RewardSettings.trainable`); empty = any. Recorded in each ``TrainStep``."""
    adapter: str = ""
    """Train this org's LoRA adapter (:mod:`trainer.lora`; already on the model) on that org's micro-batches only
    (``MicroBatch.adapter``), the base frozen and the KL reference the base alone; empty = the shared policy, on
    the micro-batches of no adapter. Recorded in each ``TrainStep``; checkpoints are adapter checkpoints."""
    adapter_base: str = ""
    """The base the adapter trains on (e.g. ``v3``), recorded in its checkpoints: a resume on another base is
    refused."""
    resume: bool = True
    """Resume from the newest complete checkpoint in ``checkpoint_dir``, if any: its weights, optimizer, offsets,
    step and policy version win over what the caller passed."""

    @model_validator(mode="after")
    def _run_id(self) -> TrainConfig:
        if not self.run_id:  # the section's '' = derived: a caller without a checkpoint folder gets a fresh one
            self.run_id = uuid.uuid4().hex[:12]
        return self

    #: what a caller owns: the rest comes from the settings only
    OWNED: ClassVar[frozenset[str]] = frozenset(
        ("run_id", "steps", "checkpoint_dir", "checkpoint_every", "idle_timeout_s")
        + ("reward_version", "adapter", "adapter_base", "resume")
    )

    @classmethod
    def from_settings(cls, settings: Settings, **run: Any) -> TrainConfig:
        """The run the settings describe: the ``train`` and ``loss`` sections as they are, the reward version
        ``rewards.train_version`` and, for an adapter run, the ``adapters`` section's own lr, updates and KL.
        ``run`` sets what a caller owns (:attr:`OWNED`): run_id, steps, checkpoint_dir ... - never the optimizer
        or the loss."""
        if set(run) - cls.OWNED:
            raise TypeError(f"TrainConfig.from_settings: {sorted(set(run) - cls.OWNED)} come from settings only")
        ad, loss = settings.adapters, settings.loss
        own: dict[str, Any] = {}
        if run.get("adapter"):
            own = {k: v for k, v in (("lr", ad.lr), ("updates_per_step", ad.updates_per_step)) if v}
            kl = {k: v for k, v in (("kl_coef", ad.kl_coef), ("kl_estimator", ad.kl_estimator)) if v}
            loss = loss.model_copy(update=kl)
        # run_id and checkpoint_dir mean another thing empty here (a fresh id, no checkpoints): the caller gives them
        doc = settings.train.model_dump(exclude={"run_id", "checkpoint_dir"}) | own
        doc |= {"reward_version": settings.rewards.train_version} | run
        return cls.model_validate(doc | {"loss": loss})
