"""Delayed rewards train, with correction, instead of being dropped (issue 16, point 3).

Contracts pinned here:
- the batch flow joins a rollout of a task kind that awaits the user's verdict with its *final* reward
  (never a provisional one), waiting up to the kind's deadline + allowed lateness; a trajectory is trained
  at most once (never its provisional reward and the verdict's revision as two samples); other kinds join
  revision 0 within ``join_wait_ms`` as before;
- a sample with max_policy_lag < lag <= max_delayed_lag is delayed (marked in ``MicroBatch.delayed``) instead
  of dropped, with an advantage from the delayed samples' own baseline (never the short tasks'); above
  max_delayed_lag, or with max_delayed_lag = 0, it is dropped and counted;
- the loss: a delayed token's importance weight never exceeds ``delayed_is_cap`` for any lp and b; with
  ``delayed_correction = none`` its gradient is plain REINFORCE; without delayed tokens nothing changes, bit for bit;
- the trainer trains delayed samples up to max_delayed_lag and train_metrics splits on-policy, near-on-policy
  and delayed tokens, with the delayed lags;
- ``MicroBatch.delayed`` travels through the Arrow IPC codec; the flow sends it over the real broker.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from bytewax.testing import run_main
from confluent_kafka import Producer
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.batch_flow import batch_config, build_flow
from flows.batching import BatchBuilder, BatchConfig
from rtrl.kafka import producer_config, read_topic
from rtrl.sections.trainer import LossSettings, TrainSettings
from rtrl.settings import load_settings
from schemas.codec import JsonCodec, decode_batch, encode_batch
from schemas.records import MicroBatch, Reward, Rollout
from trainer.batch import Batch
from trainer.dedup import TrainedSet
from trainer.loss import GUARDED, PLAIN, policy_loss
from trainer.train import prepare

T0 = 1_767_225_600_000  # 2026-01-01, ms
HOUR = 3_600_000
F64 = torch.float64


def rollout(tid: str, version: int, kind: str = "background", group: str = "", size: int = 1, at: int = T0) -> Rollout:
    """A completion as the policy server records it: 4 prompt tokens, 6 completion tokens (one tool output)."""
    return Rollout(
        trajectory_id=tid,
        policy_version=version,
        group_id=group or f"g-{tid}",
        group_size=size,
        org_id="acme",
        task_kind=kind,
        prompt_ids=[11, 12, 13, 14],
        completion_ids=[21, 22, 23, 24, 25, 26],
        behaviour_logprobs=[-0.7, -1.2, -0.1, -2.3, -0.4, -0.9],
        loss_mask=[1, 1, 1, 0, 1, 1],
        created_at=at,
    )


def reward(
    tid: str,
    value: float,
    policy: int,
    at: int,
    revision: int = 0,
    provisional: bool = False,
    kind: str = "background",
) -> Reward:
    """A reward as the reward flow emits it: a background task's first one is provisional (check-ins only),
    the verdict's revision is final (``close_reason`` late: it came after the window closed)."""
    return Reward(
        trajectory_id=tid,
        policy_version=policy,
        reward_version="v2",
        revision=revision,
        reward=value,
        components={"total": value},
        flags=[],
        close_reason="late" if revision else "ended",
        org_id="acme",
        arm="control",
        task_kind=kind,
        n_events=12 + revision,
        event_counts={"task_checkin": 2, "task_verdict": 1 if not provisional else 0},
        first_event_ts=at - 2 * HOUR,
        last_event_ts=at,
        emitted_at=at,
        provisional=provisional,
    )


def cfg(train: TrainSettings | None = None, **batching) -> BatchConfig:
    """The settings' builder config (background awaits a verdict: 1 day + 7 days + 60 s), flushed at once unless
    ``batching`` says otherwise."""
    c = batch_config(load_settings(env={}))
    return replace(c, batching=c.batching.model_copy(update={"flush_s": 0.0} | batching), train=train or c.train)


def samples(batches: list[MicroBatch]) -> dict[str, tuple[float, bool]]:
    """(advantage, delayed) of every packed sample, by trajectory id; a sample packed twice fails."""
    out: dict[str, tuple[float, bool]] = {}
    for b in batches:
        for i, sid in enumerate(b.sample_ids):
            assert sid not in out, f"{sid} packed twice"
            row, col = next(
                (r, c) for r, seg in enumerate(b.segment_ids) for c, s in enumerate(seg) if s == i and b.loss_mask[r][c]
            )
            out[sid] = (b.advantages[row][col], bool(b.delayed[i]) if b.delayed else False)
    return out


# ---------------------------------------------------------------- the builder: join


def test_settings_make_the_verdict_wait_and_the_delayed_lag():
    c = batch_config(load_settings(env={}))
    assert c.verdict_wait_ms == (("background", (86_400 + 7 * 86_400 + 60) * 1000),)
    assert c.verdict_wait("background") == 691_260_000 and c.verdict_wait("bugfix") is None
    assert (c.train.max_policy_lag, c.train.max_delayed_lag) == (1, 4)
    s = load_settings(
        env={
            "RTRL_TRAIN__MAX_DELAYED_LAG": "0",
            "RTRL_FLOW__TASK_KINDS": '{"review": {"deadline_s": 600, "awaits_verdict": true}}',
        }
    )
    c = batch_config(s)  # review: its deadline, the flow's lateness (1 day), the join slack
    assert c.verdict_wait_ms == (("review", (600 + 86_400 + 60) * 1000),) and c.train.max_delayed_lag == 0


def test_a_verdict_kind_trains_once_on_its_final_reward_never_the_provisional_one():
    """The provisional reward (revision 0) is skipped and counted; the rollout waits hours, far beyond
    join_wait_ms, for the verdict's revision, which is joined; a later revision is a duplicate. The trajectory
    is packed exactly once, with the final reward."""
    bb = BatchBuilder(cfg(), serving_version=3)
    out = bb.add_rollout(rollout("bg1", 3))
    out += bb.add_reward(reward("bg1", 0.2, 3, T0 + 3 * HOUR, provisional=True))
    out += bb.advance_to(T0 + 20 * HOUR)  # 20 h: ordinary rollouts would be unmatched after 60 s
    assert out == [] and "bg1" in bb.rollouts and bb.counts == {"provisional_reward": 1}
    out += bb.add_reward(reward("bg1", 0.9, 3, T0 + 30 * HOUR, revision=1))
    out += bb.add_reward(reward("bg1", 0.4, 3, T0 + 31 * HOUR, revision=2))  # late events after the verdict
    out += bb.add_reward(reward("bg1", 0.1, 3, T0 + 32 * HOUR, revision=3, provisional=True))
    out += bb.flush()
    assert [b.sample_ids for b in out] == [["bg1"]]
    assert samples(out) == {"bg1": (0.0, False)} and bb.baseline == 0.9  # the final reward is the one trained
    assert +bb.counts == {"provisional_reward": 2, "later_revision_or_duplicate": 1}


def test_a_final_reward_before_its_rollout_and_a_verdict_that_never_comes():
    """The final reward may come first (it waits join_wait_ms for its rollout); a rollout whose verdict never
    comes is unmatched once the kind's horizon (deadline + lateness + join slack) has passed, not before."""
    c = cfg()
    bb = BatchBuilder(c, serving_version=3)
    out = bb.add_reward(reward("bg2", 1.0, 3, T0 + 5 * HOUR, revision=1)) + bb.add_rollout(rollout("bg2", 3))
    assert samples(out) == {"bg2": (0.0, False)}
    bb.add_rollout(rollout("bg3", 3, at=T0 + 5 * HOUR))
    bb.add_reward(reward("bg3", 0.0, 3, T0 + 6 * HOUR, provisional=True))
    bb.advance_to(T0 + 5 * HOUR + (c.verdict_wait("background") or 0))
    assert "bg3" in bb.rollouts
    bb.advance_to(T0 + 5 * HOUR + (c.verdict_wait("background") or 0) + 1)
    assert "bg3" not in bb.rollouts and bb.counts["unmatched_rollout"] == 1


def test_other_kinds_join_revision_zero_within_join_wait_as_before():
    """A kind that awaits no verdict: revision 0 joins even if marked provisional, later revisions never do,
    and a rollout without a reward is unmatched after join_wait_ms."""
    bb = BatchBuilder(cfg(), serving_version=3)
    out = bb.add_rollout(rollout("s1", 3, kind="bugfix"))
    out += bb.add_reward(reward("s1", 0.5, 3, T0 + 1000, provisional=True, kind="bugfix"))
    out += bb.add_reward(reward("s1", 0.9, 3, T0 + 2000, revision=1, kind="bugfix"))
    bb.add_rollout(rollout("s2", 3, kind="bugfix", at=T0 + 2000))
    bb.advance_to(T0 + 2000 + 60_001)
    assert samples(out) == {"s1": (0.0, False)} and bb.baseline == 0.5
    assert bb.counts == {"later_revision_or_duplicate": 1, "unmatched_rollout": 1}


# ---------------------------------------------------------------- the builder: delayed samples


def test_stale_samples_within_max_delayed_lag_are_delayed_with_their_own_baseline():
    """Serving version 6, max_policy_lag 1, max_delayed_lag 4: lags 0 and 1 are normal, 2..4 delayed, 5 dropped.
    Singletons: the normal ones' running mean never sees a delayed reward and the other way round."""
    bb = BatchBuilder(cfg(baseline_alpha=0.5), serving_version=6)
    out: list[MicroBatch] = []
    for tid, version, value in [
        ("n1", 6, 1.0),
        ("d1", 4, -1.0),
        ("n2", 5, 0.0),
        ("d2", 2, 3.0),
        ("x", 1, 9.0),
        ("d3", 3, 0.0),
    ]:
        out += bb.add_rollout(rollout(tid, version, kind="bugfix"))
        out += bb.add_reward(reward(tid, value, version, T0 + 1000, kind="bugfix"))
    got = samples(out + bb.flush())
    # normal: n1 1.0 (baseline 1.0 -> adv 0), n2 0.0 (adv -1, baseline 0.5)
    # delayed: d1 -1 (adv 0, baseline -1), d2 3 (adv 4, baseline 1), d3 0 (adv -1, baseline 0.5)
    assert got == {
        "n1": (0.0, False),
        "n2": (-1.0, False),
        "d1": (0.0, True),
        "d2": (4.0, True),
        "d3": (-1.0, True),
    }
    assert (bb.baseline, bb.delayed_baseline) == (0.5, 0.5)
    assert bb.dropped_lag == {5: 1} and bb.lag_counts == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}


def test_a_delayed_group_is_its_own_baseline_and_a_normal_batch_has_no_flags():
    """Two delayed samples of one prompt: reward minus their mean, the running means untouched. A micro-batch
    without a delayed sample has ``delayed == []`` (the wire format as before)."""
    bb = BatchBuilder(cfg(), serving_version=5)
    out = []
    for tid, value in (("a", 1.0), ("b", 0.0)):
        out += bb.add_rollout(rollout(tid, 2, kind="bugfix", group="gab", size=2))
        out += bb.add_reward(reward(tid, value, 2, T0 + 1000, kind="bugfix"))
    assert samples(out) == {"a": (0.5, True), "b": (-0.5, True)}
    assert bb.delayed_baseline is None and bb.baseline is None and out[0].delayed == [True, True]
    normal = bb.add_rollout(rollout("c", 5, kind="bugfix")) + bb.add_reward(
        reward("c", 1.0, 5, T0 + 2000, kind="bugfix")
    )
    assert normal[0].delayed == []


def test_without_the_delayed_path_stale_samples_are_dropped_as_before():
    bb = BatchBuilder(cfg(TrainSettings(max_delayed_lag=0)), serving_version=5)
    out = bb.add_rollout(rollout("old", 2, kind="bugfix")) + bb.add_reward(reward("old", 1.0, 2, T0, kind="bugfix"))
    assert out + bb.flush() == [] and bb.dropped_lag == {3: 1} and bb.delayed_baseline is None


def test_delayed_flags_travel_through_the_arrow_codec():
    bb = BatchBuilder(cfg(flush_s=HOUR / 1000), serving_version=5)
    for tid, version in (("on", 5), ("late", 3)):
        bb.add_rollout(rollout(tid, version, kind="bugfix"))
        bb.add_reward(reward(tid, 1.0, version, T0, kind="bugfix"))
    (mb,) = bb.flush_ready()
    assert mb.sample_ids == ["on", "late"] and mb.delayed == [False, True]
    back = decode_batch(encode_batch(mb))  # (the float32 columns round behaviour log-probs: compare the flags)
    assert (back.sample_ids, back.delayed) == (["on", "late"], [False, True])
    assert encode_batch(back) == encode_batch(decode_batch(encode_batch(back)))
    fields = {f: getattr(mb, f) for f in mb.__struct_fields__}
    for wrong in ([True], [True, False, True]):
        with pytest.raises(ValueError, match="delayed"):
            MicroBatch(**(fields | {"delayed": wrong}))


# ---------------------------------------------------------------- the loss


def _single(lp: float, b: float, adv: float, config: LossSettings) -> tuple[float, float]:
    """(value weight, gradient weight) of one delayed token: loss = -w*A and d loss / d lp = -w*A with norm 1."""
    x = torch.tensor([lp], dtype=F64, requires_grad=True)
    one = torch.ones(1, dtype=torch.bool)
    out = policy_loss(
        x, torch.tensor([b], dtype=F64), x.detach(), torch.tensor([adv], dtype=F64), one, one, 1.0, config, delayed=one
    )
    out.loss.backward()
    assert x.grad is not None
    return -float(out.loss) / adv, -float(x.grad[0]) / adv


@settings(max_examples=300, deadline=None)
@given(
    lp=st.floats(-60, 0),
    b=st.floats(-60, 0),
    adv=st.floats(-10, 10).filter(lambda a: abs(a) > 1e-3),
    cap=st.floats(1.0, 8.0),
    guarded=st.booleans(),
)
def test_a_delayed_tokens_weight_never_exceeds_the_cap(lp, b, adv, cap, guarded):
    """For any log-probs, behaviour log-probs and advantage, the weight of a delayed token's value and gradient
    is in [0, cap]; with the guards off it is exactly min(exp(lp - b), cap), for either sign of A."""
    config = (GUARDED if guarded else PLAIN).model_copy(update=dict(kl_coef=0.0, delayed_is_cap=cap))
    value_w, grad_w = _single(lp, b, adv, config)
    for w in (value_w, grad_w):
        assert 0.0 <= w <= cap * (1 + 1e-12)
    if not guarded:
        expect = min(np.exp(lp - b), cap)
        assert value_w == pytest.approx(expect, rel=1e-9) and grad_w == pytest.approx(expect, rel=1e-9)


def test_delayed_weight_is_truncated_importance_sampling_and_counted():
    """r = e^2 is capped at D = 1 (value and gradient weight 1, counted truncated); r = e^-2 is kept; the
    gradient does not vanish where the cap binds (no PPO clip on delayed tokens)."""
    config = GUARDED.model_copy(update=dict(kl_coef=0.0))
    assert _single(-1.0, -3.0, 1.0, config) == pytest.approx((1.0, 1.0))
    assert _single(-3.0, -1.0, -2.0, config) == pytest.approx((np.exp(-2), np.exp(-2)))
    lp = torch.tensor([-1.0, -3.0, -1.0], dtype=F64, requires_grad=True)
    on = torch.ones(3, dtype=torch.bool)
    out = policy_loss(
        lp,
        torch.tensor([-3.0, -1.0, -1.0], dtype=F64),
        lp.detach(),
        torch.ones(3, dtype=F64),
        on,
        on,
        1.0,
        config,
        delayed=torch.tensor([1, 1, 0]),
    )
    assert (out.delayed_tokens, out.on_policy_tokens, out.tokens) == (2, 0, 3)
    assert out.delayed_truncated_fraction == pytest.approx(1 / 3) and out.clip_fraction == 0.0


def test_no_correction_is_the_plain_reinforce_gradient():
    """delayed_correction = none: whatever the behaviour log-probs, the loss is -sum(m*A)/norm (+ KL) and its
    gradient that of the REINFORCE surrogate -sum(m*A*lp)/norm."""
    g = torch.Generator().manual_seed(7)
    lp = -torch.rand(4, 9, generator=g, dtype=F64) * 5
    b = lp + torch.randn(4, 9, generator=g, dtype=F64) * 4  # far from the current policy
    adv = torch.randn(4, 9, generator=g, dtype=F64)
    mask = torch.rand(4, 9, generator=g) < 0.7
    config = GUARDED.model_copy(update=dict(kl_coef=0.0, delayed_correction="none", delayed_is_cap=1.0))
    x = lp.clone().requires_grad_(True)
    out = policy_loss(x, b, lp, adv, mask, torch.ones_like(mask), 16.0, config, delayed=torch.ones_like(mask))
    out.loss.backward()
    y = lp.clone().requires_grad_(True)
    (-(torch.where(mask, adv * y, 0.0)).sum() / 16.0).backward()
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-15, atol=0.0)
    assert float(out.loss) == pytest.approx(float(-(adv * mask).sum() / 16.0), rel=1e-12)
    assert (
        out.delayed_truncated_fraction == 0.0
        and out.mean_ratio == pytest.approx(1.0)
        and out.delayed_tokens == int(mask.sum())
    )


def _random_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 16)
    lp = -torch.rand(shape, generator=g, dtype=F64) * 4
    b = lp + torch.randn(shape, generator=g, dtype=F64) * 0.5
    ref = lp + torch.randn(shape, generator=g, dtype=F64) * 0.3
    adv = torch.randn(shape, generator=g, dtype=F64)
    mask = torch.rand(shape, generator=g) < 0.8
    seq = torch.arange(shape[1]).div(4, rounding_mode="floor").expand(shape) + 10 * torch.arange(shape[0])[:, None]
    off = (seq % 2 == 1) | (seq >= 20)  # sequences 1, 3 of row 0 and all of rows 1-2 are off-policy
    return lp, b, ref, adv, mask, off, seq


@pytest.mark.parametrize("guard", ["off", "mask", "truncate"])
@pytest.mark.parametrize("correction", ["truncated_is", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_and_near_policy_tokens_are_unchanged_bit_for_bit(guard, correction, seed):
    """No delayed token (None or all 0): the same loss, gradient and metrics, bit for bit. Some sequences delayed:
    every other token's gradient is still bit-identical."""
    lp, b, ref, adv, mask, off, seq = _random_inputs(seed)
    config = GUARDED.model_copy(update=dict(seq_ratio_guard=guard, delayed_correction=correction))

    def run(delayed):
        x = lp.clone().requires_grad_(True)
        out = policy_loss(x, b, ref, adv, mask, off, 32.0, config, seq, delayed)
        out.loss.backward()
        return out, x.grad

    base, grad = run(None)
    zeros, grad0 = run(torch.zeros_like(mask))
    assert torch.equal(base.loss, zeros.loss) and torch.equal(grad, grad0)
    assert replace(base, loss=zeros.loss) == zeros
    delayed = (seq == 21) | (seq == 13)  # two whole off-policy sequences
    some, grad_some = run(delayed)
    assert torch.equal(grad[~delayed], grad_some[~delayed])
    assert some.delayed_tokens == int((mask & delayed).sum()) > 0
    assert some.on_policy_tokens == base.on_policy_tokens


def test_bad_delayed_settings_are_refused():
    with pytest.raises(ValueError, match="delayed_is_cap"):
        LossSettings(delayed_is_cap=0.5)
    with pytest.raises(ValueError, match="delayed_correction"):
        LossSettings(delayed_correction="clip")
    for key, value in (("delayed_is_cap", 0.9), ("delayed_correction", "ppo")):
        with pytest.raises(ValueError):
            LossSettings(**{key: value})
    with pytest.raises(ValueError, match="delayed"):
        x = torch.zeros(3, dtype=F64)
        policy_loss(x, x, x, x, torch.ones(3), torch.ones(3), 1.0, delayed=torch.tensor([0, 2, 1]))


# ---------------------------------------------------------------- the trainer


def _batch(name: str, versions: list[int], delayed: list[bool] | None, seed: int = 0) -> Batch:
    """2 rows x 33 tokens: samples 0 and 1 share row 0 (tokens 0-15, 16-32), sample 2 fills row 1 up to 24."""
    rng = np.random.default_rng(seed)
    rows, seq = 2, 33
    seg = np.full((rows, seq), -1)
    seg[0, :16], seg[0, 16:], seg[1, :24] = 0, 1, 2
    mask = np.zeros((rows, seq), np.float32)
    mask[0, 5:16], mask[0, 21:33], mask[1, 6:24] = 1, 1, 1  # completions; prompts and padding untrained
    return Batch(
        name,
        rng.integers(0, 256, (rows, seq)),
        mask,
        rng.normal(size=(rows, seq)).astype(np.float32),
        np.full((rows, seq), -5.5, np.float32),
        seg,
        [f"{name}-s{i}" for i in range(3)],
        np.array(versions),
        0,
        0,
        delayed=None if delayed is None else np.array(delayed),
    )


def test_settings_make_the_trainers_delayed_path():
    from rtrl.sections.trainer import TrainConfig

    tc = TrainConfig.from_settings(load_settings(env={}))
    assert (tc.max_policy_lag, tc.max_delayed_lag) == (1, 4)
    assert (tc.loss.delayed_correction, tc.loss.delayed_is_cap) == ("truncated_is", 1.0)
    env = {
        "RTRL_TRAIN__MAX_DELAYED_LAG": "0",
        "RTRL_LOSS__DELAYED_CORRECTION": "none",
        "RTRL_LOSS__DELAYED_IS_CAP": "2",
    }
    tc = TrainConfig.from_settings(load_settings(env=env))
    assert (tc.max_delayed_lag, tc.loss.delayed_correction, tc.loss.delayed_is_cap) == (0, "none", 2.0)


def test_prepare_trains_delayed_samples_up_to_max_delayed_lag():
    """Trainer version 6, max_policy_lag 1, max_delayed_lag 4: a delayed sample of lag 3 is trained (marked for
    the loss); the same lag unflagged stays masked as stale; a delayed sample of lag 5 is masked too, and with
    max_delayed_lag 0 every delayed sample is."""
    b = _batch("p", [6, 3, 3], [False, True, False])
    p = prepare(b, 6, 1, 4)
    trained = p.loss_mask.numpy() > 0
    seg = p.segments.numpy()
    assert trained[seg == 0].any() and trained[seg == 1].any() and not trained[seg == 2].any()
    assert p.delayed is not None and np.array_equal(p.delayed.numpy(), (seg == 1))
    assert p.delayed_lags.tolist() == [3] and p.delayed_input_tokens == int(trained[seg == 1].sum())
    assert p.delayed_lag_sum == 3 * p.delayed_input_tokens and p.stale_tokens == int(b.loss_mask[1].sum())
    for late in (prepare(_batch("q", [6, 1, 6], [False, True, False]), 6, 1, 4), prepare(b, 6, 1, 0)):
        assert late.delayed is None and not (late.loss_mask.numpy()[late.segments.numpy() == 1] > 0).any()
    plain = prepare(replace(b, delayed=None), 6, 1)
    assert np.array_equal(plain.loss_mask.numpy(), np.where(seg == 1, 0, p.loss_mask.numpy()))


def test_dedup_remembers_delayed_samples_within_their_window():
    ts = TrainedSet()
    b = _batch("d", [6, 3, 3], [False, True, False])
    taken = ts.take(b, (5, 6), (2, 6))
    assert taken is not None
    assert ts.step_ids() == (["d"], ["d-s0", "d-s1"])  # s2 (lag 3, not delayed) is stale, not trained
    ts.commit()
    again = ts.take(replace(b, batch_id="d2"), (5, 6), (2, 6))
    assert again is not None and again.sample_ids == ["d-s2"] and again.delayed is not None
    assert again.delayed.tolist() == [False]


@pytest.fixture(scope="module")
def tiny():
    from rtrl.sections.trainer import ModelSettings
    from trainer.model import build_model, init_parallel

    cfg = ModelSettings.tiny()
    init_parallel(cfg)
    model, reference = build_model(cfg), build_model(cfg)
    reference.load_state_dict(model.state_dict())
    init = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    return model, reference, init


@pytest.mark.parametrize("correction", ["truncated_is", "none"])
def test_one_step_on_delayed_samples_splits_train_metrics(tiny, correction):
    """One optimizer step of the tiny CPU Megatron model on two micro-batches with on-policy, near-on-policy,
    delayed (lags 3 and 2), stale and too-late samples: the step's tokens split into the three kinds as
    prepare() marks them, the delayed lags are recorded, only trained samples are listed, the weights move."""
    from rtrl.sections.trainer import TrainConfig
    from trainer.factory import Policy
    from trainer.train import MemorySource, train

    model, reference, init = tiny
    model.load_state_dict(init)
    batches = [
        _batch("m0", [6, 5, 3], [False, False, True], seed=1),  # on, near, delayed lag 3
        _batch("m1", [6, 3, 4], [False, False, True], seed=2),  # on, stale (lag 3 unflagged), delayed lag 2
    ]
    tc = TrainConfig(
        run_id="delayed",
        steps=1,
        micro_batches_per_step=2,
        max_policy_lag=1,
        max_delayed_lag=4,
        loss=GUARDED.model_copy(update=dict(delayed_correction=correction)),
        checkpoint_every=5,
    )
    (step,) = train(Policy(model, reference, version=6), lambda off: MemorySource(batches, off), tc)
    prepared = [prepare(b, 6, 1, 4) for b in batches]
    kinds = {"on": 0, "near": 0, "delayed": 0}
    for p, b in zip(prepared, batches):
        m, seg = p.loss_mask.numpy() > 0, p.segments.numpy()
        for i, lag in enumerate(p.lags.tolist()):
            n = int(m[seg == i].sum())
            kinds["delayed" if b.delayed is not None and b.delayed[i] else "on" if lag == 0 else "near"] += n
    total = sum(kinds.values())
    assert step.tokens == total and step.delayed_tokens == kinds["delayed"] > 0 and kinds["near"] > 0
    assert step.on_policy_fraction == pytest.approx(kinds["on"] / total)
    assert step.near_policy_fraction == pytest.approx(kinds["near"] / total)
    assert step.delayed_fraction == pytest.approx(kinds["delayed"] / total)
    assert step.delayed_lag_histogram == {"2": 1, "3": 1}
    assert step.lag_histogram == {"0": 2, "1": 1, "2": 1, "3": 2}  # every sample, trained or not
    lag3, lag2 = prepared[0].delayed_input_tokens, prepared[1].delayed_input_tokens
    assert step.delayed_mean_lag == pytest.approx((3 * lag3 + 2 * lag2) / (lag3 + lag2))
    assert sorted(step.sample_ids) == ["m0-s0", "m0-s1", "m0-s2", "m1-s0", "m1-s2"]
    assert 0.0 <= step.delayed_truncated_fraction <= 1.0
    if correction == "none":
        assert step.delayed_truncated_fraction == 0.0
    assert np.isfinite(step.loss) and step.grad_norm > 0
    moved = any(not torch.equal(v, init[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))
    assert moved


# ---------------------------------------------------------------- the batch flow on the real broker


def test_batch_flow_sends_delayed_samples_and_trains_a_verdict_once(
    broker, topic_prefix, ch_dsn, ch_client, ch_db, tmp_path
):
    """The flow with the default settings (max_policy_lag 1, max_delayed_lag 4, background awaits a verdict),
    one partition so each cohort's newest rollout is seen first: a bugfix sample of lag 2 and a background
    sample of lag 3 go out delayed, one of lag 5 is dropped; the background trajectory is sent once, with the
    advantage of its final reward; the skipped provisional and the later revision are counted in ClickHouse."""
    rollouts = [
        rollout("f-new", 5, kind="bugfix"),
        rollout("f-late", 3, kind="bugfix"),
        rollout("f-old", 0, kind="bugfix"),
        rollout("bg-new", 5),
        rollout("bg-late", 2),
    ]
    rewards = [
        reward("f-new", 1.0, 5, T0 + 1000, kind="bugfix"),
        reward("f-late", 0.0, 3, T0 + 1000, kind="bugfix"),
        reward("f-old", 1.0, 0, T0 + 1000, kind="bugfix"),
        reward("bg-new", 1.0, 5, T0 + 2 * HOUR),
        reward("bg-late", 0.2, 2, T0 + 3 * HOUR, provisional=True),
        reward("bg-late", 0.9, 2, T0 + 30 * HOUR, revision=1),
        reward("bg-late", 0.5, 2, T0 + 31 * HOUR, revision=2),
    ]
    p = Producer(producer_config(broker.bootstrap))
    for topic, codec, recs in (("rollouts", JsonCodec(Rollout), rollouts), ("rewards", JsonCodec(Reward), rewards)):
        for r in recs:
            p.produce(topic_prefix + topic, key=r.trajectory_id.encode(), value=codec.encode(r), partition=0)
    assert p.flush(30) == 0
    env = {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_BATCHING__TAIL": "false",
        "RTRL_DATA_DIR": str(tmp_path),
    }
    run_main(build_flow(load_settings(env=env)))
    batches = [decode_batch(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "batches")]
    assert samples(batches) == {
        "f-new": (0.0, False),
        "f-late": (0.0, True),  # the first delayed sample of its cohort: its own baseline, not f-new's 1.0
        "bg-new": (0.0, False),
        "bg-late": (0.0, True),
    }
    rows = ch_client.query(f"SELECT cohort, counts, lag_accepted, lag_dropped FROM {ch_db}.batch_stats FINAL")
    stats = {c: ({k: v for k, v in counts.items() if v}, acc, drop) for c, counts, acc, drop in rows.result_rows}
    assert stats["acme/bugfix"] == ({}, {"0": 1, "2": 1}, {"5": 1})
    assert stats["acme/background"] == (
        {"provisional_reward": 1, "later_revision_or_duplicate": 1},
        {"0": 1, "3": 1},
        {},
    )
