"""The training loop: streamed micro-batches -> Dr. GRPO + KL steps -> checkpoints with consumed offsets.

One step accumulates ``micro_batches_per_step`` micro-batches, then takes one AdamW step, then
commits the consumed offsets; every ``checkpoint_every`` steps (and at the end) it saves model,
optimizer, offsets and step through ``trainer.checkpoint``. A restart resumes from the newest
complete checkpoint: its offsets say where the input continues, so nothing is skipped and nothing
already in the weights is trained again.

Parallelism: data-parallel ranks train their share of every global batch and sum gradients
(:class:`DataParallel`); tensor-parallel ranks run the same steps on their shards. With pipeline
parallelism (pp > 1) every stage reads the same micro-batches and a step runs megatron-core's
pipeline schedule (:func:`pipeline_step`): the same loss and gradients as the whole model, computed
on the last stage, whose metrics every stage then receives (:class:`Pipeline`), so rank 0 records
them. A tied embedding's two copies (first and last stage) get their gradients summed, and gradient
clipping takes the norm over all stages.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from rtrl import metrics
from rtrl.sections.trainer import LossSettings, TrainConfig
from schemas.records import TrainStep
from trainer import checkpoint, lora
from trainer.batch import Batch
from trainer.dedup import TrainedSet
from trainer.factory import Policy, optimizer
from trainer.loss import LossOutput, policy_loss
from trainer.model import (
    forward_logprobs,
    forward_logprobs_and_log_softmax,
    full_kl,
    logprobs_and_log_softmax,
    logprobs_from_logits,
)


class Source(Protocol):
    """Where micro-batches come from: a Kafka :class:`trainer.data.BatchStream` or a list in memory."""

    def get(self, timeout_s: float = 30.0) -> Batch | None: ...
    def position(self) -> dict[str, int]: ...
    def commit(self) -> None: ...


class MemorySource:
    """Micro-batches from a list (tests, benchmarks); position = how many were taken."""

    def __init__(self, batches: list[Batch], offsets: dict[str, int] | None = None):
        self.batches, self.i = batches, (offsets or {}).get("memory/0", 0)

    def get(self, timeout_s: float = 30.0) -> Batch | None:
        if self.i >= len(self.batches):
            return None
        self.i += 1
        return self.batches[self.i - 1]

    def position(self) -> dict[str, int]:
        return {"memory/0": self.i}

    def commit(self) -> None:
        pass


@dataclass(frozen=True)
class Prepared:
    """One micro-batch as model inputs: position t predicts token t+1 of the same packed sample."""

    tokens: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    behaviour: torch.Tensor
    off_policy: torch.Tensor
    segments: torch.Tensor
    """Each target's sample (its segment id, -1 = padding): the loss's sequence ids."""
    lags: np.ndarray  # per sample
    stale_tokens: int
    delayed: torch.Tensor | None = None
    """Per target: its sample is a delayed one that is trained (the loss's ``delayed``); None = no such sample."""
    delayed_lags: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Policy lag of each trained delayed sample."""
    delayed_lag_sum: int = 0
    """Sum of the policy lags of the trained tokens of delayed samples (before the loss's sequence guard)."""
    delayed_input_tokens: int = 0
    """Trained tokens of delayed samples (before the loss's sequence guard)."""


def prepare(batch: Batch, policy_version: int, max_policy_lag: int, max_delayed_lag: int = 0) -> Prepared:
    """Shift, build per-segment positions and a block-diagonal causal mask; drop tokens of samples whose
    policy lag exceeds ``max_policy_lag`` (they stay in the batch, masked out, and are counted). A delayed
    sample (``batch.delayed``) is trained up to ``max_delayed_lag`` instead (0 = never: masked and counted),
    marked ``delayed`` for the loss; a sample of a newer version than ``policy_version`` never is."""
    seg = batch.segment_ids
    rows, seq = seg.shape
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    seg_in, seg_t = seg[:, :-1], seg[:, 1:]
    same = (seg_in == seg_t) & (seg_t >= 0)  # a target is scored only from its own sample's prefix
    idx = np.broadcast_to(np.arange(seq - 1), (rows, seq - 1))
    starts = np.where(np.concatenate([np.ones((rows, 1), bool), seg_in[:, 1:] != seg_in[:, :-1]], axis=1), idx, 0)
    positions = idx - np.maximum.accumulate(starts, axis=1)
    lags = policy_version - batch.policy_versions
    token_lag = np.where(seg_t >= 0, lags[np.clip(seg_t, 0, None)], 0)
    flags = batch.delayed if batch.delayed is not None else np.zeros(len(lags), bool)
    sample_ok = np.where(flags, (lags <= max_delayed_lag) & (max_delayed_lag > 0), lags <= max_policy_lag)
    sample_ok &= lags >= 0  # a newer version (an A/B candidate) is not ours
    token_delayed = np.where(seg_t >= 0, flags[np.clip(seg_t, 0, None)], False)
    fresh = np.where(seg_t >= 0, sample_ok[np.clip(seg_t, 0, None)], False)
    mask = batch.loss_mask[:, 1:] * same * fresh
    stale = int((batch.loss_mask[:, 1:] * same * ~fresh).sum())
    attend = (seg_in[:, :, None] == seg_in[:, None, :]) & (idx[:, None, :] <= idx[:, :, None])
    return Prepared(
        tokens=torch.from_numpy(np.ascontiguousarray(inputs)),
        positions=torch.from_numpy(np.ascontiguousarray(positions)),
        targets=torch.from_numpy(np.ascontiguousarray(targets)),
        attention_mask=torch.from_numpy(~attend)[:, None],
        loss_mask=torch.from_numpy(np.ascontiguousarray(mask, dtype=np.float32)),
        advantages=torch.from_numpy(np.ascontiguousarray(batch.advantages[:, 1:])),
        behaviour=torch.from_numpy(np.ascontiguousarray(batch.behaviour_logprobs[:, 1:])),
        off_policy=torch.from_numpy(np.ascontiguousarray(token_lag >= 1)),
        segments=torch.from_numpy(np.ascontiguousarray(seg_t)),
        lags=lags,
        stale_tokens=stale,
        delayed=torch.from_numpy(np.ascontiguousarray(token_delayed & fresh)) if (flags & sample_ok).any() else None,
        delayed_lags=lags[flags & sample_ok],
        delayed_lag_sum=int((mask * (token_delayed & fresh) * token_lag).sum()),
        delayed_input_tokens=int((mask * (token_delayed & fresh)).sum()),
    )


@dataclass
class Hooks:
    """What a caller of :func:`train` is told and asked while it runs. Every hook is optional."""

    on_step: Callable[[TrainStep], object] | None = None
    """Called with each step's metrics, on every rank."""
    should_stop: Callable[[], bool] | None = None
    """Asked before each step (e.g. a wall-time trigger): True ends the run. Every rank stops when one asks."""
    served_by: Callable[[Batch], str | None] | None = None
    """A run of the shared policy only: the adapter on the model that served a micro-batch's samples, or None for
    the base alone. That adapter is active, frozen, in the micro-batch's forward pass: the base learns from an
    adapted org's samples through the adapter that served them (what serves the org), so where the adapter
    already follows the org's own habit the base is not pulled towards it. The KL term stays the one to the
    reference. Needs pp = 1, as adapters do."""


def train(
    policy: Policy,
    source: Callable[[dict[str, int] | None], Source],
    cfg: TrainConfig,
    hooks: Hooks | None = None,
) -> list[TrainStep]:
    """Train ``policy`` until ``cfg.steps``, until no micro-batch arrives within ``idle_timeout_s``, or until
    ``hooks.should_stop()`` says so before a step.

    ``source(offsets)`` opens the input at the offsets of the checkpoint being resumed, or at None without one:
    the caller's own start. ``policy.trained`` skips micro-batches and samples already trained.

    With ``cfg.adapter`` only that adapter's parameters train (the base is frozen), the adapter is active in the
    forward pass, ``policy.reference`` may be None (then the KL reference is the base alone), and checkpoints are
    adapter checkpoints (:func:`trainer.lora.save_adapter`). Otherwise the adapters on the model, ``served_by``'s,
    are neither trained nor checkpointed with it.
    """
    hooks = hooks or Hooks()
    model, reference, served_by = policy.model, policy.reference, hooks.served_by
    if cfg.updates_per_step < 1:
        raise ValueError(
            f"TrainConfig.updates_per_step = {cfg.updates_per_step!r} must be >= 1 (train.updates_per_step)"
        )
    if served_by is not None:
        if cfg.adapter:
            raise ValueError("Hooks.served_by is for a run of the shared policy, not of an adapter")
        if Pipeline().size > 1:
            raise ValueError("Hooks.served_by needs parallel.pp = 1 (LoRA adapters support pp = 1 only)")
        for name in lora.adapter_names(model):  # the serving adapters stay as they are: frozen
            for p in lora.adapter_parameters(model, name):
                p.requires_grad_(False)
    if cfg.adapter:
        params = lora.train_only(model, cfg.adapter)
        restore = lora.activate(model, cfg.adapter)  # undone on return
    else:  # the base: adapters on the model (frozen, ``served_by``'s) are neither trained nor checkpointed with it
        params, restore = lora.base_parameters(model), None
    if policy.optimizer is not None:
        given = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
        if given != {id(p) for p in params}:
            raise ValueError("Policy.optimizer must hold exactly the parameters this run trains")
        opt = policy.optimizer
    else:
        opt = optimizer(params, cfg)
    step, offsets, policy_version, trained = 0, None, policy.version, policy.trained
    if cfg.resume and cfg.checkpoint_dir and (last := checkpoint.latest(cfg.checkpoint_dir)) is not None:
        if cfg.adapter:
            extra = lora.load_adapter(last, model, cfg.adapter, opt, base=cfg.adapter_base or None).extra
        else:
            extra = checkpoint.load(last, model, opt)
        step, policy_version, offsets = extra["step"], extra["policy_version"], extra["offsets"]
        trained.restore(extra.get("trained", {}))
    opened = source(offsets)
    if reference is None and not cfg.adapter:
        raise ValueError("train() needs a reference model (only an adapter run may use the base as its own)")
    if reference is not None:
        reference.eval()
    try:
        return _train(
            model,
            reference,
            opened,
            opt,
            cfg,
            step,
            policy_version,
            hooks.on_step,
            hooks.should_stop,
            trained,
            served_by,
        )
    finally:
        if restore is not None:
            restore.__exit__(None, None, None)


def _ref_logprobs(
    model: Any, reference: Any, p: Prepared, adapter: str, full: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KL reference's per-token log-probs and, with ``full`` (``loss.kl_estimator = "full"``), its whole
    log-softmax: ``reference``'s, or (an adapter run without one) the base alone's."""
    ref = reference
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if reference is None:
            stack.enter_context(lora.activate(model, None))
            ref = model
        if full:
            return forward_logprobs_and_log_softmax(ref, p.tokens, p.positions, p.targets, p.attention_mask)
        return forward_logprobs(ref, p.tokens, p.positions, p.targets, p.attention_mask), None


def _policy_loss(
    p: Prepared, lp: torch.Tensor, ref: torch.Tensor, norm: float, cfg: LossSettings, kl_full: torch.Tensor | None
) -> LossOutput:
    """:func:`trainer.loss.policy_loss` on one prepared micro-batch (both the pp = 1 path and the pipeline's)."""
    return policy_loss(
        lp, p.behaviour, ref, p.advantages, p.loss_mask, p.off_policy, norm, cfg, p.segments, p.delayed, kl_full
    )


def _train(
    model: Any,
    reference: Any,
    source: Source,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    step: int,
    policy_version: int,
    on_step: Callable[[TrainStep], object] | None,
    should_stop: Callable[[], bool] | None,
    trained: TrainedSet,
    served_by: Callable[[Batch], str | None] | None = None,
) -> list[TrainStep]:
    dp, pipe = DataParallel(), Pipeline()
    steps: list[TrainStep] = []
    while step < cfg.steps and not (should_stop is not None and pipe.all_ranks_true(dp, should_stop())):
        t0 = time.monotonic()
        batches: list[Batch] = []
        useful = time.monotonic()  # when the last batch of the trained reward version arrived
        while len(batches) < cfg.micro_batches_per_step:
            b = source.get(cfg.idle_timeout_s)
            if b is None:
                break
            other_version = bool(cfg.reward_version and b.reward_version and b.reward_version != cfg.reward_version)
            # another org's adapter batch, or (training an adapter) the shared policy's
            if other_version or b.adapter != cfg.adapter:
                # another reward version's batch: read past, never trained (its samples stay trainable); a
                # stream of nothing else counts as idle, or the cycle's wall-time trigger would never be checked
                if time.monotonic() - useful > cfg.idle_timeout_s:
                    break
                continue
            useful = time.monotonic()
            window = (policy_version - cfg.max_policy_lag, policy_version)
            # delayed samples are trained up to max_delayed_lag (0: never, an empty window)
            late = (policy_version - cfg.max_delayed_lag, policy_version) if cfg.max_delayed_lag > 0 else (1, 0)
            if (b := trained.take(b, window, late)) is not None:
                batches.append(b)
        if not pipe.all_ranks_true(dp, len(batches) == cfg.micro_batches_per_step):
            trained.discard()  # the partial step is not trained: its batches are read again by the next run
            break  # a partial step would change the effective batch size: wait for the next run
        # Dr. GRPO: one constant for the whole global batch (all DP ranks), not the token count
        norm = cfg.loss.norm_tokens or cfg.micro_batches_per_step * dp.size * batches[0].tokens.size
        # prepared once: every update of the step trains the same micro-batches
        prepared = [prepare(b, policy_version, cfg.max_policy_lag, cfg.max_delayed_lag) for b in batches]
        # each micro-batch through the adapter that served it (None: the base alone); None: as the run is set up
        through = [served_by(b) for b in batches] if served_by is not None else None
        first: tuple[dict[str, float], dict[str, int], dict[str, int], float] | None = None
        for update in range(cfg.updates_per_step):
            # the step's figures are its first update's (the same on every rank, so the later ones skip the
            # metrics' collectives)
            result = _update_once(model, reference, prepared, through, opt, cfg, norm, step, dp, pipe, update == 0)
            first = first or result
        assert first is not None  # updates_per_step >= 1, checked in train()
        sums, lag_hist, delayed_hist, grad_norm = first
        # what this step really trained on: samples within the policy lag (stale ones are masked)
        step_batches, step_samples = trained.step_ids()
        batch_ids, sample_ids = dp.gather(step_batches), dp.gather(step_samples)
        step += 1
        trained.commit()
        source.commit()  # only now: the step that used these batches is in the weights
        n = max(1, sums["tokens"])
        record = TrainStep(
            run_id=cfg.run_id,
            step=step,
            policy_version=policy_version,
            loss=sums["loss"],
            pg_loss=sums["pg"],
            kl=sums["kl_tok"] / n,
            clip_fraction=sums["clip_tok"] / n,
            is_truncated_fraction=sums["trunc_tok"] / n,
            tokens=int(sums["tokens"]),
            on_policy_fraction=sums["on"] / n,
            near_policy_fraction=(sums["tokens"] - sums["on"] - sums["delayed"]) / n,
            delayed_fraction=sums["delayed"] / n,
            delayed_tokens=int(sums["delayed"]),
            delayed_mean_lag=sums["dlag_sum"] / max(1, sums["dlag_tok"]),
            delayed_lag_histogram=delayed_hist,
            delayed_truncated_fraction=sums["dtrunc_tok"] / max(1, sums["delayed"]),
            lag_histogram=lag_hist,
            grad_norm=grad_norm,
            dual_clip_fraction=sums["dual_tok"] / n,
            seq_guarded_tokens=int(sums["guarded"]),
            mismatch_k3=sums["mm_k3_tok"] / max(1, sums["mm_tok"]),
            mismatch_max_abs_log_ratio=sums["mm_max"],
            # trained tokens per second of the step: every update's (updates_per_step passes over its tokens)
            tokens_per_s=sums["tokens"] * cfg.updates_per_step / max(1e-9, time.monotonic() - t0),
            batch_ids=batch_ids,
            sample_ids=sample_ids,
            at=time.time_ns() // 1_000_000,
            reward_version=cfg.reward_version,
            adapter=cfg.adapter,
            served_through_tokens=int(sums["served_tok"]),
        )
        steps.append(record)
        metrics.observe_step(record)
        if on_step:
            on_step(record)
        if cfg.checkpoint_dir and (step % cfg.checkpoint_every == 0):
            save(model, opt, source, cfg, step, policy_version, trained)
    if cfg.checkpoint_dir and steps and step % cfg.checkpoint_every:
        save(model, opt, source, cfg, step, policy_version, trained)  # the end of a run is always resumable
    return steps


def _update_once(
    model: Any,
    reference: Any,
    prepared: list[Prepared],
    through: list[str | None] | None,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    norm: int,
    step: int,
    dp: DataParallel,
    pipe: Pipeline,
    metrics: bool = True,
) -> tuple[dict[str, float], dict[str, int], dict[str, int], float] | None:
    """One optimizer update on a step's micro-batches (each through the adapter ``through`` names, None in it = the
    base alone; ``through`` None = as the run is set up): the forward and backward passes, the gradient reductions
    and clip, the optimizer step. Returns (the loss's sums over every rank, the lag histograms, the gradient norm
    before clipping); None without ``metrics`` (no metric collectives then: every rank must pass the same)."""
    opt.zero_grad(set_to_none=True)
    sums: dict[str, float] = {
        "loss": 0.0,
        "pg": 0.0,
        "kl_tok": 0.0,
        "clip_tok": 0.0,
        "trunc_tok": 0.0,
        "tokens": 0,
        "on": 0,
        "dual_tok": 0.0,
        "guarded": 0,
        "mm_k3_tok": 0.0,
        "mm_tok": 0,
        "mm_max": 0.0,
        "delayed": 0,
        "dtrunc_tok": 0.0,
        "dlag_sum": 0,
        "dlag_tok": 0,
        "served_tok": 0,
    }
    lag_hist: dict[str, int] = {}
    delayed_hist: dict[str, int] = {}
    if pipe.size == 1:
        full = cfg.loss.kl_estimator == "full"
        for i, p in enumerate(prepared):
            with lora.activate(model, through[i]) if through is not None else contextlib.nullcontext():
                if full:
                    lp, log_softmax = forward_logprobs_and_log_softmax(
                        model, p.tokens, p.positions, p.targets, p.attention_mask
                    )
                else:
                    lp = forward_logprobs(model, p.tokens, p.positions, p.targets, p.attention_mask)
            ref, ref_log_softmax = _ref_logprobs(model, reference, p, cfg.adapter, full)
            kl_full = full_kl(log_softmax, ref_log_softmax) if ref_log_softmax is not None else None
            out = _policy_loss(p, lp, ref, norm, cfg.loss, kl_full)
            out.loss.backward()
            _add_metrics(sums, out)
            _count_lags(lag_hist, delayed_hist, sums, p)
            if through is not None and through[i] is not None:
                sums["served_tok"] += out.tokens
    else:
        for out in pipeline_step(model, reference, prepared, norm, cfg.loss):  # outputs on the last stage only
            _add_metrics(sums, out)
        for p in prepared:  # every stage holds the same micro-batches
            _count_lags(lag_hist, delayed_hist, sums, p)
    pipe.reduce_tied_embedding_grads(model)
    reduce_sequence_parallel_grads(model)
    dp.reduce_gradients(model)
    # the global norm before clipping, for train_metrics (computed, not applied, with clipping off)
    grad_norm = clip_grad_norm(model, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    for group in opt.param_groups:  # linear warm-up (by step, so a resumed run continues it; one lr per step)
        group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    if not metrics:
        opt.step()
        return None
    keys = [k for k in sums if k != "mm_max"]
    totals = dp.sum(pipe.from_last_stage([sums[k] for k in keys]))  # the last stage computed them
    (mm_max,) = dp.max(pipe.from_last_stage([sums["mm_max"]]))  # a max: MAX over the replicas, not SUM
    sums = dict(zip(keys, totals))
    sums["mm_max"] = mm_max
    for k in ("tokens", "on", "delayed", "served_tok"):
        sums[k] = int(sums[k])
    lag_hist, delayed_hist = dp.merge_counts(lag_hist), dp.merge_counts(delayed_hist)
    opt.step()
    return sums, lag_hist, delayed_hist, grad_norm


def _add_metrics(sums: dict[str, float], out: LossOutput) -> None:
    sums["loss"] += out.loss.item()
    sums["pg"] += out.pg_loss
    sums["kl_tok"] += out.kl * out.tokens
    sums["clip_tok"] += out.clip_fraction * out.tokens
    sums["trunc_tok"] += out.is_truncated_fraction * out.tokens
    sums["tokens"] += out.tokens
    sums["on"] += out.on_policy_tokens
    sums["dual_tok"] += out.dual_clip_fraction * out.tokens
    sums["guarded"] += out.seq_guarded_tokens
    sums["mm_k3_tok"] += out.mismatch_k3 * out.mismatch_tokens
    sums["mm_tok"] += out.mismatch_tokens
    sums["mm_max"] = max(sums["mm_max"], out.mismatch_max_abs_log_ratio)
    sums["delayed"] += out.delayed_tokens
    sums["dtrunc_tok"] += out.delayed_truncated_fraction * out.tokens


def _count_lags(lag_hist: dict[str, int], delayed_hist: dict[str, int], sums: dict[str, float], p: Prepared) -> None:
    """Every sample's lag (``lag_histogram``), the trained delayed samples' lags and their tokens' lag sum."""
    for lag in p.lags.tolist():
        lag_hist[str(lag)] = lag_hist.get(str(lag), 0) + 1
    for lag in p.delayed_lags.tolist():
        delayed_hist[str(lag)] = delayed_hist.get(str(lag), 0) + 1
    sums["dlag_sum"] += p.delayed_lag_sum
    sums["dlag_tok"] += p.delayed_input_tokens


@contextlib.contextmanager
def _schedule_config(model: Any, variable_seq_lengths: bool) -> Iterator[None]:
    """Set the fields of ``model.config`` that megatron's schedule reads, for one schedule call.

    - ``calculate_per_token_loss = True`` with a ``(loss, num_tokens, metrics)`` loss function: the
      schedule then backpropagates the loss as returned. (Otherwise it divides it by the number of
      micro-batches, and by num_tokens for a triple.) Our loss is already the Dr. GRPO sum over the
      micro-batch divided by the step's constant, exactly as in the pp = 1 path.
    - ``variable_seq_lengths``: True when the step's micro-batches differ in shape; the stages then
      exchange each activation's shape before it (else every activation is ``[S, B, hidden]``).
    - no ``finalize_model_grads_func`` (it expects megatron's DDP wrapper): the trainer all-reduces
      the tied embedding's gradient itself (:meth:`Pipeline.reduce_tied_embedding_grads`) and the
      data-parallel gradients with :class:`DataParallel`; no ``grad_scale_func`` (no loss scaling:
      fp32 or bf16, never fp16), no ``no_sync_func`` / ``grad_sync_func`` (no async grad reduction).
    """
    config = checkpoint.unwrap(model).config
    want: dict[str, Any] = {
        "calculate_per_token_loss": True,
        "variable_seq_lengths": variable_seq_lengths,
        "finalize_model_grads_func": None,
        "grad_scale_func": None,
        "no_sync_func": None,
        "grad_sync_func": None,
    }
    if config.pipeline_dtype is None:
        raise RuntimeError("the model's TransformerConfig has no pipeline_dtype (trainer.model sets it)")
    saved = {k: getattr(config, k) for k in want}
    for k, v in want.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(config, k, v)


def pipeline_step(
    model: Any, reference: Any, prepared: list[Prepared], norm: float, loss_cfg: LossSettings
) -> list[LossOutput]:
    """One optimizer step's forward and backward passes through megatron's pipeline schedule (pp > 1).

    Two schedule calls over the same micro-batches, each rank running its own stage:

    1. the frozen ``reference``, ``forward_only`` under ``torch.no_grad``: the last stage turns the
       logits of each micro-batch into per-token log-probs (returned as non-loss data, in order);
    2. the policy ``model``, forward and backward (1F1B): the last stage computes the log-probs the
       same way (:func:`trainer.model.logprobs_from_logits`, as ``forward_logprobs`` does) and
       :func:`trainer.loss.policy_loss` with the step's constant ``norm``; the schedule backpropagates
       that loss unscaled (:func:`_schedule_config`), so gradients accumulate over the micro-batches
       exactly as in the pp = 1 path.

    Returns the micro-batches' :class:`LossOutput` in order on the last stage, ``[]`` on the others.
    Every stage needs every micro-batch: the first reads the tokens and positions, all of them the
    attention mask, the last the targets and the loss inputs.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    shapes = {tuple(p.tokens.shape) for p in prepared}
    rows, seq = prepared[0].tokens.shape
    schedule: dict[str, Any] = {"num_microbatches": len(prepared), "seq_length": seq, "micro_batch_size": rows}

    full = loss_cfg.kl_estimator == "full"

    def ref_logprobs(targets: torch.Tensor, logits: torch.Tensor, non_loss_data: bool = False) -> Any:
        return logprobs_and_log_softmax(logits, targets) if full else logprobs_from_logits(logits, targets)

    def ref_step(data: Iterator[Prepared], m: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        p = next(data)
        return m(p.tokens, p.positions, p.attention_mask), functools.partial(ref_logprobs, p.targets)

    with _schedule_config(reference, len(shapes) > 1), torch.no_grad():
        refs = forward_backward(
            forward_step_func=ref_step,
            data_iterator=iter(prepared),
            model=reference,
            forward_only=True,
            collect_non_loss_data=True,
            **schedule,
        )
    refs = list(refs) if refs else [None] * len(prepared)  # non-last stages collect nothing
    outs: list[LossOutput] = []

    def loss_func(p: Prepared, ref: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        kl_full = None
        if full:
            ref, ref_log_softmax = ref
            lp, log_softmax = logprobs_and_log_softmax(logits, p.targets)
            kl_full = full_kl(log_softmax, ref_log_softmax)
        else:
            lp = logprobs_from_logits(logits, p.targets)
        out = _policy_loss(p, lp, ref, norm, loss_cfg, kl_full)
        outs.append(out)
        return out.loss, torch.tensor(out.tokens, dtype=torch.int), {}

    def policy_step(data: Iterator[tuple[Prepared, Any]], m: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        p, ref = next(data)
        return m(p.tokens, p.positions, p.attention_mask), functools.partial(loss_func, p, ref)

    with _schedule_config(model, len(shapes) > 1):
        forward_backward(
            forward_step_func=policy_step,
            data_iterator=iter(list(zip(prepared, refs))),
            model=model,
            forward_only=False,
            **schedule,
        )
    return outs


class Pipeline:
    """Collectives over megatron's pipeline-parallel group (no-ops with one stage)."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        initialized = ps.model_parallel_is_initialized()
        self.size = ps.get_pipeline_model_parallel_world_size() if initialized else 1
        self.group = ps.get_pipeline_model_parallel_group() if self.size > 1 else None
        self.last_rank = ps.get_pipeline_model_parallel_last_rank() if self.size > 1 else 0

    def from_last_stage(self, values: list[float]) -> list[float]:
        """The last stage's ``values`` on every stage (only it computes the loss and its metrics)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.broadcast(t, src=self.last_rank, group=self.group)
        return t.tolist()

    def all_ranks_true(self, dp: DataParallel, flag: bool) -> bool:
        """``flag`` is true on every rank: every rank of every stage must take the same step (a stage
        that stopped alone would leave the others waiting in the schedule). With one stage: over the
        data-parallel group, as before."""
        if self.size == 1:
            return dp.all_true(flag)
        return _sum([0.0 if flag else 1.0], group=None)[0] == 0.0  # the default group: every rank

    def reduce_tied_embedding_grads(self, model: Any) -> None:
        """With tied embeddings the first stage holds the input embedding and the last stage a copy of
        it as the output layer (megatron copies it at build time): sum their gradients over megatron's
        embedding group so both copies take the same update (what megatron's ``finalize_model_grads``
        does). Before the data-parallel reduction and the clipping."""
        if self.size == 1:
            return
        from megatron.core import parallel_state as ps

        m = checkpoint.unwrap(model)
        if not getattr(m, "share_embeddings_and_output_weights", False) or not (m.pre_process or m.post_process):
            return  # untied, or a middle stage (no copy)
        weight = m.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        torch.distributed.all_reduce(weight.grad, group=ps.get_embedding_group())


def reduce_sequence_parallel_grads(model: Any) -> None:
    """Under sequence parallelism each tensor-parallel rank runs the norms (and row-parallel biases) on
    its slice of the sequence, so their gradients are partial: sum them over the tensor-parallel group
    (megatron marks these parameters ``sequence_parallel``; this is what its ``finalize_model_grads``
    does, which the trainer does not use). A no-op without such parameters or with tp = 1."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    _sum_grads(grads, ps.get_tensor_model_parallel_group())


def _sum_grads(grads: list[torch.Tensor], group: Any) -> None:
    """Sum ``grads`` in place over ``group`` (one flat all-reduce)."""
    if not grads:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def _sum(values: list[float], group: Any) -> list[float]:
    """``values`` summed element-wise over ``group`` (None = every rank)."""
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=group)
    return t.tolist()


def clip_grad_norm(model: Any, max_norm: float) -> float:
    """Scale every gradient so that the global norm is at most ``max_norm``; return the norm before.

    Under tensor parallelism a sharded parameter (megatron marks it ``tensor_model_parallel``) holds
    a slice of the gradient on each rank, a replicated one (layer norms, some biases) the whole of
    it: the squared norms of the shards are summed over the tensor-parallel group, the replicated
    ones counted once - every rank then computes the same norm and the same scale (what
    ``torch.nn.utils.clip_grad_norm_`` on an unsharded model gives).

    Under pipeline parallelism each stage holds other parameters: the stages' squared norms are
    summed over the pipeline group. A tied embedding's copy on the last stage (megatron marks it
    ``shared``) is the same parameter as the first stage's embedding, so it is counted once (it is
    still scaled)."""
    from megatron.core import parallel_state as ps

    grads = [
        (p.grad, bool(getattr(p, "tensor_model_parallel", False)), bool(getattr(p, "shared", False)))
        for p in model.parameters()
        if p.grad is not None
    ]
    pipeline = ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1
    if not grads and not pipeline:
        return 0.0
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for g, is_shard, is_copy in grads:
        if is_copy:
            continue
        sq = g.detach().double().pow(2).sum()
        if is_shard:
            sharded += sq
        else:
            replicated += sq
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
    total = sharded + replicated
    if pipeline:
        torch.distributed.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g, _, _ in grads:
            g.mul_(scale)
    return norm


class DataParallel:
    """Collectives over megatron's data-parallel group (no-ops with one replica).

    Gradients are summed, not averaged: every rank's loss is already divided by the global constant."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.group = ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None
        self.size = ps.get_data_parallel_world_size() if self.group is not None else 1

    def reduce_gradients(self, model: Any) -> None:
        if self.size == 1:
            return
        _sum_grads([p.grad for p in model.parameters() if p.grad is not None], self.group)

    def sum(self, values: list[float]) -> list[float]:
        if self.size == 1:
            return values
        return _sum(values, self.group)

    def max(self, values: list[float]) -> list[float]:
        """``values``' element-wise maximum over the replicas (a MAX all-reduce; ``sum`` is a SUM one)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def all_true(self, flag: bool) -> bool:
        return self.sum([0.0 if flag else 1.0])[0] == 0.0

    def gather(self, items: list) -> list:
        if self.size == 1:
            return items
        out: list = [None] * self.size
        torch.distributed.all_gather_object(out, items, group=self.group)
        return [x for part in out for x in part]

    def merge_counts(self, counts: dict[str, int]) -> dict[str, int]:
        merged: dict[str, int] = {}
        for part in self.gather([counts]):
            for k, v in part.items():
                merged[k] = merged.get(k, 0) + v
        return dict(sorted(merged.items(), key=lambda kv: int(kv[0])))


def save(
    model: Any,
    opt: torch.optim.Optimizer,
    source: Source,
    cfg: TrainConfig,
    step: int,
    policy_version: int,
    trained: TrainedSet,
):
    """Checkpoint the weights (an adapter run: the adapter's) with the offsets that produced them (resume continues
    right after) and the micro-batches/samples they have seen."""
    extra = {
        "step": step,
        "policy_version": policy_version,
        "offsets": source.position(),
        "run_id": cfg.run_id,
        "trained": trained.state(),
    }
    if cfg.adapter:
        return lora.save_adapter(cfg.checkpoint_dir, model, cfg.adapter, step, cfg.adapter_base, opt, extra)
    return checkpoint.save(checkpoint.step_dir(cfg.checkpoint_dir, step), model, opt, extra=extra)
