"""Policy loss of the trainer: Dr. GRPO surrogate with truncated importance weights and a k3 KL (pure torch).

DESIGN.md, "Near-on-policy training". All per-token inputs share one shape (``[T]`` or ``[B, S]``):
``logprobs`` lp (current policy, with grad), ``behaviour_logprobs`` b (the rollout's), ``ref_logprobs``
ref (reference model), ``advantages`` A, ``loss_mask`` m (1 = trained token, 0 = not) and ``off_policy``
o (1 = the token's sample has policy lag >= 1). b, ref and A are data: they are detached here.

Per trained token t (m_t = 1), with config ``eps_low``, ``eps_high``, ``is_cap`` = C, ``kl_coef`` = beta::

    r_t   = exp(lp_t - b_t)                                   # ratio to the behaviour policy
    w_t   = min(r_t, C)  if o_t = 1   else   r_t              # truncated IS weight, off-policy only
    pg_t  = -min(w_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)
    kl_t  = exp(ref_t - lp_t) - (ref_t - lp_t) - 1            # k3: >= 0, unbiased for KL(pi || ref)
    loss  = sum_t m_t * (pg_t + beta * kl_t) / norm

- The unclipped branch of an off-policy token uses w_t, so a stale sample's weight never exceeds C,
  also where the clip does not bind (negative advantages, where PPO's min picks the unclipped r_t*A_t).
  Where the truncation binds (r_t > C) w_t is the constant C: that token's value is -C*A_t and its
  gradient is zero (as in dual-clip PPO). On-policy tokens (o_t = 0) are plain PPO-clip.
- Where the clipped branch is the active min (it changed the value: clip(r)*A < w*A) the value is
  constant in lp, so the gradient is zero; ties take the unclipped branch (same value and gradient).
- Dr. GRPO normalisation: ``norm`` is a constant passed in (e.g. global batch size x max sequence
  length), not the number of trained tokens, and there is no per-sequence length normalisation; so
  padding or masked tokens never change the loss, and each token's gradient scale is independent of
  the batch's composition.
- Tokens with m_t = 0 contribute exactly nothing, to the value or the gradient, even if their
  inputs are inf or nan (they are replaced before any exp).

Metrics in :class:`LossOutput` are detached python floats over trained tokens (N = their number):
``pg_loss`` = sum_t m_t*pg_t / norm (so ``loss = pg_loss + beta * kl * N / norm``); ``kl`` = sum_t m_t*kl_t / N;
``clip_fraction`` = share of trained tokens whose clipped branch was the active min; ``is_truncated_fraction``
= share of trained tokens that are off-policy with r_t > C; ``mean_ratio`` = mean r_t (untruncated);
``tokens`` = N; ``on_policy_tokens`` = trained tokens with o_t = 0. With N = 0 the loss is a zero that
still has a grad path and every per-token mean is 0.0.

Inputs in half precision are computed in float32; float64 stays float64.

:func:`token_logprobs` turns logits ``[..., V]`` and target ids ``[...]`` into per-token log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["LossConfig", "LossOutput", "policy_loss", "token_logprobs"]


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of :func:`policy_loss` (validated on construction)."""

    eps_low: float = 0.2  # clip range below 1: in (0, 1)
    eps_high: float = 0.28  # clip range above 1 ("clip-higher"): > 0
    is_cap: float = 2.0  # C, cap of off-policy tokens' IS weight: >= 1 (a cap below 1 would shrink r = 1)
    kl_coef: float = 0.01  # beta, weight of the k3 KL to the reference: >= 0 (0 disables it)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"LossConfig.{f.name} must be a finite number, got {v!r}")
        if not 0.0 < self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in (0, 1), got {self.eps_low!r}")
        if not self.eps_high > 0.0:
            raise ValueError(f"LossConfig.eps_high must be > 0, got {self.eps_high!r}")
        if not self.is_cap >= 1.0:
            raise ValueError(f"LossConfig.is_cap must be >= 1, got {self.is_cap!r}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef!r}")


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


def _as_flag(x: Tensor, name: str, shape: torch.Size) -> Tensor:
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (the shape of logprobs)")
    if x.dtype == torch.bool:
        return x
    flag = x != 0
    if bool((flag & (x != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")
    return flag


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    off_policy: Tensor,
    norm: float,
    config: LossConfig | None = None,
) -> LossOutput:
    """Dr. GRPO clipped surrogate with truncated off-policy IS weights plus beta * k3 KL, summed / ``norm``."""
    cfg = config if config is not None else LossConfig()
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

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.to(dtype)
    zero = lp.new_zeros(())
    # Masked positions get 0 log-ratios and advantages *before* any exp, so inf/nan there cannot
    # reach the value or (through where's backward) the gradient.
    log_ratio = torch.where(mask, lp - behaviour_logprobs.detach().to(dtype), zero)
    ref_minus_lp = torch.where(mask, ref_logprobs.detach().to(dtype) - lp, zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)

    ratio = torch.exp(log_ratio)
    truncated = off & (ratio > cfg.is_cap) & mask
    weight = torch.where(truncated, ratio.new_tensor(cfg.is_cap), ratio)
    unclipped = weight * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    clip_active = (clipped < unclipped) & mask
    pg = -torch.where(clip_active, clipped, unclipped)
    kl = torch.exp(ref_minus_lp) - ref_minus_lp - 1.0

    pg_sum = torch.where(mask, pg, zero).sum()
    kl_sum = torch.where(mask, kl, zero).sum()
    loss = (pg_sum + cfg.kl_coef * kl_sum) / norm

    with torch.no_grad():
        n = int(mask.sum())
        per = 1.0 / n if n else 0.0
        return LossOutput(
            loss=loss,
            pg_loss=float(pg_sum) / norm,
            kl=float(kl_sum) * per,
            clip_fraction=float(clip_active.sum()) * per,
            is_truncated_fraction=float(truncated.sum()) * per,
            mean_ratio=float(torch.where(mask, ratio, zero).sum()) * per,
            tokens=n,
            on_policy_tokens=int((mask & ~off).sum()),
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
