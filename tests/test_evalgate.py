"""The eval gate (evalgate): the promotion decision as a pure function of score rows, the eval suite
injected through a Protocol (a user's own benchmark drives the same gate), and the loop's default
suite on the simulator's held-out tasks scoring the same model the same way every time."""

from __future__ import annotations

import dataclasses

import pytest

from evalgate import EVAL_RULES, Decision, EvalSuite, GateRules, decide, run_gate
from monitors.alerts import AlertRule, MismatchRule

EV = {"solve_rate": 0.30, "broken_tool_call_rate": 0.08, "clarify_rate": 0.10, "edit_rate": 0.80}
RULES = GateRules(solve_tolerance=0.02, alpha=None)  # the thresholds alone (the test: "statistical" below)


def _gate(candidate, serving, first, rules=RULES, samples=400) -> Decision:
    return decide(candidate, serving, first, samples, rules)


# ---------------------------------------------------------------- decide(): pure


def test_defaults_are_the_loops_gate():
    r = GateRules()
    assert (r.solve_metric, r.solve_tolerance, r.behaviour, r.compare_with_first, r.alpha) == (
        "solve_rate",
        0.03,
        EVAL_RULES,
        True,
        0.05,
    )
    assert [(a.metric, a.direction, a.threshold, a.floor) for a in EVAL_RULES] == [
        ("broken_tool_call_rate", "increase", 0.25, 0.03),
        ("clarify_rate", "increase", 0.5, 0.05),
        ("edit_rate", "decrease", 0.1, 0.05),
    ]
    assert r.metrics == ("solve_rate", "broken_tool_call_rate", "clarify_rate", "edit_rate")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.solve_tolerance = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="solve_tolerance"):
        GateRules(solve_tolerance=-0.1)
    with pytest.raises(ValueError, match="alpha must be in"):
        GateRules(alpha=1.0)
    assert GateRules(behaviour=list(EVAL_RULES)).behaviour == EVAL_RULES  # a list becomes a tuple (hashable)


def test_promotes_without_regressions():
    d = _gate(EV | {"solve_rate": 0.31}, EV, EV)
    assert d == Decision(True, "solve rate 0.310 (serving 0.300); broken 0.080, clarify 0.100", ())
    # a drop within the tolerance still promotes (today's boundary: strictly below parent - tolerance rejects)
    assert _gate(EV | {"solve_rate": 0.29}, EV, EV).promote
    assert _gate(EV, EV, EV).promote


def test_solve_drop_beyond_tolerance_rejects():
    d = _gate(EV | {"solve_rate": 0.25}, EV, EV)
    assert not d.promote and "solve rate 0.250 < 0.300" in d.reason
    assert d.problems == ("solve rate 0.250 < 0.300 - 0.02",) and d.reason == d.problems[0]
    assert _gate(EV | {"solve_rate": 0.25}, EV, EV, GateRules(solve_tolerance=0.1)).promote


def test_behaviour_alert_against_serving():
    d = _gate(EV | {"broken_tool_call_rate": 0.2}, EV, EV)
    assert not d.promote and "broken_tool_call_rate" in d.reason and "vs serving" in d.reason
    # the same alert fires against the first version too (serving == first here): one problem each
    assert [p.split(":")[0] for p in d.problems] == ["vs serving", "vs first"]
    assert d.reason == "; ".join(d.problems)
    d = _gate(EV | {"clarify_rate": 0.3, "edit_rate": 0.6}, EV, EV)
    assert not d.promote and "clarify_rate" in d.reason and "edit_rate" in d.reason


def test_slow_drift_is_caught_against_the_first_version_only():
    drifted = EV | {"broken_tool_call_rate": 0.15}
    d = _gate(drifted | {"broken_tool_call_rate": 0.16}, drifted, EV)
    assert not d.promote and "vs first" in d.reason and "vs serving" not in d.reason
    assert len(d.problems) == 1 and d.problems[0].startswith("vs first: broken_tool_call_rate rose")


def test_compare_with_first_off_ignores_drift_and_the_first_row():
    drifted = EV | {"broken_tool_call_rate": 0.15}
    no_first = GateRules(solve_tolerance=0.02, compare_with_first=False)
    assert _gate(drifted | {"broken_tool_call_rate": 0.16}, drifted, EV, no_first).promote
    assert _gate(EV, EV, {}, no_first).promote  # the first row is not read at all
    assert not _gate(EV | {"broken_tool_call_rate": 0.2}, EV, {}, no_first).promote


def test_too_few_samples_skip_the_behaviour_rules():
    """Rates from fewer completions than a rule's min_samples are not judged (skipped, not fired)."""
    bad = EV | {"broken_tool_call_rate": 0.5}
    assert not _gate(bad, EV, EV, samples=200).promote
    assert _gate(bad, EV, EV, samples=199).promote
    strict = GateRules(behaviour=(AlertRule("broken_tool_call_rate", "increase", 0.25, min_samples=1000),))
    assert _gate(bad, EV, EV, strict, samples=400).promote


@pytest.mark.parametrize("side", ["candidate", "serving", "first"])
@pytest.mark.parametrize("metric", ["solve_rate", "clarify_rate"])
def test_a_missing_metric_is_a_clear_error(side, metric):
    rows = {"candidate": dict(EV), "serving": dict(EV), "first": dict(EV)}
    del rows[side][metric]
    if side == "first" and metric == "solve_rate":  # the first row is only read for behaviour
        assert _gate(rows["candidate"], rows["serving"], rows["first"]).promote
        return
    with pytest.raises(ValueError, match=f"{side} scores have no '{metric}'"):
        _gate(rows["candidate"], rows["serving"], rows["first"])


# ---------------------------------------------------------------- statistical: a stated error rate


def test_a_move_within_the_noise_is_not_refused_and_a_real_one_is_with_its_p_value():
    stat = GateRules(solve_tolerance=0.02)
    assert _gate(EV | {"solve_rate": 0.25}, EV, EV, stat, samples=400).promote  # p ~ 0.07 before Holm
    d = _gate(EV | {"solve_rate": 0.25}, EV, EV, stat, samples=4000)
    assert not d.promote and d.problems[0].startswith("solve rate 0.250 < 0.300 - 0.02; p = ")
    assert "significant at 0.05, Holm over 4" in d.problems[0]  # solve + 3 rules (first == serving: once)
    d = _gate(EV | {"broken_tool_call_rate": 0.2}, EV, EV, stat)
    # v0 serves (first == serving): one comparison, not two members of Holm's family
    assert [p.split(":")[0] for p in d.problems] == ["vs serving"] and "p = " in d.reason
    drifted = EV | {"broken_tool_call_rate": 0.1}
    d = _gate(EV | {"broken_tool_call_rate": 0.2}, drifted, EV, stat)
    assert [p.split(":")[0] for p in d.problems] == ["vs serving", "vs first"]
    # a move beyond a threshold that is not significant promotes, and the reason says so
    d = _gate(EV | {"broken_tool_call_rate": 0.105}, EV, EV, stat, samples=400)
    assert d.promote and "within noise: vs serving: broken_tool_call_rate rose" in d.reason
    # a fall of a rate whose fall is bad: the test runs on the complement
    assert not _gate(EV | {"edit_rate": 0.6}, EV, EV, stat).promote
    assert _gate(EV | {"edit_rate": 0.7}, EV, EV, stat, samples=100).promote  # beyond 10%, not significant


def test_the_gates_false_refusal_rate_is_at_most_alpha():
    """Candidate, serving and first versions that behave the same (their rates drawn from the same binomials, as
    the suite's 400 sampled completions give them), thresholds at zero: the gate refuses at most alpha of them."""
    import numpy as np

    rng = np.random.default_rng(11)
    rules = GateRules(
        solve_tolerance=0.0,
        behaviour=tuple(dataclasses.replace(r, threshold=1e-9, floor=0.0) for r in EVAL_RULES),
        mismatch=None,
    )
    sims, n = 1000, 400
    refused = 0
    for _ in range(sims):
        rows = [{m: rng.binomial(n, v) / n for m, v in EV.items()} for _ in range(3)]
        refused += not decide(rows[0], rows[1], rows[2], n, rules).promote
    without = GateRules(solve_tolerance=0.0, behaviour=rules.behaviour, mismatch=None, alpha=None)
    naive = sum(
        not decide(*[{m: rng.binomial(n, v) / n for m, v in EV.items()} for _ in range(3)], n, without).promote
        for _ in range(200)
    )
    assert refused / sims <= 0.05 + 3 * (0.05 * 0.95 / sims) ** 0.5
    assert naive / 200 > 0.9  # any move at all refuses without the test


def test_reasons_name_the_metric():
    rules = GateRules(
        solve_metric="pass_at_1",
        solve_tolerance=0.0,
        alpha=None,
        behaviour=(AlertRule("lint_errors", "increase", 0.1, floor=1.0, min_samples=10),),
        summary=(),
    )
    base = {"pass_at_1": 0.5, "lint_errors": 2.0}
    d = decide({"pass_at_1": 0.4, "lint_errors": 4.0}, base, base, 10, rules)
    assert not d.promote
    assert d.problems[0] == "pass at 1 0.400 < 0.500 - 0.0"
    assert all("lint_errors rose 100.0%" in p for p in d.problems[1:]) and len(d.problems) == 3
    assert decide(base, base, base, 10, rules) == Decision(True, "pass at 1 0.500 (serving 0.500)", ())
    with pytest.raises(ValueError, match="'lint_errors'"):
        decide({"pass_at_1": 0.5}, base, base, 10, rules)


# ---------------------------------------------------------------- an injected suite


class FixedSuite:
    """A user's benchmark: fixed scores per (dummy) model, 500 completions behind each rate."""

    name = "fixed"
    samples = 500

    def __init__(self, scores: dict[str, dict[str, float]]):
        self.scores, self.calls = scores, []

    def evaluate(self, model) -> dict[str, float]:
        self.calls.append(model)
        return dict(self.scores[model])


def test_a_user_supplied_suite_drives_the_gate():
    suite = FixedSuite({"good": EV | {"solve_rate": 0.35}, "hacked": EV | {"broken_tool_call_rate": 0.3}})
    assert isinstance(suite, EvalSuite)
    first = serving = EV
    scores, d = run_gate(suite, "good", serving, first, RULES)
    assert scores == EV | {"solve_rate": 0.35} and d.promote
    scores, d = run_gate(suite, "hacked", serving, first, RULES)
    assert scores["broken_tool_call_rate"] == 0.3 and not d.promote and "vs serving: broken_tool_call_rate" in d.reason
    assert suite.calls == ["good", "hacked"]
    # the suite's sample count is what the rules' min_samples see
    few = FixedSuite({"hacked": EV | {"broken_tool_call_rate": 0.3}})
    few.samples = 100
    assert run_gate(few, "hacked", serving, first, RULES)[1].promote
    # default rules when none are given
    assert run_gate(suite, "good", serving, first)[1].promote


# ---------------------------------------------------------------- the loop's default suite


def test_held_out_tasks_score_a_real_model_deterministically():
    import torch

    from rtrl.sections.trainer import ModelSettings
    from simulator.evalsuite import HeldOutTasks
    from simulator.tasks import VOCAB, held_out
    from trainer.model import build_model, init_parallel

    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=32)
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    suite = HeldOutTasks(20, seed=3)
    assert isinstance(suite, EvalSuite)
    assert suite.tasks == held_out(20, seed=10) and suite.samples == 320
    first = suite.evaluate(model)
    assert suite.evaluate(model) == first
    assert HeldOutTasks(20, seed=3).evaluate(model) == first
    assert set(GateRules().metrics) <= set(first)
    assert {f"greedy_{m}" for m in ("solve_rate", "broken_tool_call_rate")} <= set(first)
    assert all(0.0 <= v <= 1.0 for v in first.values())
    assert decide(first, first, first, suite.samples, GateRules()).promote  # a model never regresses against itself


@pytest.mark.slow
def test_the_loop_gates_with_the_suite_it_is_given(broker, topic_prefix, ch_client, ch_dsn, ch_db, tmp_path):
    """app.loop.Loop takes the suite (and rules) it is given: the initial policy's scores recorded in
    ClickHouse ``checkpoints`` are the injected suite's, computed on the loop's own model."""
    from app.loop import Loop
    from rtrl import clickhouse
    from rtrl.settings import load_settings

    class UserBenchmark:
        name, samples = "user-benchmark", 400

        def __init__(self):
            self.models: list = []

        def evaluate(self, model) -> dict[str, float]:
            self.models.append(model)
            return EV | {"solve_rate": 0.61}

    suite, rules = UserBenchmark(), GateRules(solve_tolerance=0.0)
    settings = load_settings(
        env={
            "RTRL_DATA_DIR": str(tmp_path),
            "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
            "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
            "RTRL_CLICKHOUSE__DSN": ch_dsn,
            "RTRL_CLICKHOUSE__DATABASE": ch_db,
            "RTRL_LOOP__WARM_START_STEPS": "0",
        }
    )
    loop = Loop(settings, broker.bootstrap, ch_client, serve=False, suite=suite, rules=rules)
    try:
        loop.initial()
    finally:
        loop.close()
    assert loop.rules is rules and suite.models == [loop.model]
    assert loop.evals[0]["solve_rate"] == 0.61
    (v0,) = clickhouse.select(ch_client, ch_db, "checkpoints")
    assert v0.version == 0 and v0.status == "promoted" and v0.eval_results["solve_rate"] == 0.61


# ---------------------------------------------------------------- training-inference mismatch


def _step(step: int, k3: float, max_abs: float, run_id: str = "loop-0-v1"):
    from schemas.records import TrainStep

    return TrainStep(
        run_id=run_id,
        step=step,
        policy_version=0,
        loss=0.0,
        pg_loss=0.0,
        kl=0.0,
        clip_fraction=0.0,
        is_truncated_fraction=0.0,
        tokens=10,
        on_policy_fraction=1.0,
        lag_histogram={"0": 2},
        tokens_per_s=1.0,
        batch_ids=[f"b{step}"],
        at=1,
        mismatch_k3=k3,
        mismatch_max_abs_log_ratio=max_abs,
    )


def test_a_candidate_trained_while_the_mismatch_alert_fired_is_refused():
    """The gate refuses a candidate one of whose training steps had its mismatch above the limits, naming
    the metric, the step and the limit; the same candidate trained without it, or with the rule off, passes."""
    rules = GateRules(solve_tolerance=0.02, mismatch=MismatchRule(k3=0.5, max_abs_log_ratio=8.0))
    calm = [_step(1, 0.01, 0.3), _step(2, 0.5, 8.0), _step(3, 0.2, 2.0)]  # at the limits: not above
    assert decide(EV, EV, EV, 400, rules, training=calm).promote
    spiked = calm + [_step(4, 3.1, 2.0), _step(5, 0.1, 24.0), _step(6, 4.0, 9.0)]
    d = decide(EV, EV, EV, 400, rules, training=spiked)
    assert not d.promote
    assert d.reason.startswith("trained while the mismatch alert fired: training-inference mismatch: ")
    assert "mismatch_k3 above 0.5 in 2 step(s), worst mismatch_k3 4 > 0.5 at step 6 of run loop-0-v1" in d.reason
    assert "mismatch_max_abs_log_ratio above 8 in 2 step(s), worst mismatch_max_abs_log_ratio 24 > 8 at step 5" in (
        d.reason
    )
    # rows read back as mappings (e.g. from ClickHouse) work the same
    as_rows = [{f: getattr(s, f) for f in s.__struct_fields__} for s in spiked]
    assert decide(EV, EV, EV, 400, rules, training=as_rows) == d
    assert decide(EV, EV, EV, 400, dataclasses.replace(rules, mismatch=None), training=spiked).promote
    # other problems are still listed with it
    worse = decide(EV | {"solve_rate": 0.1}, EV, EV, 400, rules, training=spiked)
    assert len(worse.problems) == 2 and worse.problems[0].startswith("solve rate")
    # run_gate hands the candidate's steps to decide
    suite = FixedSuite({"m": EV})
    assert not run_gate(suite, "m", EV, EV, rules, training=spiked)[1].promote
    assert run_gate(suite, "m", EV, EV, rules, training=calm)[1].promote


def test_the_loops_gate_takes_the_mismatch_limits_from_settings():
    from app.loop import loop_gate_rules
    from rtrl.settings import load_settings

    rules = loop_gate_rules(load_settings(env={}))
    assert rules.mismatch == MismatchRule(k3=0.0, max_abs_log_ratio=15.0) == MismatchRule()
    env = {
        "RTRL_LOOP__MISMATCH_K3_MAX": "0.1",
        "RTRL_LOOP__MISMATCH_LOG_RATIO_MAX": "0",
        "RTRL_LOOP__SOLVE_TOLERANCE": "0",
    }
    rules = loop_gate_rules(load_settings(env=env))
    assert rules.solve_tolerance == 0.0 and rules.mismatch == MismatchRule(k3=0.1, max_abs_log_ratio=0.0)
    assert rules.alpha == 0.05 and loop_gate_rules(load_settings(env={"RTRL_LOOP__GATE_ALPHA": "0"})).alpha is None
    assert not decide(EV, EV, EV, 400, rules, training=[_step(1, 0.2, 100.0)]).promote
    assert decide(EV, EV, EV, 400, rules, training=[_step(1, 0.05, 100.0)]).promote  # max |log-ratio| is off
