"""Numerically safe training (issue 11, points 2 and 3): the loss guards of trainer.loss (log-ratio clamp,
dual-clip, k3 clamp, per-sequence ratio guard), gradient-norm clipping and the training-inference mismatch
measured per step by the trainer.

Contracts pinned here:
- an outlier token (a ratio of e^25 on- or off-policy, an extreme reference log-prob) leaves the loss and
  its gradient finite and within the analytic bound of the module docstring: per token
  |pg_t|, |d pg_t / d lp_t| <= max(1 + eps_high, c) |A_t|, 0 <= kl_t <= K, |d kl_t / d lp_t| <= max(1, K + x_K);
- with no token beyond a guard's threshold the guarded loss and gradient are bit-identical to the plain one;
- nan or inf on untrained positions (mask 0) never reaches the loss, its gradient or a metric;
- the sequence guard masks, or truncates, exactly the sequences whose geometric-mean ratio leaves the band;
- the trainer records the pre-clip gradient norm and clips the gradient it steps with to ``grad_clip``, and
  records the mismatch of the micro-batches it trained (token-weighted mean k3, max of maxima).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtrl.errors import ConfigError
from rtrl.sections.trainer import LossSettings
from rtrl.settings import load_settings
from trainer.loss import GUARDED, PLAIN, policy_loss

PLAIN = PLAIN  # every guard off: the formula as it was before the guards
F64 = torch.float64


def k3_root(k: float) -> float:
    """x_K > 0 with exp(x) - x - 1 = K (bisection): where the k3 clamp starts to bind for ref > lp."""
    lo, hi = 0.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp(mid) - mid - 1 < k else (lo, mid)
    return lo


def bounds(cfg: LossSettings) -> tuple[float, float, float]:
    """(per |A| bound on |pg_t| and its gradient, bound on kl_t, bound on |d kl_t / d lp|) of the docstring."""
    return max(1 + cfg.eps_high, cfg.dual_clip), cfg.k3_clamp, max(1.0, cfg.k3_clamp + k3_root(cfg.k3_clamp))


def loss_and_grad(lp, b, ref, adv, mask, off, norm=8.0, cfg=GUARDED, seq=None):
    lp = lp.detach().clone().requires_grad_(True)
    out = policy_loss(lp, b, ref, adv, mask, off, norm, cfg, seq)
    out.loss.backward()
    return out, lp.grad


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------- outliers are bounded


def test_on_policy_outlier_with_negative_advantage_is_dual_clipped():
    """Ratio e^25, on-policy, A = -1.5: without guards the gradient is e^25 * 1.5 ~ 1e11; with them the
    token's value is the dual-clip bound -c*A = 4.5 and its gradient 0; the other tokens are unchanged."""
    b = t([-3.0, -2.0, -2.0])
    lp = t([22.0, -2.1, -1.9])  # lp - b = 25 for the outlier
    adv = t([-1.5, 0.7, -0.4])
    ones, zeros = torch.ones(3, dtype=F64), torch.zeros(3, dtype=F64)
    plain, g_plain = loss_and_grad(lp, b, lp, adv, ones, zeros, cfg=PLAIN)
    assert abs(g_plain[0].item()) > 1e10  # the problem the guards solve: e^25 * 1.5 / 8 = 1.35e10
    out, g = loss_and_grad(lp, b, lp, adv, ones, zeros)
    assert math.isfinite(out.loss.item()) and torch.isfinite(g).all()
    rest, g_rest = loss_and_grad(lp[1:], b[1:], lp[1:], adv[1:], ones[1:], zeros[1:])
    assert out.loss.item() == pytest.approx((3.0 * 1.5 + rest.loss.item() * 8.0) / 8.0, rel=1e-12)
    assert g[0].item() == 0.0 and torch.equal(g[1:], g_rest)
    assert out.dual_clip_fraction == pytest.approx(1 / 3)
    assert out.mismatch_max_abs_log_ratio == pytest.approx(25.0)


@pytest.mark.parametrize("adv", [-2.0, 2.0])
@pytest.mark.parametrize("log_ratio", [25.0, -25.0, 200.0, -1000.0])
def test_off_policy_and_on_policy_extreme_ratios_stay_within_the_bound(adv, log_ratio):
    """Any sign of A, on- or off-policy, ratios from e^-1000 to e^200 (float32: exp overflows beyond 88):
    the loss and the gradient are finite and within max(1 + eps_high, c) * |A| / norm."""
    per_a, _, _ = bounds(GUARDED)
    for off in (0.0, 1.0):
        lp = t([0.0], torch.float32)
        b = lp - log_ratio
        out, g = loss_and_grad(lp, b, lp, t([adv], torch.float32), t([1.0]), t([off]), norm=1.0)
        assert math.isfinite(out.loss.item()) and torch.isfinite(g).all()
        assert abs(out.loss.item()) <= per_a * abs(adv) * (1 + 1e-6)
        assert abs(g.item()) <= per_a * abs(adv) * (1 + 1e-6)
        assert math.isfinite(out.mismatch_k3) and math.isfinite(out.mean_ratio)


@pytest.mark.parametrize("ref_minus_lp", [30.0, 100.0, 1e4, -1e4])
def test_extreme_reference_logprob_is_k3_clamped(ref_minus_lp):
    """The reference model is e^100 more (or less) confident than the policy: without guards float32 k3
    overflows to inf (or is ~1e4); with them kl_t = K = 10 and its gradient is 0."""
    lp = t([-5.0], torch.float32)
    ref = lp + ref_minus_lp
    one, zero = t([1.0]), t([0.0])
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.5, log_ratio_clamp=20.0, dual_clip=3.0, k3_clamp=10.0))
    out, g = loss_and_grad(lp, lp, ref, zero.float(), one, zero, norm=1.0, cfg=cfg)
    assert out.loss.item() == pytest.approx(0.5 * 10.0) and out.kl == pytest.approx(10.0)
    assert g.item() == 0.0
    if ref_minus_lp >= 100:
        plain, _ = loss_and_grad(
            lp, lp, ref, zero.float(), one, zero, norm=1.0, cfg=PLAIN.model_copy(update=dict(kl_coef=0.5))
        )
        assert not math.isfinite(plain.loss.item())


def test_k3_clamp_gradient_below_the_clamp_is_within_the_bound():
    """Just inside the clamp (kl_t slightly below K) the KL gradient is at most K + x_K (~12.6 for K = 10)."""
    x_k = k3_root(10.0)
    lp = t([-5.0])
    ref = lp + (x_k - 1e-6)
    cfg = PLAIN.model_copy(update=dict(kl_coef=1.0, log_ratio_clamp=20.0, k3_clamp=10.0))
    out, g = loss_and_grad(lp, lp, ref, t([0.0]), t([1.0]), t([0.0]), norm=1.0, cfg=cfg)
    _, _, dkl = bounds(cfg)
    assert out.kl < 10.0 and 12.0 < abs(g.item()) <= dkl


@settings(max_examples=80, deadline=None)
@given(
    toks=st.lists(
        st.tuples(
            st.floats(-300, 300),  # lp - b
            st.floats(-300, 300),  # ref - lp
            st.floats(-5, 5),  # A
            st.booleans(),  # off-policy
            st.booleans(),  # trained
        ),
        min_size=1,
        max_size=16,
    ),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_any_inputs_give_a_finite_loss_and_gradient_within_the_bound(toks, dtype):
    """Whatever lp, b and ref are, per token |d loss / d lp_t| <= (a |A_t| + beta * g_kl) / norm and
    |loss| <= sum_t (a |A_t| + beta * K) / norm, with a = max(1 + eps_high, c) and g_kl = max(1, K + x_K)."""
    d, x, adv, off, mask = (list(v) for v in zip(*toks))
    lp = t([-2.0] * len(toks), dtype)
    b, ref = lp - t(d, dtype), lp + t(x, dtype)
    a = t(adv, dtype)
    norm = 4.0
    out, g = loss_and_grad(lp, b, ref, a, t([float(m) for m in mask]), torch.tensor(off), norm=norm)
    per_a, k, dkl = bounds(GUARDED)
    beta = GUARDED.kl_coef
    m = torch.tensor(mask, dtype=torch.bool)
    assert math.isfinite(out.loss.item()) and torch.isfinite(g).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    limit = torch.where(m, (per_a * a.abs().double() + beta * dkl) / norm, torch.zeros((), dtype=F64))
    assert bool((g.abs().double() <= limit * (1 + tol) + tol).all())
    total = float(((per_a * a.abs().double() + beta * k) * m).sum()) / norm
    assert abs(out.loss.item()) <= total * (1 + tol) + tol


# ---------------------------------------------------------------- no outliers: bit-identical to the plain loss


def _normal_inputs(seed: int, shape=(4, 24), dtype=F64):
    """Typical training inputs: ratios within e^+-0.6 (both clip branches bind for some tokens, dual-clip
    at 3 and the clamps never), reference within +-1 nat, mixed on/off-policy, padding."""
    g = torch.Generator().manual_seed(seed)
    b = -torch.rand(shape, generator=g, dtype=F64) * 4
    lp = b + (torch.rand(shape, generator=g, dtype=F64) - 0.5) * 1.2
    ref = lp + (torch.rand(shape, generator=g, dtype=F64) - 0.5) * 2
    adv = torch.randn(shape, generator=g, dtype=F64)
    mask = (torch.rand(shape, generator=g) > 0.25).to(F64)
    off = torch.rand(shape, generator=g) > 0.6
    seq = torch.arange(shape[0])[:, None].expand(shape) * 3 + torch.arange(shape[1]) // 8  # 3 sequences a row
    return [v.to(dtype) for v in (lp, b, ref, adv)] + [mask, off, seq]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_guards_change_nothing_without_outliers(seed, dtype):
    """GUARDED (the trainer's default), and GUARDED plus a sequence guard whose band holds every sequence,
    give bit-identical loss, gradient and metrics to the plain loss on typical inputs."""
    lp, b, ref, adv, mask, off, seq = _normal_inputs(seed, dtype=dtype)
    plain, g_plain = loss_and_grad(lp, b, ref, adv, mask, off, 96.0, PLAIN)
    wide = {"seq_ratio_low": 0.1, "seq_ratio_high": 10.0}
    for cfg in (
        GUARDED,
        PLAIN.model_copy(
            update=dict(log_ratio_clamp=20.0, dual_clip=3.0, k3_clamp=10.0, seq_ratio_guard="mask", **wide)
        ),
        PLAIN.model_copy(
            update=dict(log_ratio_clamp=20.0, dual_clip=3.0, k3_clamp=10.0, seq_ratio_guard="truncate", **wide)
        ),
    ):
        out, g = loss_and_grad(lp, b, ref, adv, mask, off, 96.0, cfg, seq)
        assert torch.equal(out.loss, plain.loss), cfg
        assert torch.equal(g, g_plain), cfg
        assert (out.pg_loss, out.kl, out.clip_fraction, out.tokens) == (
            plain.pg_loss,
            plain.kl,
            plain.clip_fraction,
            plain.tokens,
        )
        assert out.dual_clip_fraction == 0.0 and out.seq_guarded_tokens == 0
    assert 0 < plain.clip_fraction < 1  # the inputs do reach the clip branches


def test_dual_clip_never_binds_within_its_ratio():
    """Dual-clip at c = 3 binds only where r > 3 with A < 0: r up to 2.99 (inside and beyond the clip
    range, on- and off-policy) gives exactly the plain loss and gradient."""
    ratios = t([0.5, 0.9, 1.2, 1.5, 2.0, 2.99] * 2)
    b = torch.full_like(ratios, -2.0)
    lp = b + ratios.log()
    adv = torch.full_like(ratios, -1.3)
    off = t([0.0] * 6 + [1.0] * 6)
    ones = torch.ones_like(ratios)
    plain, g_plain = loss_and_grad(lp, b, lp, adv, ones, off, 1.0, PLAIN)
    out, g = loss_and_grad(lp, b, lp, adv, ones, off, 1.0, GUARDED)
    assert torch.equal(out.loss, plain.loss) and torch.equal(g, g_plain) and out.dual_clip_fraction == 0.0


# ---------------------------------------------------------------- nan / inf on untrained positions


@pytest.mark.parametrize("guard", ["off", "mask", "truncate"])
def test_nan_and_inf_in_padding_never_reach_the_loss(guard):
    """Untrained positions holding nan/inf in lp, b, ref and A: the loss, gradient and metrics equal the
    computation without them, and their own gradient is exactly 0."""
    cfg = PLAIN.model_copy(
        update=dict(log_ratio_clamp=20.0, dual_clip=3.0, k3_clamp=10.0, kl_coef=0.3, seq_ratio_guard=guard)
    )
    nan, inf = float("nan"), float("inf")
    lp = t([-1.0, -0.7, nan, inf, -inf, -2.0])
    b = t([-1.1, -0.9, nan, -inf, inf, nan])
    ref = t([-1.2, -0.6, inf, nan, -inf, inf])
    adv = t([0.5, -1.0, nan, inf, -inf, nan])
    mask = t([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    off = t([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    seq = torch.tensor([0, 0, 0, 1, 1, -1])
    out, g = loss_and_grad(lp, b, ref, adv, mask, off, 2.0, cfg, seq)
    clean, g_clean = loss_and_grad(lp[:2], b[:2], ref[:2], adv[:2], mask[:2], off[:2], 2.0, cfg, seq[:2])
    assert torch.equal(out.loss, clean.loss) and torch.isfinite(out.loss)
    assert torch.equal(g[:2], g_clean) and g[2:].tolist() == [0.0] * 4
    for f in ("pg_loss", "kl", "mean_ratio", "mismatch_k3", "mismatch_max_abs_log_ratio"):
        assert getattr(out, f) == getattr(clean, f) and math.isfinite(getattr(out, f)), f


# ---------------------------------------------------------------- per-sequence ratio guard


def _sequences():
    """Four sequences of three trained tokens with geometric-mean ratios 1, 3, 0.3 and 1.5 (band [0.5, 2]);
    sequence 0 also has an untrained token with a ratio of e^10 that must not count."""
    logs = {0: [0.2, -0.1, -0.1], 1: [math.log(3)] * 3, 2: [math.log(0.3) - 0.1, math.log(0.3), math.log(0.3) + 0.1]}
    logs[3] = [math.log(1.5)] * 3
    d = [x for s in range(4) for x in logs[s]] + [10.0]
    seq = torch.tensor([s for s in range(4) for _ in range(3)] + [0])
    b = torch.full((13,), -2.0, dtype=F64)
    lp = b + t(d)
    adv = t([0.5, -0.3, 0.8, 1.0, -0.4, 0.2, -0.6, 0.9, 0.3, 0.7, -0.2, -0.5, 1.0])
    mask = t([1.0] * 12 + [0.0])
    off = torch.zeros(13, dtype=torch.bool)
    ref = lp + 0.1
    return lp, b, ref, adv, mask, off, seq


def test_sequence_guard_mask_drops_exactly_the_sequences_outside_the_band():
    """mask: sequences 1 (g = 3 > 2) and 2 (g = 0.3 < 0.5) leave the loss and the metrics; the result
    equals the plain loss with their tokens' mask set to 0."""
    lp, b, ref, adv, mask, off, seq = _sequences()
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.1, seq_ratio_guard="mask", seq_ratio_low=0.5, seq_ratio_high=2.0))
    out, g = loss_and_grad(lp, b, ref, adv, mask, off, 5.0, cfg, seq)
    kept = mask * ((seq != 1) & (seq != 2))
    want, g_want = loss_and_grad(lp, b, ref, adv, kept, off, 5.0, PLAIN.model_copy(update=dict(kl_coef=0.1)))
    assert torch.equal(out.loss, want.loss) and torch.equal(g, g_want)
    assert out.tokens == 6 and out.seq_guarded_tokens == 6
    assert g[3:9].tolist() == [0.0] * 6 and (g[:3] != 0).all()
    # the mismatch is measured on everything sent for training, before the guard
    assert out.mismatch_tokens == 12


def test_sequence_guard_truncate_caps_exactly_the_sequences_above_the_band():
    """truncate: sequence 1 (g = 3) has its policy-gradient terms scaled by 2/3 (the KL term untouched);
    sequence 2 (g = 0.3, below the band) and the sequences inside are unchanged."""
    lp, b, ref, adv, mask, off, seq = _sequences()
    cfg = PLAIN.model_copy(update=dict(kl_coef=0.1, seq_ratio_guard="truncate", seq_ratio_low=0.5, seq_ratio_high=2.0))
    out, g = loss_and_grad(lp, b, ref, adv, mask, off, 5.0, cfg, seq)
    # per-token reference, with the plain per-token values
    total, grads = 0.0, []
    for i in range(13):
        if not mask[i]:
            grads.append(0.0)
            continue
        r = math.exp(lp[i].item() - b[i].item())
        a = adv[i].item()
        unclipped, clipped = r * a, min(max(r, 0.8), 1.28) * a
        pg, dpg = (-clipped, 0.0) if clipped < unclipped else (-unclipped, -r * a)
        f = 2.0 / 3.0 if seq[i] == 1 else 1.0
        x = ref[i].item() - lp[i].item()
        total += f * pg + 0.1 * (math.exp(x) - x - 1)
        grads.append((f * dpg + 0.1 * (1 - math.exp(x))) / 5.0)
    assert out.loss.item() == pytest.approx(total / 5.0, rel=1e-12)
    assert g.tolist() == pytest.approx(grads, rel=1e-12, abs=1e-15)
    assert out.seq_guarded_tokens == 3 and out.tokens == 12


def test_sequence_guard_needs_sequence_ids():
    lp, b, ref, adv, mask, off, _ = _sequences()
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(lp, b, ref, adv, mask, off, 1.0, PLAIN.model_copy(update=dict(seq_ratio_guard="mask")))
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(lp, b, ref, adv, mask, off, 1.0, GUARDED, torch.zeros(13))  # float ids


# ---------------------------------------------------------------- mismatch metrics


def test_mismatch_metrics_on_on_policy_tokens():
    """mismatch_k3 = mean over on-policy trained tokens of exp(d) - d - 1 (d = lp - b; the k3 estimator of
    KL(behaviour || trainer) on tokens the behaviour policy sampled); the max is of |d|; off-policy and
    untrained tokens do not count."""
    d = [0.1, -0.3, 2.0, 5.0, 0.0]
    b = torch.full((5,), -1.0, dtype=F64)
    lp = b + t(d)
    off = t([0.0, 0.0, 1.0, 0.0, 0.0])
    mask = t([1.0, 1.0, 1.0, 0.0, 1.0])
    out = policy_loss(lp, b, lp, torch.zeros(5, dtype=F64), mask, off, 1.0, GUARDED)
    on = [0.1, -0.3, 0.0]
    assert out.mismatch_tokens == 3
    assert out.mismatch_k3 == pytest.approx(sum(math.exp(x) - x - 1 for x in on) / 3, rel=1e-12)
    assert out.mismatch_max_abs_log_ratio == pytest.approx(0.3)


# ---------------------------------------------------------------- settings


def test_settings_defaults_are_the_trainers_guards():
    """The `loss` section's defaults are GUARDED, and TrainConfig.from_settings passes every guard on."""
    from rtrl.sections.trainer import TrainConfig

    ls = LossSettings()
    assert (ls.log_ratio_clamp, ls.dual_clip, ls.k3_clamp, ls.seq_ratio_guard) == (20.0, 3.0, 10.0, "off")
    assert TrainConfig.from_settings(load_settings(env={})).loss == GUARDED == TrainConfig().loss
    env = {"RTRL_LOSS__DUAL_CLIP": "4", "RTRL_LOSS__SEQ_RATIO_GUARD": "truncate"}
    env |= {"RTRL_LOSS__SEQ_RATIO_LOW": "0.25", "RTRL_LOSS__SEQ_RATIO_HIGH": "3"}
    loss = TrainConfig.from_settings(load_settings(env=env)).loss
    assert (loss.dual_clip, loss.seq_ratio_guard, loss.seq_ratio_low, loss.seq_ratio_high) == (4.0, "truncate", 0.25, 3)


@pytest.mark.parametrize(
    "key,value", [("dual_clip", 0.5), ("seq_ratio_guard", "drop"), ("seq_ratio_high", 0.9), ("k3_clamp", -1.0)]
)
def test_bad_guard_settings_name_the_setting(key, value):
    with pytest.raises(ConfigError, match=f"loss.{key}"):
        load_settings(env={f"RTRL_LOSS__{key.upper()}": str(value)})


@pytest.mark.parametrize(
    "field,value", [("dual_clip", 1.0), ("log_ratio_clamp", -1.0), ("k3_clamp", float("inf")), ("seq_ratio_low", 0)]
)
def test_bad_guard_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossSettings(**{field: value})


# ---------------------------------------------------------------- the trainer: clipping and metrics end to end


@pytest.fixture(scope="module")
def tiny_trainer():
    """The tiny model on a single-process gloo group in this process, its initial weights and 4 micro-batches."""
    from rtrl.sections.trainer import ModelSettings
    from tests.dist.train_run import synthetic_batches
    from trainer.model import build_model, init_parallel

    cfg = ModelSettings.tiny()
    init_parallel(cfg)
    model, reference = build_model(cfg), build_model(cfg)
    reference.load_state_dict(model.state_dict())
    init = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    return model, reference, init, synthetic_batches(2)


def _one_step(tiny_trainer, grad_clip: float):
    from rtrl.sections.trainer import TrainConfig
    from trainer.factory import Policy
    from trainer.train import MemorySource, train

    model, reference, init, batches = tiny_trainer
    model.load_state_dict(init)
    tc = TrainConfig(
        run_id="safety",
        steps=1,
        micro_batches_per_step=2,
        grad_clip=grad_clip,
        max_policy_lag=1,
        max_delayed_lag=0,
        checkpoint_every=5,
    )
    (step,) = train(Policy(model, reference, version=1), lambda off: MemorySource(batches, off), tc)
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return step, norm


def test_trainer_records_the_pre_clip_norm_and_clips_to_grad_clip(tiny_trainer):
    """One step with clipping off: the recorded grad_norm is the norm of the gradient the optimizer used.
    The same step with grad_clip = that norm / 4: the same pre-clip norm is recorded and the gradient the
    optimizer used has norm grad_clip (<= grad_clip)."""
    free, used = _one_step(tiny_trainer, 0.0)
    assert free.grad_norm == pytest.approx(used, rel=1e-9) and free.grad_norm > 0
    clip = free.grad_norm / 4
    clipped, used_clipped = _one_step(tiny_trainer, clip)
    assert clipped.grad_norm == pytest.approx(free.grad_norm, rel=1e-9)
    assert used_clipped <= clip and used_clipped == pytest.approx(clip, rel=1e-5)
    assert clipped.loss == free.loss  # clipping acts after the loss


def test_trainer_records_the_step_mismatch(tiny_trainer):
    """The step's mismatch equals the micro-batches' own: k3 token-weighted over on-policy tokens, the
    max of their maxima (computed here with the initial weights, which the step's forward passes used)."""
    from trainer.model import forward_logprobs
    from trainer.train import prepare

    model, reference, init, batches = tiny_trainer
    step, _ = _one_step(tiny_trainer, 1.0)
    model.load_state_dict(init)
    k3_sum, tokens, worst = 0.0, 0, 0.0
    with torch.no_grad():
        for batch in batches:
            p = prepare(batch, 1, 1)
            lp = forward_logprobs(model, p.tokens, p.positions, p.targets, p.attention_mask)
            out = policy_loss(lp, p.behaviour, lp, p.advantages, p.loss_mask, p.off_policy, 1.0, GUARDED)
            k3_sum += out.mismatch_k3 * out.mismatch_tokens
            tokens += out.mismatch_tokens
            worst = max(worst, out.mismatch_max_abs_log_ratio)
            on = (p.loss_mask > 0) & ~p.off_policy
            assert out.mismatch_max_abs_log_ratio == pytest.approx(
                float(np.abs((lp - p.behaviour).numpy()[on.numpy()]).max(initial=0.0))
            )
    assert tokens > 0 and step.mismatch_k3 > 0
    assert step.mismatch_k3 == pytest.approx(k3_sum / tokens, rel=1e-9)
    assert step.mismatch_max_abs_log_ratio == pytest.approx(worst, rel=1e-9)


def test_a_kept_optimizer_carries_its_moments_across_train_calls(tiny_trainer):
    """Policy.optimizer (the in-process experiments keep one across cycles): two calls of one step each with
    one kept AdamW end on the same weights as one call of two steps; a new optimizer per call does not (its
    first step is a sign step again). An optimizer over other parameters is refused."""

    from rtrl.sections.trainer import TrainConfig
    from tests.dist.train_run import synthetic_batches
    from trainer.dedup import TrainedSet
    from trainer.factory import Policy, optimizer
    from trainer.train import MemorySource, train

    model, reference, init, _ = tiny_trainer
    batches = synthetic_batches(4)
    tc = TrainConfig(
        run_id="kept", steps=2, micro_batches_per_step=2, max_policy_lag=1, max_delayed_lag=0, checkpoint_every=5
    )

    def run(calls: int, keep: bool) -> dict[str, torch.Tensor]:
        model.load_state_dict(init)
        opt = optimizer(model.parameters(), tc) if keep else None
        per, trained = 2 // calls, TrainedSet()
        for c in range(calls):
            part = batches[c * 2 * per : (c + 1) * 2 * per]
            tcc = TrainConfig(
                run_id="kept",
                steps=per,
                micro_batches_per_step=2,
                max_policy_lag=1,
                max_delayed_lag=0,
                checkpoint_every=5,
            )
            train(
                Policy(model, reference, optimizer=opt, version=1, trained=trained),
                _source(part),
                tcc.model_copy(update=dict(resume=False)),
            )
        return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    once, kept, fresh = run(1, False), run(2, True), run(2, False)
    assert all(torch.allclose(once[k], kept[k], atol=1e-6) for k in once)
    assert any(not torch.allclose(once[k], fresh[k], atol=1e-6) for k in once)
    with pytest.raises(ValueError, match="exactly the parameters"):
        wrong = optimizer(list(model.parameters())[:1], tc)
        train(
            Policy(model, reference, optimizer=wrong, version=1),
            lambda off: MemorySource(batches, off),
            tc.model_copy(update=dict(resume=False)),
        )


def _source(batches):
    """A trainer source over ``batches`` (bound now, not when called)."""
    from trainer.train import MemorySource

    return lambda off: MemorySource(batches, off)
