"""Typed configs for the trainer: the model's architecture, parallel layout and precision, and how a run trains.

Each config validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the
field (``model.hidden_size``, ``precision.fp8`` ...) and the fix. ``ModelConfig.tiny()`` is
the preset the CPU tests and the local simulator train: a few seconds per step on 2 cores.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from rtrl.errors import ConfigError
from rtrl.settings import Settings
from trainer.loss import GUARDED, LossConfig

FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
ROPE_SCALINGS = ("", "llama3", "linear")


class TransformerEngineMissing(ConfigError):
    """FP8 was asked for but Transformer Engine cannot be imported (megatron would silently use bf16)."""


def _fail(name: str, value, why: str) -> None:
    raise ConfigError(f"{name} = {value!r} {why}")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        _fail(name, value, "must be a positive integer")


@dataclass
class ParallelConfig:
    """How one model replica is split over ranks. ``world_size = tp * pp * dp``."""

    tp: int = 1
    """Tensor-parallel size: each matmul (and the vocabulary) is split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    dp: int | None = None
    """Data-parallel size; ``None`` = derived as ``world_size // (tp * pp)`` at init."""
    sequence_parallel: bool = False
    """Split layer-norm/dropout activations along the sequence over the tp ranks (needs tp > 1)."""

    def __post_init__(self) -> None:
        _positive_int("parallel.tp", self.tp)
        _positive_int("parallel.pp", self.pp)
        if self.dp is not None:
            _positive_int("parallel.dp", self.dp)
        if self.sequence_parallel and self.tp == 1:
            _fail("parallel.sequence_parallel", True, "needs parallel.tp > 1")

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; error if the layout does not fit."""
        mp = self.tp * self.pp
        if world_size % mp:
            raise ConfigError(
                f"parallel.tp * parallel.pp = {mp} does not divide the world size {world_size}; "
                "launch a multiple of tp*pp ranks or change parallel.tp/parallel.pp"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                f"parallel.dp = {self.dp} but world size {world_size} / (tp {self.tp} * pp {self.pp}) = {dp}; "
                "set parallel.dp to None (derived) or launch tp*pp*dp ranks"
            )
        return dp


@dataclass
class PrecisionConfig:
    """Number formats. FP8 needs Transformer Engine and a GPU; it implies bf16."""

    bf16: bool = False
    """Keep parameters and activations in bfloat16 (on CPU ~10x slower than fp32)."""
    fp8: Literal["hybrid", "e4m3"] | None = None
    """FP8 GEMMs through Transformer Engine: ``hybrid`` (e4m3 fwd, e5m2 bwd) or ``e4m3``; None = off."""
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """FP8 scaling recipe (``mxfp8`` needs Blackwell); only read when ``fp8`` is set."""

    def __post_init__(self) -> None:
        if not isinstance(self.bf16, bool):
            _fail("precision.bf16", self.bf16, "must be true or false")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            _fail("precision.fp8", self.fp8, f"must be None or one of {', '.join(FP8_FORMATS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            _fail("precision.fp8_recipe", self.fp8_recipe, f"must be one of {', '.join(FP8_RECIPES)}")
        if self.fp8 is not None and not self.bf16:
            _fail(
                "precision.bf16",
                self.bf16,
                f"must be true when precision.fp8 = {self.fp8!r} (FP8 training keeps bf16 parameters)",
            )


@dataclass
class ModelConfig:
    """A GPT (decoder-only) model for megatron-core's ``GPTModel``."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` = 4 * hidden_size."""
    vocab_size: int = 256
    seq_length: int = 64
    """Longest sequence (packed micro-batch length) the model is built for."""
    num_query_groups: int | None = None
    """Grouped-query attention: number of KV heads; ``None`` = one per attention head."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    rope_base: float = 10000.0
    """RoPE base frequency (theta)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP activation: gelu, or swiglu (a gated SiLU MLP: Llama, Qwen)."""
    qkv_bias: bool = False
    """Bias on the query/key/value projections (Qwen2)."""
    linear_bias: bool = True
    """Biases on the other linear layers (Llama and Qwen have none)."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer weights."""
    hidden_dropout: float = 0.0
    """RL recomputes log-probs and compares them with behaviour log-probs: dropout defaults off."""
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    seed: int = 1234
    """Seed for weight init and megatron's RNG tracker (same model on any tp for a given seed on CPU)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    head_dim: int | None = None
    """Width of one attention head (megatron's ``kv_channels``); ``None`` = hidden_size / num_attention_heads
    (Qwen3 sets it independently of the width)."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm (megatron's ``layernorm_epsilon``; Llama and Qwen: 1e-6 or 1e-5)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head before RoPE, with the model's normalization (Qwen3's QK-norm)."""
    rope_scaling: Literal["", "llama3", "linear"] = ""
    """RoPE frequency scaling: ``llama3`` (Llama 3.1: low/high frequency factors 1/4 over 8192 original
    positions, megatron's ``rope_scaling``) or ``linear`` (positions divided by the factor, megatron's
    ``seq_len_interpolation_factor``); empty = none."""
    rope_scaling_factor: float = 1.0
    """The factor of ``rope_scaling`` (only read when it is set)."""
    vocab_multiple: int = 0
    """Pad the vocabulary (embedding and output rows) up to a multiple of lcm(vocab_multiple, parallel.tp):
    see :attr:`padded_vocab_size`. 0 = no padding (``vocab_size`` must then divide by parallel.tp)."""
    hf_path: str = ""
    """The Hugging Face checkpoint folder the architecture came from (:mod:`trainer.hf`); empty = none."""
    hf_config: dict[str, Any] | None = field(default=None, repr=False)
    """That checkpoint's ``config.json`` as read, kept so an export writes it back unchanged."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            _positive_int(f"model.{name}", getattr(self, name))
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        _positive_int("model.ffn_hidden_size", self.ffn_hidden_size)
        if self.head_dim is not None:
            _positive_int("model.head_dim", self.head_dim)
        elif self.hidden_size % self.num_attention_heads:
            _fail(
                "model.hidden_size",
                self.hidden_size,
                f"must be divisible by model.num_attention_heads = {self.num_attention_heads}",
            )
        if self.num_query_groups is not None:
            _positive_int("model.num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                _fail(
                    "model.num_query_groups",
                    self.num_query_groups,
                    f"must divide model.num_attention_heads = {self.num_attention_heads}",
                )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            _fail("model.normalization", self.normalization, "must be LayerNorm or RMSNorm")
        if self.activation not in ("gelu", "swiglu"):
            _fail("model.activation", self.activation, "must be gelu or swiglu")
        if not self.rope_base > 0:
            _fail("model.rope_base", self.rope_base, "must be > 0")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            _fail(
                "model.position_embedding_type", self.position_embedding_type, f"must be one of {POSITION_EMBEDDINGS}"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                _fail(f"model.{name}", v, "must be in [0, 1)")
        if not self.init_method_std > 0:
            _fail("model.init_method_std", self.init_method_std, "must be > 0")
        if not self.norm_eps > 0:
            _fail("model.norm_eps", self.norm_eps, "must be > 0")
        if self.rope_scaling not in ROPE_SCALINGS:
            _fail("model.rope_scaling", self.rope_scaling, "must be empty, llama3 or linear")
        if self.rope_scaling and not self.rope_scaling_factor > 0:
            _fail("model.rope_scaling_factor", self.rope_scaling_factor, "must be > 0")
        if self.rope_scaling and self.position_embedding_type != "rope":
            _fail("model.rope_scaling", self.rope_scaling, "needs model.position_embedding_type = 'rope'")
        if not isinstance(self.vocab_multiple, int) or isinstance(self.vocab_multiple, bool) or self.vocab_multiple < 0:
            _fail("model.vocab_multiple", self.vocab_multiple, "must be an integer >= 0")
        if not isinstance(self.parallel, ParallelConfig):
            _fail("model.parallel", self.parallel, "must be a ParallelConfig")
        tp = self.parallel.tp
        kv_heads = self.num_query_groups or self.num_attention_heads
        for name, v in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", kv_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.padded_vocab_size),
        ):
            if v % tp:
                _fail(f"model.{name}", v, f"must be divisible by parallel.tp = {tp}")
        if self.num_layers % self.parallel.pp:
            _fail("model.num_layers", self.num_layers, f"must be divisible by parallel.pp = {self.parallel.pp}")

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

    def check_precision(self, precision: PrecisionConfig) -> None:
        """Shape constraints that only apply under a given precision (FP8 GEMMs want multiples of 16)."""
        if precision.fp8 is None:
            return
        for name in ("hidden_size", "ffn_hidden_size"):
            v = getattr(self, name)
            if v % 16:
                _fail(f"model.{name}", v, f"must be a multiple of 16 for precision.fp8 = {precision.fp8!r}")

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """2 layers, hidden 64, 4 heads, vocab 256, seq 64: trains in well under a second per step on 2 CPU cores."""
        base: dict[str, Any] = dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256, seq_length=64
        )
        base.update(overrides)
        return cls(**base)

    def with_parallel(
        self, tp: int = 1, pp: int = 1, dp: int | None = None, sequence_parallel: bool = False
    ) -> ModelConfig:
        """A copy of this config with another parallel layout (checkpoints reshard between them)."""
        from dataclasses import replace

        return replace(self, parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, sequence_parallel=sequence_parallel))


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


@dataclass
class TrainConfig:
    """How the loop trains (the model's shape is trainer.config.ModelConfig)."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    micro_batches_per_step: int = 2
    updates_per_step: int = 1
    """Optimizer updates on each step's micro-batches (PPO's epochs; 1 = each trains once). The later updates
    reuse the behaviour log-probs, so the clip bounds how far they move; the step's ``TrainStep`` figures are its
    first update's (what one update does), ``grad_norm`` too."""
    max_steps: int = 10
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 to ``lr`` over this many steps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over every rank's shard) to this; 0 = off. The norm before clipping is
    recorded either way (``TrainStep.grad_norm``)."""
    max_policy_lag: int = 4
    max_delayed_lag: int = 0
    """Delayed samples (``MicroBatch.delayed``) train up to this policy lag, with ``loss.delayed_correction``;
    0 = no delayed path (they are masked like stale samples)."""
    norm_tokens: int = 0
    """Constant loss normaliser (Dr. GRPO); 0 = micro_batches_per_step x rows x seq_len of the first batch."""
    checkpoint_every: int = 5
    checkpoint_dir: str = ""
    idle_timeout_s: float = 30.0
    loss: LossConfig = field(default_factory=lambda: GUARDED)
    """The loss and its guards; default :data:`trainer.loss.GUARDED` (= the settings' ``loss`` defaults)."""
    reward_version: str = ""
    """Train only micro-batches of this reward version (others are skipped: the batch flow may make batches for
    several, :meth:`rtrl.settings.RewardSettings.trainable`); empty = any. Recorded in each ``TrainStep``."""
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

    @classmethod
    def from_settings(cls, settings: Settings, **run: Any) -> TrainConfig:
        """The ``train`` and ``loss`` sections as a TrainConfig: the one mapping from settings to the training
        loop (the trainer job and the closed loop both use it). ``run`` sets what a caller owns: run_id,
        max_steps, checkpoint_dir, idle_timeout_s ... - never the optimizer or the loss."""
        owned = {
            "run_id",
            "max_steps",
            "checkpoint_dir",
            "checkpoint_every",
            "idle_timeout_s",
            "reward_version",
            "adapter",
            "adapter_base",
            "resume",
        }
        if set(run) - owned:
            raise TypeError(f"TrainConfig.from_settings: {sorted(set(run) - owned)} come from settings only")
        ts, ls = settings.train, settings.loss
        params: dict[str, Any] = {
            "micro_batches_per_step": ts.micro_batches_per_step,
            "updates_per_step": (settings.adapters.updates_per_step or ts.updates_per_step)
            if run.get("adapter")
            else ts.updates_per_step,
            "max_steps": ts.steps,
            "betas": (ts.beta1, ts.beta2),
            "weight_decay": ts.weight_decay,
            "warmup_steps": ts.warmup_steps,
            "grad_clip": ts.grad_clip,
            "max_policy_lag": ts.max_policy_lag,
            "max_delayed_lag": ts.max_delayed_lag,
            "norm_tokens": ls.norm_tokens,
            "checkpoint_every": ts.checkpoint_every,
            "idle_timeout_s": ts.idle_timeout_s,
            "reward_version": settings.rewards.train_version,
            "lr": (settings.adapters.lr or ts.lr) if run.get("adapter") else ts.lr,
            "loss": LossConfig(
                eps_low=ls.eps_low,
                eps_high=ls.eps_high,
                is_cap=ls.is_cap,
                kl_coef=(settings.adapters.kl_coef or ls.kl_coef) if run.get("adapter") else ls.kl_coef,
                log_ratio_clamp=ls.log_ratio_clamp,
                dual_clip=ls.dual_clip,
                k3_clamp=ls.k3_clamp,
                seq_ratio_guard=ls.seq_ratio_guard,
                seq_ratio_low=ls.seq_ratio_low,
                seq_ratio_high=ls.seq_ratio_high,
                delayed_correction=ls.delayed_correction,
                delayed_is_cap=ls.delayed_is_cap,
                kl_estimator=(settings.adapters.kl_estimator or ls.kl_estimator)
                if run.get("adapter")
                else ls.kl_estimator,
            ),
        } | run
        return cls(**params)
