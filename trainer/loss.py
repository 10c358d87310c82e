"""Policy loss of the trainer: Dr. GRPO surrogate with truncated importance weights and a KL term (pure torch).

DESIGN.md, "Near-on-policy training". All per-token inputs share one shape (``[T]`` or ``[B, S]``):
``logprobs`` lp (current policy, with grad), ``behaviour_logprobs`` b (the rollout's), ``ref_logprobs``
ref (reference model), ``advantages`` A, ``loss_mask`` m (1 = trained token, 0 = not), ``off_policy``
o (1 = the token's sample has policy lag >= 1) and, optionally, ``seq_ids`` s (which sequence - packed
sample - each token belongs to; any integers, equal within a sequence) and ``delayed`` δ (1 = the
token's sample is delayed: lag over the trainer's max_policy_lag, within max_delayed_lag; None = all 0).
b, ref and A are data: they are detached here.

Three kinds of trained token: **on-policy** (δ_t = 0, o_t = 0), **near-on-policy** (δ_t = 0, o_t = 1)
and **delayed** (δ_t = 1, whatever o_t).

Per trained token t (m_t = 1), with config ``eps_low``, ``eps_high``, ``is_cap`` = C, ``kl_coef`` = beta,
``delayed_correction``, ``delayed_is_cap`` = D and the guards ``log_ratio_clamp`` = L, ``dual_clip`` = c,
``k3_clamp`` = K (each 0 = off); sg(.) is stop-gradient (detach)::

    b'_t  = sg(lp_t)  if δ_t = 1 and delayed_correction = "none"   else   b_t
    d_t   = clamp(lp_t - b'_t, -L, L)                         # log-ratio clamp (before any exp)
    r_t   = exp(d_t)                                          # ratio to the behaviour policy
    if δ_t = 0:                                               # on- and near-on-policy: PPO-clip
      w_t   = min(r_t, C)  if o_t = 1   else   r_t            # truncated IS weight, off-policy only
      pg_t  = -min(w_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)
    if δ_t = 1:                                               # delayed: truncated IS policy gradient
      w_t   = sg(min(r_t, D))
      pg_t  = -w_t * exp(lp_t - sg(lp_t)) * A_t               # value -w_t*A_t, gradient -w_t*A_t*grad lp_t
    pg_t  = min(pg_t, -c * A_t)      if A_t < 0              # dual-clip, every negative-advantage token
    x_t   = clamp(ref_t - lp_t, -L, L)
    kl_t  = min(exp(x_t) - x_t - 1, K)                        # k3 (>= 0, unbiased for KL(pi || ref)), clamped
    loss  = sum_t m_t * (f_t * pg_t + beta * kl_t) / norm

f_t = 1 and m_t is the input mask unless the per-sequence guard is on (below).

KL estimator (``kl_estimator``): ``k3`` (the default) is the formula above, on the sampled token only. ``full``
replaces it with the exact ``kl_t = min(sum_v pi_t(v) (log pi_t(v) - log ref_t(v)), K)`` over the whole
vocabulary at position t, passed in as ``full_kl`` (:func:`trainer.model.full_kl`, computed from both models'
log-softmaxes, tensor-parallel aware). k3 is unbiased in expectation but each sample sees only the token drawn:
mass the policy moves onto tokens it almost never samples (a malformed tool name) shows up in no sampled
log-ratio, so k3 cannot pull it back, while the full KL charges it at once. It costs the reference's whole
log-softmax ``[B, S, V]`` per micro-batch. The clamp K (``k3_clamp``) bounds either estimator.

- The unclipped branch of an off-policy token uses w_t, so a stale sample's weight never exceeds C,
  also where the clip does not bind (negative advantages, where PPO's min picks the unclipped r_t*A_t).
  Where the truncation binds (r_t > C) w_t is the constant C: that token's value is -C*A_t and its
  gradient is zero (as in dual-clip PPO). On-policy tokens (o_t = 0) are plain PPO-clip.
- Delayed tokens (``delayed_correction = "truncated_is"``, the default): the weight of a delayed token's
  value and gradient is w_t = min(r_t, D) <= D for any lp and b (IMPALA's truncated importance
  sampling, V-trace's rho-bar): the gradient never vanishes where the cap binds (unlike the PPO clip,
  which would zero most of a stale sample's tokens) and is never more than D*|A_t|*|grad lp_t|. There
  is no PPO clip on them (the ratio to a behaviour policy several versions old is far from 1 anyway).
  With the default D = 1 a delayed token is only ever down-weighted. ``delayed_correction = "none"``
  (the control arm of the experiment): b' = sg(lp), so r_t = 1, w_t = 1 and the gradient is the plain
  REINFORCE A_t * grad lp_t, with no correction at all; the sequence guard sees log-ratio 0 there.
- Without delayed tokens (``delayed`` None or all 0) the computation is exactly the one before the
  delayed path existed: the on- and near-on-policy tokens' values and gradients are bit-identical,
  and with delayed tokens present theirs are still unchanged (each token's terms are its own).
- Where the clipped branch is the active min (it changed the value: clip(r)*A < w*A) the value is
  constant in lp, so the gradient is zero; ties take the unclipped branch (same value and gradient).
- Dual-clip (Ye et al. 2020, "Mastering complex control in MOBA games"): PPO's min leaves the
  objective of a token with A_t < 0 unbounded as r_t grows (pg_t = r_t*|A_t|, gradient r_t*|A_t|):
  one token whose inference engine and trainer disagree (r = e^25) gives a gradient of ~7e10*|A_t|.
  Dual-clip bounds it at c*|A_t| = -c*A_t: where r_t*|A_t| (or w_t*|A_t|) would exceed it the value
  is the constant -c*A_t and the gradient zero. With c > 1 + eps_high it binds only for r_t > c (on-
  policy; off-policy tokens only when C > c), so at the default c = 3 it never binds on tokens within
  the clip range. It applies to every token with A_t < 0, on- and off-policy. Requires c > 1.
- Log-ratio clamp: d_t and x_t are clamped to [-L, L] before exp, so no ratio or k3 overflows (e^20 ~
  4.9e8 at the default L = 20, far beyond any clip or cap: a clamped token is clipped, truncated or
  dual-clipped anyway). Inside the range torch.clamp is the identity with gradient exactly 1; outside
  it the gradient through that log-ratio is zero.
- k3 clamp: kl_t is at most K (default 10, as veRL's ``low_var_kl``); where it binds the KL term's
  value is K and its gradient zero. k3 <= 10 holds for x in about [-11, 2.6] (the policy may assign a
  token up to e^11 times the reference's probability, or e^-2.6 = 7% of it, before the clamp binds).
- Bound: with dual-clip and the k3 clamp on, every on- and near-on-policy token's |pg_t| and
  |d pg_t / d lp_t| are at most max(1 + eps_high, c) * |A_t|, a delayed token's at most min(D, c) * |A_t|
  for A_t < 0 and D * |A_t| for A_t > 0 (so every token's at most max(1 + eps_high, c, D) * |A_t|);
  every token's kl_t is in [0, K] and |d kl_t / d lp_t| <= max(1, K + x_K) where x_K > 0 solves
  exp(x) - x - 1 = K (x_K ~ 2.61 for K = 10). So the loss and its gradient are bounded by the
  advantages and the config, whatever lp, b and ref are.
- Guards off (L = c = K = 0, :data:`PLAIN`; the trainer's settings turn them on, see
  :data:`GUARDED`): the plain formula. With every guard on and no token beyond a guard's threshold,
  the loss and its gradient are bit-identical to the plain formula (clamp and where select the same
  values; their gradients are exactly the same).

Per-sequence importance-ratio guard (``seq_ratio_guard``, after veRL's rollout correction,
``rollout_rs`` / ``rollout_is`` in "geometric" mode). Each sequence's geometric-mean ratio over its
trained tokens is ``g_s = exp(mean_{t in s, m_t = 1} d_t)`` (d_t after the log-ratio clamp, detached).
With the band [``seq_ratio_low``, ``seq_ratio_high``] = [lo, hi]:

- ``off`` (default): nothing changes (seq_ids are not needed).
- ``mask``: every token of a sequence with g_s < lo or g_s > hi gets m_t = 0: it leaves the loss
  (policy gradient and KL) and the token metrics, as if it had not been sent (rejection sampling).
- ``truncate``: the policy-gradient term of every token of a sequence with g_s > hi is multiplied by
  the constant f_t = hi / g_s < 1 (detached), which caps the sequence's geometric-mean weight at hi
  (truncated importance sampling); the KL term is untouched. A sequence below lo is kept: its weights
  are small already and truncation only caps (use ``mask`` to drop it).

- Dr. GRPO normalisation: ``norm`` is a constant passed in (e.g. global batch size x max sequence
  length), not the number of trained tokens, and there is no per-sequence length normalisation; so
  padding or masked tokens never change the loss, and each token's gradient scale is independent of
  the batch's composition.
- Tokens with m_t = 0 contribute exactly nothing, to the value, the gradient or any metric, even if
  their inputs are inf or nan (they are replaced before any exp).

Metrics in :class:`LossOutput` are detached python floats over trained tokens (N = their number, after
the sequence guard): ``pg_loss`` = sum_t m_t*f_t*pg_t / norm (so ``loss = pg_loss + beta * kl * N / norm``);
``kl`` = sum_t m_t*kl_t / N; ``clip_fraction`` = share of trained tokens whose clipped branch was the active
min; ``dual_clip_fraction`` = share of trained tokens where the dual-clip bound replaced the value;
``is_truncated_fraction`` = share of trained tokens that are near-on-policy with r_t > C; ``mean_ratio`` =
mean r_t (untruncated; 1 on delayed tokens under "none"); ``tokens`` = N; ``on_policy_tokens`` = trained
tokens with o_t = 0 and δ_t = 0; ``delayed_tokens`` = trained tokens with δ_t = 1 (so the near-on-policy
ones are N - on - delayed); ``delayed_truncated_fraction`` = share of trained tokens that are delayed with
r_t > D (0 under "none"); ``seq_guarded_tokens`` = input-trained tokens whose sequence the guard masked
or truncated. ``clip_fraction`` counts only on- and near-on-policy tokens (delayed ones have no clip).
Training-inference mismatch, over the on-policy tokens of the *input* mask (M = ``mismatch_tokens``,
m_t = 1, o_t = 0 and δ_t = 0, before the sequence guard): ``mismatch_k3`` = (1/M) sum_t exp(d_t) - d_t - 1, the
k3 estimator of KL(pi_behaviour || pi_trainer) on tokens sampled from the behaviour policy
(d_t = lp_t - b_t, clamped to [-L, L] when L > 0, so it stays finite), and ``mismatch_max_abs_log_ratio``
= max_t |lp_t - b_t| (unclamped). With N = 0 the loss is a zero that still has a grad path and every
per-token mean is 0.0 (likewise the mismatch metrics with M = 0).

Inputs in half precision are computed in float32; float64 stays float64.

:func:`token_logprobs` turns logits ``[..., V]`` and target ids ``[...]`` into per-token log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rtrl.sections.trainer import LossSettings

__all__ = [
    "GUARDED",
    "PLAIN",
    "LossOutput",
    "policy_loss",
    "token_logprobs",
]

#: the trainer's loss by default, the ``loss`` section's defaults: log-ratio clamp 20, dual-clip 3 and k3 clamp 10
#: (the values veRL and dual-clip PPO use); the sequence guard stays off
GUARDED = LossSettings()
#: every numeric guard off: the plain formula
PLAIN = LossSettings(log_ratio_clamp=0.0, dual_clip=0.0, k3_clamp=0.0)


@dataclass(frozen=True)
class LossOutput:
    """The loss to backpropagate and detached metrics (definitions in the module docstring)."""

    loss: Tensor  # scalar, with grad
    pg_loss: float
    kl: float
    clip_fraction: float
    is_truncated_fraction: float
    mean_ratio: float
    tokens: int
    on_policy_tokens: int
    dual_clip_fraction: float = 0.0
    seq_guarded_tokens: int = 0
    mismatch_k3: float = 0.0
    mismatch_max_abs_log_ratio: float = 0.0
    mismatch_tokens: int = 0
    delayed_tokens: int = 0
    delayed_truncated_fraction: float = 0.0


def _as_flag(x: Tensor, name: str, shape: torch.Size) -> Tensor:
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (the shape of logprobs)")
    if x.dtype == torch.bool:
        return x
    flag = x != 0
    if bool((flag & (x != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")
    return flag


def _sequence_guard(
    log_ratio: Tensor, mask: Tensor, seq_ids: Tensor, cfg: LossSettings
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(mask after the guard, per-token pg factor or None, tokens whose sequence was guarded).

    ``log_ratio`` is d_t (clamped, 0 where not trained); everything here is detached."""
    ids = seq_ids[mask]
    uniq, inv = torch.unique(ids, return_inverse=True)
    d = log_ratio.detach()[mask]
    count = d.new_zeros(len(uniq)).index_add_(0, inv, torch.ones_like(d))
    mean = d.new_zeros(len(uniq)).index_add_(0, inv, d) / count.clamp(min=1)  # log g_s
    high = mean > math.log(cfg.seq_ratio_high)
    guarded = torch.zeros_like(mask)
    if cfg.seq_ratio_guard == "mask":
        outside = (mean < math.log(cfg.seq_ratio_low)) | high
        guarded[mask] = outside[inv]
        return mask & ~guarded, None, guarded
    guarded[mask] = high[inv]
    factor = torch.ones_like(log_ratio)
    factor[mask] = torch.exp(math.log(cfg.seq_ratio_high) - mean).clamp(max=1.0)[inv]
    return mask, factor, guarded


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    off_policy: Tensor,
    norm: float,
    config: LossSettings | None = None,
    seq_ids: Tensor | None = None,
    delayed: Tensor | None = None,
    full_kl: Tensor | None = None,
) -> LossOutput:
    """Dr. GRPO clipped surrogate with truncated off-policy IS weights plus beta * k3 KL, summed / ``norm``,
    with the guards of ``config``. ``seq_ids`` (integers, the shape of ``logprobs``) names each token's
    sequence; the sequence guard needs it. ``delayed`` (0/1 or bool, the shape of ``logprobs``; None = none)
    marks the tokens of delayed samples, trained with ``config.delayed_correction``. ``full_kl`` (the shape of
    ``logprobs``, differentiable; :func:`trainer.model.full_kl`) is each position's exact KL(pi || ref) over the
    vocabulary: the KL term when ``config.kl_estimator = "full"`` (required then, and ignored otherwise)."""
    cfg = config if config is not None else PLAIN
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not math.isfinite(norm) or norm <= 0:
        raise ValueError(f"norm must be a finite number > 0, got {norm!r}")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a float tensor, got {logprobs.dtype}")
    shape = logprobs.shape
    for name, x in (
        ("behaviour_logprobs", behaviour_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("advantages", advantages),
    ):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (the shape of logprobs)")
    mask = _as_flag(loss_mask, "loss_mask", shape)
    off = _as_flag(off_policy, "off_policy", shape)
    dly = _as_flag(delayed, "delayed", shape) if delayed is not None else None
    if dly is not None and not bool((dly & mask).any()):
        dly = None  # no delayed token: exactly the computation without the delayed path
    if seq_ids is not None and (seq_ids.shape != shape or seq_ids.is_floating_point() or seq_ids.dtype == torch.bool):
        raise ValueError(
            f"seq_ids must be an integer tensor of shape {tuple(shape)} (the shape of logprobs), "
            f"got {seq_ids.dtype} {tuple(seq_ids.shape)}"
        )
    if cfg.kl_estimator == "full" and (full_kl is None or full_kl.shape != shape or not full_kl.is_floating_point()):
        got = "None" if full_kl is None else f"{full_kl.dtype} {tuple(full_kl.shape)}"
        raise ValueError(
            f"kl_estimator = 'full' needs full_kl, a float tensor of shape {tuple(shape)} (the shape of logprobs), got {got}"
        )
    if cfg.seq_ratio_guard != "off" and seq_ids is None:
        raise ValueError(f"seq_ratio_guard = {cfg.seq_ratio_guard!r} needs seq_ids (each token's sequence)")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.to(dtype)
    zero = lp.new_zeros(())
    # Masked positions get 0 log-ratios and advantages *before* any exp, so inf/nan there cannot
    # reach the value or (through where's backward) the gradient.
    behaviour = behaviour_logprobs.detach().to(dtype)
    if dly is not None and cfg.delayed_correction == "none":
        behaviour = torch.where(dly, lp.detach(), behaviour)  # no correction: the ratio to itself, 1
    raw_log_ratio = torch.where(mask, lp - behaviour, zero)
    ref_minus_lp = torch.where(mask, ref_logprobs.detach().to(dtype) - lp, zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    log_ratio = raw_log_ratio
    if cfg.log_ratio_clamp > 0:
        log_ratio = torch.clamp(raw_log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ref_minus_lp = torch.clamp(ref_minus_lp, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)

    input_mask = mask
    factor: Tensor | None = None
    seq_guarded = torch.zeros_like(mask)
    if cfg.seq_ratio_guard != "off":
        assert seq_ids is not None
        mask, factor, seq_guarded = _sequence_guard(log_ratio, mask, seq_ids, cfg)

    ratio = torch.exp(log_ratio)
    near = off if dly is None else off & ~dly
    truncated = near & (ratio > cfg.is_cap) & mask
    weight = torch.where(truncated, ratio.new_tensor(cfg.is_cap), ratio)
    unclipped = weight * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    clip_active = (clipped < unclipped) & mask
    if dly is not None:
        clip_active = clip_active & ~dly
    pg = -torch.where(clip_active, clipped, unclipped)
    delayed_truncated = torch.zeros_like(mask)
    if dly is not None:
        # delayed: value -w*A, gradient -w*A*grad lp with the detached truncated weight w = min(r, D)
        delayed_weight = torch.clamp(ratio.detach(), max=cfg.delayed_is_cap)
        delayed_truncated = dly & mask & (ratio.detach() > cfg.delayed_is_cap)
        score = torch.exp(torch.where(mask, lp - lp.detach(), zero))  # 1, with gradient grad lp
        pg = torch.where(dly, -(delayed_weight * score * adv), pg)
    dual_active = torch.zeros_like(mask)
    if cfg.dual_clip > 0:
        bound = -cfg.dual_clip * adv
        dual_active = mask & (adv < 0) & (pg > bound)
        pg = torch.where(dual_active, bound, pg)
    if factor is not None:
        pg = torch.where(seq_guarded, pg * factor, pg)
    if cfg.kl_estimator == "full":
        assert full_kl is not None
        kl = torch.where(mask, full_kl.to(dtype), zero)  # masked positions: 0 before anything reads them
    else:
        kl = torch.exp(ref_minus_lp) - ref_minus_lp - 1.0
    if cfg.k3_clamp > 0:
        kl = torch.clamp(kl, max=cfg.k3_clamp)

    pg_sum = torch.where(mask, pg, zero).sum()
    kl_sum = torch.where(mask, kl, zero).sum()
    loss = (pg_sum + cfg.kl_coef * kl_sum) / norm

    with torch.no_grad():
        n = int(mask.sum())
        per = 1.0 / n if n else 0.0
        on = input_mask & ~off  # mismatch: every on-policy token sent for training, before the sequence guard
        if dly is not None:
            on = on & ~dly
        m = int(on.sum())
        d = log_ratio.detach() if cfg.log_ratio_clamp > 0 else raw_log_ratio.detach()
        k3 = torch.where(on, torch.exp(d) - d - 1.0, zero)
        max_abs = float(torch.where(on, raw_log_ratio.detach().abs(), zero).max()) if m else 0.0
        return LossOutput(
            loss=loss,
            pg_loss=float(pg_sum) / norm,
            kl=float(kl_sum) * per,
            clip_fraction=float(clip_active.sum()) * per,
            is_truncated_fraction=float(truncated.sum()) * per,
            mean_ratio=float(torch.where(mask, ratio, zero).sum()) * per,
            tokens=n,
            on_policy_tokens=int((mask & ~off).sum()) if dly is None else int((mask & ~off & ~dly).sum()),
            dual_clip_fraction=float(dual_active.sum()) * per,
            seq_guarded_tokens=int(seq_guarded.sum()),
            mismatch_k3=float(k3.sum()) / m if m else 0.0,
            mismatch_max_abs_log_ratio=max_abs,
            mismatch_tokens=m,
            delayed_tokens=0 if dly is None else int((mask & dly).sum()),
            delayed_truncated_fraction=float(delayed_truncated.sum()) * per,
        )


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[..., targets]: log-prob of each target id, shape ``targets.shape``.

    Computed as ``logit[target] - logsumexp(logits)``: no overflow for any finite logits, and no
    ``[..., V]`` log-softmax output is materialised (autograd keeps only the logits it already has).
    The absolute error is about float eps x max|logit| (float32: ~4e-6 at logits of 30), which is
    negligible inside exp(lp - b). Half-precision logits are upcast to float32 one row of the leading
    dimension at a time: under ``torch.no_grad`` (reference / behaviour recompute) the extra memory
    is one row's ``[S, V]`` in float32; with grad, autograd keeps each row's float32 copy.
    Every target must be a valid id in ``[0, V)``: give padding any valid id and mask it out of the loss.
    """
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} + (vocab,)")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    targets = targets.long()

    def rows(lg: Tensor, tg: Tensor) -> Tensor:
        picked = lg.gather(-1, tg.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(lg, dim=-1)

    if logits.dtype in (torch.float32, torch.float64):
        return rows(logits, targets)
    if logits.dim() == 1:
        return rows(logits.float(), targets)
    return torch.stack([rows(lg.float(), tg) for lg, tg in zip(logits, targets)])
