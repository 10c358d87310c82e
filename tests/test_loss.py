"""Contracts of the policy loss (trainer.loss): Dr. GRPO clipped surrogate, truncated off-policy IS, k3 KL.

Hand-computed cases pin each branch of the formula (values worked out in the comments, with the
default clip range 1 - 0.2 .. 1 + 0.28 and cap C = 2); a float64 gradcheck and a per-token
reference implementation pin the whole on random inputs; token_logprobs is pinned against the
naive softmax -> log -> gather.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rtrl.sections.trainer import LossSettings
from trainer.loss import PLAIN, LossOutput, policy_loss, token_logprobs

NO_KL = PLAIN.model_copy(update=dict(kl_coef=0.0))  # eps_low 0.2, eps_high 0.28, is_cap 2.0


def run(ratios, adv, *, off=None, mask=None, ref=None, norm=1.0, cfg=NO_KL, dtype=torch.float64):
    """Loss for tokens with the given ratios r = exp(lp - b) (b = -1 everywhere); returns (out, lp)."""
    n = len(ratios)
    b = torch.full((n,), -1.0, dtype=dtype)
    lp = (b + torch.log(torch.tensor(ratios, dtype=dtype))).requires_grad_(True)
    ref_t = lp.detach().clone() if ref is None else torch.tensor(ref, dtype=dtype)
    out = policy_loss(
        lp,
        b,
        ref_t,
        torch.tensor(adv, dtype=dtype),
        torch.ones(n, dtype=dtype) if mask is None else torch.tensor(mask, dtype=dtype),
        torch.zeros(n, dtype=dtype) if off is None else torch.tensor(off, dtype=dtype),
        norm,
        cfg,
    )
    out.loss.backward()
    return out, lp


# ---------------------------------------------------------------- hand-computed cases


def test_on_policy_ratio_inside_clip_range():
    """Inside the clip range the loss is -r*A and its gradient -r*A (d r / d lp = r)."""
    out, lp = run([1.1], [2.0])
    # r = 1.1 in [0.8, 1.28]: pg = -min(1.1*2, 1.1*2) = -2.2; d/dlp = -r*A = -2.2
    assert out.loss.item() == pytest.approx(-2.2)
    assert lp.grad.tolist() == pytest.approx([-2.2])
    assert out.clip_fraction == 0.0


def test_positive_advantage_ratio_above_clip_is_clipped_with_zero_gradient():
    """A > 0 and r > 1 + eps_high: the value is -(1 + eps_high)*A and the gradient is zero."""
    out, lp = run([1.5], [1.0])
    # unclipped 1.5*1 = 1.5, clipped 1.28*1 = 1.28 -> min = 1.28, pg = -1.28
    assert out.loss.item() == pytest.approx(-1.28)
    assert lp.grad.tolist() == [0.0]
    assert out.clip_fraction == 1.0


def test_negative_advantage_ratio_below_clip_is_clipped_with_zero_gradient():
    """A < 0 and r < 1 - eps_low: the value is -(1 - eps_low)*A and the gradient is zero."""
    out, lp = run([0.5], [-1.0])
    # unclipped 0.5*-1 = -0.5, clipped 0.8*-1 = -0.8 -> min = -0.8, pg = 0.8
    assert out.loss.item() == pytest.approx(0.8)
    assert lp.grad.tolist() == [0.0]
    assert out.clip_fraction == 1.0


def test_pessimistic_side_is_not_clipped():
    """A > 0 with r < 1 - eps_low (and A < 0 with r > 1 + eps_high, on-policy) keep the unclipped r*A."""
    out, lp = run([0.5, 1.5], [1.0, -1.0])
    # t0: min(0.5, 0.8) = 0.5 -> pg -0.5, grad -r*A = -0.5
    # t1: min(-1.5, -1.28) = -1.5 -> pg 1.5, grad -r*A = 1.5
    assert out.loss.item() == pytest.approx(1.0)
    assert lp.grad.tolist() == pytest.approx([-0.5, 1.5])
    assert out.clip_fraction == 0.0


def test_off_policy_negative_advantage_large_ratio_truncated_at_cap():
    """Off-policy, A < 0, r > C: the weight is the constant C, value -C*A, gradient zero.

    The same token on-policy keeps the unbounded r*A (value and gradient r*|A|).
    """
    out, lp = run([5.0], [-1.0], off=[1.0])
    # w = min(5, 2) = 2: unclipped 2*-1 = -2, clipped 1.28*-1 = -1.28 -> min = -2, pg = 2
    assert out.loss.item() == pytest.approx(2.0)
    assert lp.grad.tolist() == [0.0]
    assert out.is_truncated_fraction == 1.0
    assert out.clip_fraction == 0.0

    on, lp_on = run([5.0], [-1.0], off=[0.0])
    # unclipped -5 < clipped -1.28 -> pg = 5, grad = -r*A = 5
    assert on.loss.item() == pytest.approx(5.0)
    assert lp_on.grad.tolist() == pytest.approx([5.0])
    assert on.is_truncated_fraction == 0.0


def test_off_policy_ratio_below_cap_is_untouched():
    """Off-policy with r <= C: the weight is r itself (value -r*A, gradient -r*A), so it never exceeds C."""
    out, lp = run([1.5], [-1.0], off=[1.0])
    # w = 1.5: unclipped -1.5 < clipped -1.28 -> pg 1.5, grad -r*A = 1.5
    assert out.loss.item() == pytest.approx(1.5)
    assert lp.grad.tolist() == pytest.approx([1.5])
    assert out.is_truncated_fraction == 0.0


def test_off_policy_positive_advantage_above_cap_is_clipped():
    """Off-policy, A > 0, r > C: the clip already binds at 1 + eps_high; value -(1 + eps_high)*A, gradient 0."""
    out, lp = run([3.0], [1.0], off=[1.0])
    # w = 2: unclipped 2, clipped 1.28 -> min 1.28, pg -1.28
    assert out.loss.item() == pytest.approx(-1.28)
    assert lp.grad.tolist() == [0.0]


def test_masked_token_contributes_nothing_even_with_garbage_inputs():
    """A token with mask 0 changes neither the loss nor any gradient, and gets gradient 0, even if inf/nan."""
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.5))
    b = torch.tensor([-1.0, -1.0, float("-inf"), 0.0], dtype=torch.float64)
    lp = torch.tensor([-0.9, -1.2, 50.0, float("nan")], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, float("inf"), -3.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, float("nan"), 1e30], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    off = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    out = policy_loss(lp, b, ref, adv, mask, off, 4.0, cfg)
    out.loss.backward()

    lp2 = lp.detach()[:2].clone().requires_grad_(True)
    ref2 = policy_loss(lp2, b[:2], ref[:2], adv[:2], mask[:2], off[:2], 4.0, cfg)
    ref2.loss.backward()
    assert out.loss.item() == ref2.loss.item()
    assert lp.grad[:2].tolist() == lp2.grad.tolist()
    assert lp.grad[2:].tolist() == [0.0, 0.0]
    assert (out.tokens, out.on_policy_tokens) == (2, 1)
    assert all(math.isfinite(v) for v in (out.pg_loss, out.kl, out.mean_ratio))


def test_kl_k3_value_and_gradient():
    """kl = exp(ref - lp) - (ref - lp) - 1, added as beta * kl / norm; d kl / d lp = 1 - exp(ref - lp)."""
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.5))
    # A = 0 so the surrogate contributes neither value nor gradient; r = 1.
    lp = torch.tensor([-1.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.5, -1.5], dtype=torch.float64)
    zeros, ones = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    out = policy_loss(lp, lp.detach(), ref, zeros, ones, zeros, 2.0, cfg)
    out.loss.backward()
    # t0: d = ref - lp = 0.5: kl = e^0.5 - 0.5 - 1 = 1.6487212707 - 1.5 = 0.1487212707; dkl = 1 - e^0.5 = -0.6487212707
    # t1: d = -0.5:           kl = e^-0.5 + 0.5 - 1 = 0.6065306597 - 0.5 = 0.1065306597; dkl = 1 - e^-0.5 = 0.3934693403
    kl0, kl1 = 0.1487212707, 0.1065306597
    assert out.loss.item() == pytest.approx(0.5 * (kl0 + kl1) / 2.0)  # = 0.0638129826
    assert lp.grad.tolist() == pytest.approx([0.5 * -0.6487212707 / 2.0, 0.5 * 0.3934693403 / 2.0])
    assert out.kl == pytest.approx((kl0 + kl1) / 2)  # mean per trained token
    assert out.pg_loss == 0.0


def test_k3_is_non_negative_and_unbiased_for_kl():
    """k3 >= 0 per token, and its expectation under pi is exactly KL(pi || ref) (checked on a categorical)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64) * 2, 0)
    logref = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64) * 2, 0)
    # With A = 0 and norm = 1 and beta = 1 the per-token loss is exactly k3: weight each token by pi(x).
    ks = []
    for i in range(50):
        o = policy_loss(
            logp[i : i + 1],
            logp[i : i + 1],
            logref[i : i + 1],
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1),
            torch.zeros(1),
            1.0,
            PLAIN.model_copy(update=dict(kl_coef=1.0)),
        )
        ks.append(o.loss.item())
    ks = torch.tensor(ks, dtype=torch.float64)
    assert (ks >= 0).all()
    expected = (logp.exp() * (logp - logref)).sum()
    assert (logp.exp() * ks).sum().item() == pytest.approx(expected.item(), rel=1e-10)


def test_normalisation_by_constant():
    """loss = token sum / norm: doubling norm halves it, masked tokens leave it unchanged, and it is a sum
    (two identical tokens give twice one token's loss), not a mean over tokens or sequences."""
    one, _ = run([1.1], [2.0])
    two, _ = run([1.1, 1.1], [2.0, 2.0])
    half, _ = run([1.1], [2.0], norm=2.0)
    padded, lp = run([1.1, 1.7, 0.3], [2.0, 5.0, -3.0], mask=[1.0, 0.0, 0.0])
    # one = -2.2; two = -4.4; half = -1.1; padded = -2.2
    assert two.loss.item() == pytest.approx(2 * one.loss.item())
    assert half.loss.item() == pytest.approx(one.loss.item() / 2)
    assert padded.loss.item() == pytest.approx(one.loss.item())
    assert lp.grad.tolist() == pytest.approx([-2.2, 0.0, 0.0])


def test_batch_shape_equals_flat():
    """[B, S] inputs give the same loss, gradient and metrics as the same tokens flattened to [T]."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3 for _ in range(4)]
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    off = torch.rand(3, 5, generator=g) > 0.5
    lp2 = args[0].clone().requires_grad_(True)
    lp1 = args[0].flatten().clone().requires_grad_(True)
    a = policy_loss(lp2, *args[1:], mask, off, 7.0, PLAIN)
    b = policy_loss(lp1, *(x.flatten() for x in args[1:]), mask.flatten(), off.flatten(), 7.0, PLAIN)
    a.loss.backward()
    b.loss.backward()
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-12)
    assert torch.allclose(lp2.grad.flatten(), lp1.grad)
    assert dataclasses.replace(a, loss=None) == dataclasses.replace(b, loss=None)


def test_no_trained_tokens_gives_zero_loss_with_grad_path():
    """With an all-zero mask the loss is 0, backward works (zero gradient) and metrics are 0."""
    out, lp = run([1.5, 0.5], [1.0, -1.0], mask=[0.0, 0.0], cfg=PLAIN)
    assert out.loss.item() == 0.0
    assert lp.grad.tolist() == [0.0, 0.0]
    assert (out.tokens, out.on_policy_tokens, out.kl, out.clip_fraction, out.mean_ratio) == (0, 0, 0.0, 0.0, 0.0)


def test_half_precision_inputs_are_computed_in_float32():
    """bf16 log-probs give a float32 loss equal to computing from the same values in float32, grad in bf16."""
    g = torch.Generator().manual_seed(2)
    vals = [(torch.randn(8, generator=g) * 0.2).bfloat16() for _ in range(4)]
    lp = vals[0].clone().requires_grad_(True)
    out = policy_loss(lp, *vals[1:], torch.ones(8), torch.zeros(8), 8.0, PLAIN)
    ref = policy_loss(vals[0].float(), *(v.float() for v in vals[1:]), torch.ones(8), torch.zeros(8), 8.0, PLAIN)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == ref.loss.item()
    out.loss.backward()
    assert lp.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- gradcheck and reference


def _inputs_away_from_boundaries(seed: int, n: int = 24):
    """Random float64 inputs whose ratios stay >= 0.05 away from 0.8, 1.28 and the cap 2.0."""
    g = torch.Generator().manual_seed(seed)
    bands = torch.tensor([[0.3, 0.75], [0.85, 1.23], [1.33, 1.95], [2.05, 4.0]], dtype=torch.float64)
    pick = bands[torch.randint(0, 4, (n,), generator=g)]
    ratio = pick[:, 0] + (pick[:, 1] - pick[:, 0]) * torch.rand(n, generator=g, dtype=torch.float64)
    b = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    lp = b + ratio.log()
    ref = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).double()
    off = (torch.rand(n, generator=g) > 0.5).double()
    return lp, b, ref, adv, mask, off


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradcheck_float64(seed):
    """The analytic gradient of the loss w.r.t. logprobs matches finite differences (float64, off boundaries)."""
    lp, *rest = _inputs_away_from_boundaries(seed)
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.1))
    lp = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: policy_loss(x, *rest, 13.0, cfg).loss, (lp,), eps=1e-6, atol=1e-8)


def _reference(lp, b, ref, adv, mask, off, norm, cfg):
    """The module docstring's formula, one token at a time in python floats."""
    total = 0.0
    for lp_t, b_t, ref_t, a, m, o in zip(lp, b, ref, adv, mask, off):
        if not m:
            continue
        r = math.exp(lp_t - b_t)
        w = min(r, cfg.is_cap) if o else r
        pg = -min(w * a, min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * a)
        d = ref_t - lp_t
        total += pg + cfg.kl_coef * (math.exp(d) - d - 1)
    return total / norm


@settings(max_examples=60, deadline=None)
@given(
    toks=st.lists(
        st.tuples(st.floats(-2, 2), st.floats(-1, 1), st.floats(-3, 3), st.booleans(), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    norm=st.floats(0.5, 100),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
    is_cap=st.floats(1.0, 4.0),
    kl_coef=st.floats(0.0, 1.0),
)
def test_matches_per_token_reference(toks, norm, eps_low, eps_high, is_cap, kl_coef):
    """On any inputs the loss equals the docstring formula evaluated token by token."""
    cfg = PLAIN.model_copy(update=dict(eps_low=eps_low, eps_high=eps_high, is_cap=is_cap, kl_coef=kl_coef))
    log_r, ref_d, adv, m, o = zip(*toks)
    b = [-1.0] * len(toks)
    lp = [bb + x for bb, x in zip(b, log_r)]
    ref = [x + d for x, d in zip(lp, ref_d)]
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    out = policy_loss(t(lp), t(b), t(ref), t(adv), t([float(x) for x in m]), torch.tensor(o), norm, cfg)
    assert out.loss.item() == pytest.approx(_reference(lp, b, ref, adv, m, o, norm, cfg), rel=1e-9, abs=1e-12)
    assert out.tokens == sum(m)
    assert out.on_policy_tokens == sum(1 for mm, oo in zip(m, o) if mm and not oo)


# ---------------------------------------------------------------- metrics


def test_metrics_on_constructed_example():
    """clip_fraction counts trained tokens where the clip changed the value; is_truncated_fraction counts
    trained off-policy tokens with r > C; on_policy_tokens counts trained tokens with off_policy = 0."""
    out, _ = run(
        [1.5, 5.0, 1.0, 0.5, 3.0, 1.5],
        [1.0, -1.0, 1.0, -1.0, 1.0, 1.0],
        off=[0, 1, 0, 1, 1, 1],
        mask=[1, 1, 1, 1, 1, 0],
        norm=10.0,
    )
    # t0 on,  r 1.5, A +1: clipped (1.28 < 1.5)            pg -1.28
    # t1 off, r 5,   A -1: truncated to 2, unclipped -2    pg  2
    # t2 on,  r 1,   A +1: neither                         pg -1
    # t3 off, r 0.5, A -1: clipped (-0.8 < -0.5)           pg  0.8
    # t4 off, r 3,   A +1: truncated (3 > 2) and clipped   pg -1.28
    # t5 masked (would be clipped): ignored
    assert out.tokens == 5
    assert out.on_policy_tokens == 2
    assert out.clip_fraction == pytest.approx(3 / 5)
    assert out.is_truncated_fraction == pytest.approx(2 / 5)
    assert out.mean_ratio == pytest.approx((1.5 + 5 + 1 + 0.5 + 3) / 5)  # 2.2
    assert out.pg_loss == pytest.approx((-1.28 + 2 - 1 + 0.8 - 1.28) / 10)  # -0.076
    assert out.kl == 0.0
    assert out.loss.item() == pytest.approx(out.pg_loss)
    assert isinstance(out, LossOutput)
    assert all(
        isinstance(getattr(out, f), float)
        for f in ("pg_loss", "kl", "clip_fraction", "is_truncated_fraction", "mean_ratio")
    )
    assert isinstance(out.tokens, int) and isinstance(out.on_policy_tokens, int)


def test_zero_advantage_is_never_clipped():
    """A = 0 gives pg = 0 with zero gradient and does not count as clipped (the clip changed nothing)."""
    out, lp = run([1.5, 0.5], [0.0, 0.0])
    assert out.loss.item() == 0.0 and lp.grad.tolist() == [0.0, 0.0]
    assert out.clip_fraction == 0.0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value",
    [
        ("eps_low", 0.0),
        ("eps_low", 1.0),
        ("eps_low", -0.1),
        ("eps_high", 0.0),
        ("eps_high", float("inf")),
        ("is_cap", 0.5),
        ("is_cap", float("nan")),
        ("kl_coef", -0.01),
        ("kl_coef", True),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    """Each invalid loss setting raises ValueError whose message names the field."""
    with pytest.raises(ValueError, match=field):
        LossSettings(**{field: value})


def test_config_defaults_and_frozen():
    """Defaults are eps_low 0.2, eps_high 0.28, is_cap 2.0, kl_coef 0.01; the config is immutable."""
    cfg = LossSettings()
    assert (cfg.eps_low, cfg.eps_high, cfg.is_cap, cfg.kl_coef) == (0.2, 0.28, 2.0, 0.01)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.is_cap = 3.0  # type: ignore[misc]


def test_bad_inputs_raise():
    """Shape mismatches, non-binary masks and a non-positive norm are ValueErrors, not silent broadcasts."""
    x = torch.zeros(4, dtype=torch.float64)
    ones = torch.ones(4)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, torch.zeros(2, 2), ones, ones, 1.0)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(x, x, x, x, torch.full((4,), 0.5), ones, 1.0)
    with pytest.raises(ValueError, match="off_policy"):
        policy_loss(x, x, x, x, ones, torch.ones(1, 4), 1.0)
    for norm in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="norm"):
            policy_loss(x, x, x, x, ones, ones, norm)


# ---------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_equals_naive(dtype):
    """token_logprobs(logits, targets) == log(softmax(logits)) gathered at targets, shape [B, S]."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=g, dtype=dtype) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    naive = torch.softmax(logits, -1).log().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = token_logprobs(logits, targets)
    assert got.shape == (2, 5) and got.dtype == dtype
    assert torch.allclose(got, naive, atol=1e-6 if dtype == torch.float32 else 1e-12)


def test_token_logprobs_is_stable_and_differentiable():
    """Logits whose exp over/underflows float32 give finite log-probs equal to float64 log_softmax
    (the naive softmax -> log gives -inf there), and the gradient w.r.t. logits is onehot(target) - softmax."""
    logits = torch.tensor([[[1000.0, 0.0, -1000.0], [120.0, 118.0, -3e4]]], requires_grad=True)
    targets = torch.tensor([[1, 1]])
    got = token_logprobs(logits, targets)
    want = torch.log_softmax(logits.detach().double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    naive = torch.softmax(logits.detach(), -1).log().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.isinf(naive[0, 0])  # softmax underflows to 0 at -1000
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, atol=1e-4)  # [-1000, -2 - log(1 + e^-2) = -2.126928]
    got.sum().backward()
    expect = torch.nn.functional.one_hot(targets, 3).float() - torch.softmax(logits.detach(), -1)
    assert torch.allclose(logits.grad, expect, atol=1e-6)


def test_token_logprobs_bf16_upcasts():
    """bf16 logits give float32 log-probs equal to computing from the same logits upcast to float32."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 4, 50, generator=g) * 4).bfloat16()
    targets = torch.randint(0, 50, (3, 4), generator=g)
    got = token_logprobs(logits, targets)
    assert got.dtype == torch.float32
    assert torch.allclose(got, token_logprobs(logits.float(), targets), atol=1e-6)


def test_token_logprobs_rejects_mismatched_shapes():
    """logits must be targets.shape + (vocab,) and targets integer."""
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3))


# --------------------------------------------------------------------------- the full KL estimator


def _exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    p = torch.distributions.Categorical(logits=logits)
    return torch.distributions.kl_divergence(p, torch.distributions.Categorical(logits=ref_logits))


def test_full_kl_is_the_exact_kl_with_its_gradient():
    """trainer.model's vocab_parallel_log_softmax and full_kl (tp = 1) give torch's log-softmax and the exact
    KL(pi || ref) per position, and the same gradient as torch.distributions' KL; the reference gets none."""
    from trainer.model import full_kl, vocab_parallel_log_softmax

    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 5, 11, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = (3 * torch.randn(2, 5, 11, generator=g, dtype=torch.float64)).requires_grad_(True)
    lsm = vocab_parallel_log_softmax(logits)
    torch.testing.assert_close(lsm, torch.log_softmax(logits, -1), rtol=0, atol=1e-12)
    kl = full_kl(lsm, vocab_parallel_log_softmax(ref))
    want = _exact_kl(logits, ref.detach())
    torch.testing.assert_close(kl, want, rtol=1e-10, atol=1e-12)
    assert bool((kl > 0).all())
    (grad,) = torch.autograd.grad(kl.sum(), logits, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    kl.sum().backward()
    assert ref.grad is None  # the reference is data
    # identical distributions: 0; bf16 logits are computed in float32
    same = full_kl(vocab_parallel_log_softmax(ref.detach()), vocab_parallel_log_softmax(ref.detach()))
    assert float(same.abs().max()) < 1e-12
    assert vocab_parallel_log_softmax(ref.detach().bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="differ"):
        full_kl(lsm, lsm[..., :5])


def test_full_kl_sees_mass_moved_onto_rare_tokens_where_k3_sees_nothing():
    """The case k3 misses: the sampled token keeps its probability while the policy moves mass onto a token the
    reference almost never emits (a malformed tool name). k3 on the sampled token is 0 with no gradient; the full
    KL is the exact divergence and its gradient lowers the rare token's logit."""
    from trainer.model import full_kl

    ref_p = torch.tensor([0.5, 0.499, 0.001], dtype=torch.float64)
    pol_p = torch.tensor([0.5, 0.400, 0.100], dtype=torch.float64)
    logits = pol_p.log().clone().requires_grad_(True)
    lsm = torch.log_softmax(logits, -1)
    sampled = 0
    n = torch.ones(1, dtype=torch.float64)

    def loss(cfg: LossSettings, full: torch.Tensor | None) -> LossOutput:
        lp = lsm[sampled].reshape(1)
        zeros = torch.zeros(1, dtype=torch.float64)
        return policy_loss(lp, lp.detach(), ref_p[sampled].log().reshape(1), zeros, n, zeros, 1.0, cfg, full_kl=full)

    k3 = loss(PLAIN.model_copy(update=dict(kl_coef=1.0)), None)
    assert k3.kl == pytest.approx(0.0, abs=1e-15)
    (g_k3,) = torch.autograd.grad(k3.loss, logits, retain_graph=True)
    assert float(g_k3.abs().max()) < 1e-12
    exact = float((pol_p * (pol_p / ref_p).log()).sum())  # 0.1 * ln 100 + 0.4 * ln(0.4 / 0.499) ~ 0.372
    full = loss(PLAIN.model_copy(update=dict(kl_coef=1.0, kl_estimator="full")), full_kl(lsm, ref_p.log()).reshape(1))
    assert full.kl == pytest.approx(exact, rel=1e-12)
    assert float(full.loss.detach()) == pytest.approx(exact, rel=1e-12)  # zero advantage: the KL term alone
    (g_full,) = torch.autograd.grad(full.loss, logits)
    assert float(g_full[2]) > 0.1  # descent lowers the rare token's logit


def test_policy_loss_with_the_full_estimator():
    """kl_estimator = "full": the KL term is beta * sum of the masked, clamped full_kl / norm; the policy-gradient
    term and its metrics are unchanged; a masked position's full_kl (even nan) is never read; full_kl is required
    and must have the shape of logprobs."""
    g = torch.Generator().manual_seed(9)
    n = 8
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) - 0.1).requires_grad_(True)
    b = lp.detach() + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.float64)
    off = torch.zeros(n, dtype=torch.float64)
    full = torch.rand(n, generator=g, dtype=torch.float64) * 2
    full[2] = 15.0  # above the clamp K = 10
    full[3] = float("nan")  # masked
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.5, k3_clamp=10.0, kl_estimator="full"))
    out = policy_loss(lp, b, lp.detach(), adv, mask, off, 4.0, cfg, full_kl=full)
    no_kl = policy_loss(lp, b, lp.detach(), adv, mask, off, 4.0, cfg.model_copy(update=dict(kl_coef=0.0)), full_kl=full)
    kept = torch.where(mask.bool(), full.clamp(max=10.0), torch.zeros_like(full))
    assert math.isfinite(float(out.loss.detach()))
    assert out.kl == pytest.approx(float(kept.sum()) / 6, rel=1e-12)
    assert float(out.loss.detach()) == pytest.approx(
        float(no_kl.loss.detach()) + 0.5 * float(kept.sum()) / 4.0, rel=1e-12
    )
    assert (out.pg_loss, out.clip_fraction) == (no_kl.pg_loss, no_kl.clip_fraction)
    with pytest.raises(ValueError, match="needs full_kl"):
        policy_loss(lp, b, lp.detach(), adv, mask, off, 4.0, cfg)
    with pytest.raises(ValueError, match="needs full_kl"):
        policy_loss(lp, b, lp.detach(), adv, mask, off, 4.0, cfg, full_kl=full[:4])
    with pytest.raises(ValueError, match="kl_estimator"):
        LossSettings(kl_estimator="k2")
