"""The policy model: a megatron-core ``GPTModel`` built from :mod:`rtrl.sections.trainer`, on CPU or GPU.

- :func:`init_parallel` starts ``torch.distributed`` (gloo on CPU, NCCL on GPU; a single plain
  process works too), megatron's model-parallel groups, and the seeds.
- :func:`build_model` picks the layer spec: the local (pure megatron) spec on CPU or without
  Transformer Engine, the TE spec on GPU with TE. FP8 is only ever switched on through the TE
  spec, and asking for FP8 without an importable Transformer Engine is a hard error
  (megatron-core would otherwise silently train in bf16).
- :func:`forward_logprobs` gives per-token log-probs ``[B, S]`` of given targets, with an
  explicit boolean causal mask and vocab-parallel cross entropy, so any tensor-parallel size
  gives the same numbers. It runs a whole model (pp = 1); under pipeline parallelism the last
  stage applies the same :func:`logprobs_from_logits` inside megatron's pipeline schedule
  (:func:`trainer.train.pipeline_step`).
- :func:`vocab_parallel_log_softmax` and :func:`full_kl` give the exact KL(pi || ref) over the whole
  vocabulary per position from vocab-parallel logits (``loss.kl_estimator = "full"``), the same for any tp.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from dataclasses import dataclass

import torch

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings, PrecisionSettings, TransformerEngineMissing, world_from_env
from trainer import cpu_compat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits after :func:`init_parallel`."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: str
    shims: tuple[str, ...]
    """CPU-compat shims installed (empty on CUDA)."""


def transformer_engine_status() -> tuple[bool, str]:
    """(importable, detail). Probed with ``except Exception``: a TE wheel without a usable CUDA
    raises RuntimeError, not ImportError."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means no TE
        return False, f"{type(e).__name__}: {e}"
    return True, getattr(transformer_engine, "__version__", "unknown version")


def require_transformer_engine(precision: PrecisionSettings) -> None:
    """Raise :class:`TransformerEngineMissing` when FP8 is asked for and TE cannot be imported."""
    if not precision.fp8:
        return
    ok, detail = transformer_engine_status()
    if not ok:
        raise TransformerEngineMissing(
            f"precision.fp8 = {precision.fp8!r} needs NVIDIA Transformer Engine, but "
            f"`import transformer_engine` failed ({detail}). Without it megatron-core silently "
            "trains in bf16. Install the 'gpu' extra on a CUDA machine (pip install 'rtrl[gpu]') "
            'or turn FP8 off: precision.fp8 = "" (RTRL_PRECISION__FP8=).'
        )
    if not torch.cuda.is_available():
        raise TransformerEngineMissing(
            f'precision.fp8 = {precision.fp8!r} needs a CUDA GPU; none is available. Turn FP8 off: precision.fp8 = "".'
        )


def init_parallel(cfg: ModelSettings) -> ParallelInfo:
    """Initialise torch.distributed, megatron's parallel groups and the seeds for ``cfg``.

    Rank and world size come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT). A plain process with none of them set becomes rank 0 of 1
    through a ``file://`` rendezvous. Idempotent: a second call with the same layout only
    reseeds; a different layout is an error (a process trains one layout).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    shims = tuple(cpu_compat.install())
    cuda = torch.cuda.is_available()
    rank, local_rank, world_size = world_from_env()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            init_method = "env://"
        elif world_size == 1:
            fd, path = tempfile.mkstemp(prefix="rtrl-dist-")
            os.close(fd)
            os.unlink(path)  # FileStore wants a path that is absent or empty
            init_method = f"file://{path}"
        else:
            raise ConfigError(
                f"WORLD_SIZE = {world_size} but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun"
            )
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    p = cfg.parallel
    dp = p.resolve_dp(world_size)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (p.tp, p.pp):
            raise ConfigError(
                f"model parallel groups already exist with (tp, pp) = {have}, config asks for "
                f"({p.tp}, {p.pp}); one process trains one layout: start a new process"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp)

    pp_rank = ps.get_pipeline_model_parallel_rank()
    seed_everything(cfg.seed)
    return ParallelInfo(
        rank=rank,
        world_size=world_size,
        tp=p.tp,
        pp=p.pp,
        dp=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=pp_rank,
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        backend=dist.get_backend(),
        shims=shims,
    )


def seed_everything(seed: int, torch_only: bool = False) -> None:
    """Seed python, numpy (unless ``torch_only``), torch and megatron's RNG tracker for this rank.

    Megatron-LM's convention: ``seed + 100 * pp_rank``, equal across tensor-parallel ranks (on
    CPU every weight is drawn as one full master tensor and split, so any tp gives the same
    model). Needs the parallel state (call after ``initialize_model_parallel``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)  # the CPU and every CUDA default generator
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    if torch_only:
        return
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def transformer_config(cfg: ModelSettings, precision: PrecisionSettings):
    """The megatron ``TransformerConfig`` for ``cfg`` under ``precision`` (FP8 fields only set when asked)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if precision.bf16 else torch.float32
    kwargs: dict = {}
    if precision.fp8:
        kwargs.update(fp8=precision.fp8, fp8_recipe=precision.fp8_recipe)
    if cfg.activation == "swiglu":  # Llama/Qwen MLP: silu(x W_gate) * (x W_up)
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    if cfg.head_dim:
        kwargs.update(kv_channels=cfg.head_dim)
    if cfg.qk_layernorm:
        kwargs.update(qk_layernorm=True)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or None,
        ffn_hidden_size=cfg.ffn_width,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_eps,
        add_qkv_bias=cfg.qkv_bias,
        add_bias_linear=cfg.linear_bias,
        tensor_model_parallel_size=cfg.parallel.tp,
        pipeline_model_parallel_size=cfg.parallel.pp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        bf16=precision.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # On CPU every weight is initialised as one full master tensor from the CPU generator and
        # split over tp ranks: the same seed gives the same model for any tp.
        use_cpu_initialization=not cuda,
        cuda_graph_scope=[],  # megatron's default "full" is its own deprecated spelling of [] (and warns)
        **kwargs,
    )


def layer_spec(precision: PrecisionSettings, normalization: str = "LayerNorm", qk_layernorm: bool = False):
    """The local spec on CPU (or GPU without TE); the Transformer Engine spec on GPU with TE.

    FP8 requires the TE spec, so it requires TE (checked by :func:`require_transformer_engine`).
    ``qk_layernorm`` adds the per-head query/key norms (Qwen3).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    require_transformer_engine(precision)
    if torch.cuda.is_available() and transformer_engine_status()[0]:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)


def build_model(cfg: ModelSettings, precision: PrecisionSettings | None = None):
    """A megatron-core ``GPTModel`` for this rank's pipeline stage and tensor-parallel shard.

    Deterministic: the weights depend only on ``cfg`` (``cfg.seed`` reseeds every RNG first, see
    :func:`seed_everything`), so two calls give the same model. It never reads ``cfg.hf_path``: build a model
    with its weights through :func:`trainer.factory.build`. Call :func:`init_parallel` first. Raises :class:`TransformerEngineMissing` when
    ``precision.fp8`` is set and Transformer Engine cannot be imported.
    """
    precision = precision or PrecisionSettings()
    cfg.check_precision(precision)
    require_transformer_engine(precision)  # before anything else: the clear error first
    if cfg.parallel.sequence_parallel and not (torch.cuda.is_available() and transformer_engine_status()[0]):
        # megatron-core's local spec norms assert `not config.sequence_parallel` (WrappedTorchNorm)
        raise ConfigError(
            "parallel.sequence_parallel needs the Transformer Engine layer spec (a CUDA GPU with the 'gpu' extra); "
            "megatron-core's local spec, used here, cannot split norms along the sequence; fix: set "
            "parallel.sequence_parallel = false (RTRL_PARALLEL__SEQUENCE_PARALLEL=false)"
        )
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if not ps.model_parallel_is_initialized():
        raise ConfigError("megatron parallel state is not initialised; call trainer.model.init_parallel(cfg) first")
    spec = layer_spec(precision, cfg.normalization, cfg.qk_layernorm)
    seed_everything(cfg.seed, torch_only=True)
    rope: dict = {}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_scaling=True, rope_scaling_factor=cfg.rope_scaling_factor)
    elif cfg.rope_scaling == "linear":
        rope.update(seq_len_interpolation_factor=cfg.rope_scaling_factor)
    model = GPTModel(
        config=transformer_config(cfg, precision),
        transformer_layer_spec=spec,
        vocab_size=cfg.padded_vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=int(cfg.rope_base) if float(cfg.rope_base).is_integer() else cfg.rope_base,
        **rope,
    )
    if cfg.padded_vocab_size > cfg.vocab_size and ps.is_pipeline_last_stage():
        mask_padded_vocab(model.output_layer, cfg.vocab_size, cfg.padded_vocab_size)
    if precision.bf16:
        # What Megatron-LM's Float16Module does to the wrapped model: every parameter and float
        # buffer in bf16 (the local spec's LayerNorms are otherwise created in fp32).
        model.bfloat16()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


#: the logit of a padding row of the vocabulary: exp() of it is 0 next to any real logit, and unlike -inf
#: it keeps p * log p and sums over the vocabulary finite
PADDED_LOGIT = -1e4


def mask_padded_vocab(output_layer, vocab_size: int, padded_vocab_size: int) -> None:
    """Give the padding rows of the output layer (token ids ``vocab_size`` .. ``padded_vocab_size - 1``,
    which no tokenizer produces) the logit :data:`PADDED_LOGIT`, so they take no probability: a zero row
    would give logit 0, which is far from negligible next to real logits. A forward hook on megatron's
    ``output_layer``: sampling, log-probs and the loss all see it. Handles vocab-parallel (``[..., Vp/tp]``,
    this rank's slice) and gathered (``[..., Vp]``) logits."""
    from megatron.core import parallel_state as ps

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]
        start = 0 if width == padded_vocab_size else ps.get_tensor_model_parallel_rank() * width
        if start + width <= vocab_size:
            return None
        ids = torch.arange(start, start + width, device=logits.device)
        return logits.masked_fill(ids >= vocab_size, PADDED_LOGIT), bias

    output_layer.register_forward_hook(hook)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[1, 1, S, S]`` mask, True = masked (a position may not attend to later ones)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logprobs(
    model,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token log-probs ``[B, S]`` (float32, differentiable) of ``targets`` under ``model``.

    ``tokens``, ``position_ids`` and ``targets`` are ``[B, S]`` integer tensors; ``targets[b, s]``
    is the token scored at position ``s`` (usually ``tokens[b, s + 1]``). ``attention_mask`` is a
    boolean ``[B or 1, 1, S, S]`` tensor with True = masked; ``None`` = plain causal (pass a
    block-diagonal causal mask for packed sequences). The logits are vocab-parallel under
    tensor parallelism; megatron's vocab-parallel cross entropy reduces over the tp group, so
    the result is the same on every tp rank and for every tp size. Pipeline-parallel models
    need the pipeline schedule instead (only the last stage has logits).
    """
    return logprobs_from_logits(_logits(model, tokens, position_ids, targets, attention_mask), targets)


def forward_logprobs_and_log_softmax(
    model,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_logprobs` and the whole (vocab-parallel) log-softmax ``[B, S, V / tp]`` of the same forward
    pass (:func:`vocab_parallel_log_softmax`): what the exact KL over the vocabulary (:func:`full_kl`) needs."""
    return logprobs_and_log_softmax(_logits(model, tokens, position_ids, targets, attention_mask), targets)


def logprobs_and_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` and :func:`vocab_parallel_log_softmax` of the same logits (the log-softmax
    first: megatron's cross entropy works on the logits in place)."""
    log_softmax = vocab_parallel_log_softmax(logits)
    return logprobs_from_logits(logits, targets), log_softmax


def _logits(
    model,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The checked forward pass of :func:`forward_logprobs`: the (vocab-parallel) logits ``[B, S, V / tp]``."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise NotImplementedError(
            "forward_logprobs runs a whole model; with pp > 1 use the pipeline schedule (trainer.train.pipeline_step)"
        )
    if tokens.shape != targets.shape or tokens.shape != position_ids.shape or tokens.dim() != 2:
        raise ValueError(
            f"tokens {tuple(tokens.shape)}, position_ids {tuple(position_ids.shape)} and targets "
            f"{tuple(targets.shape)} must all be the same [B, S] shape"
        )
    if attention_mask is None:
        attention_mask = causal_mask(tokens.shape[1], tokens.device)
    elif attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}")
    return model(tokens, position_ids, attention_mask)  # [B, S, V / tp]


def vocab_parallel_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the log-softmax over the whole vocabulary of vocab-parallel logits ``[..., V / tp]``
    (at least float32, differentiable). The max (detached) and the normaliser are reduced over the tensor-parallel
    group, and the normaliser's gradient too (each rank's slice of the output depends on every rank's logits
    through it), so any tp gives the same values and gradients; with tp = 1 it is ``torch.log_softmax``'s. Padded
    vocabulary entries (:data:`PADDED_LOGIT`) get a probability of 0."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision up; float64 stays
    group = _tp_group()
    top = x.detach().amax(-1, keepdim=True)
    if group is not None:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = x - top
    total = shifted.exp().sum(-1, keepdim=True)
    if group is not None:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        # forward: the sum over the ranks' slices; backward: every rank's slice of the vocabulary depends on the
        # normaliser, so its gradient is summed over the ranks too (copy_to's backward) before reaching each slice
        total = copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(total, group), group)
    return shifted - total.log()


def full_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || ref) at every position ``[...]``, summed over the whole vocabulary, from two (vocab-parallel)
    log-softmaxes ``[..., V / tp]`` (:func:`vocab_parallel_log_softmax`). Differentiable in ``log_probs``;
    ``ref_log_probs`` is data (detached). Each rank sums its slice of the vocabulary and the partial sums are
    reduced over the tensor-parallel group (backward: pass-through), so any tp gives the same value and gradient.

    Unlike the k3 estimate on the sampled token, it sees probability mass the policy moves onto tokens it rarely
    samples (a malformed tool name, a stray digit), which no sampled token's log-ratio shows."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ")
    ref = ref_log_probs.detach().to(log_probs.dtype)
    partial = (log_probs.exp() * (log_probs - ref)).sum(-1)
    group = _tp_group()
    if group is None:
        return partial
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(partial, group)


def _tp_group():
    """Megatron's tensor-parallel group when there is one of more than one rank, else None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs ``[B, S]`` of ``targets`` from GPTModel's (vocab-parallel) logits ``[B, S, V / tp]``.

    What :func:`forward_logprobs` computes after the forward pass, and what the last pipeline stage
    computes in the pipeline schedule (:mod:`trainer.train`), so both give the same numbers."""
    from megatron.core import tensor_parallel

    # vocab_parallel_cross_entropy works on the last dim; float32 for stable log-softmax.
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)
    return -ce
