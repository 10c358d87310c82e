"""The eval suite the gate scores candidates with: injected, so a user can plug in a benchmark.

An :class:`EvalSuite` turns a model into a row of scores; :func:`run_gate` scores a candidate with
it and lets :func:`evalgate.gate.decide` judge the row against the serving and first versions'.
The loop's default suite is :class:`simulator.evalsuite.HeldOutTasks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from evalgate.gate import Decision, GateRules, decide


@runtime_checkable
class EvalSuite(Protocol):
    """A benchmark the gate scores models with.

    ``evaluate`` must be deterministic for a given model (same scores every call: the serving and
    first versions' rows are scored once and kept) and return the gate's solve metric and every
    metric its behaviour rules name (:attr:`evalgate.gate.GateRules.metrics`)."""

    name: str
    """Shown with the scores, e.g. ``held-out-tasks``."""
    samples: int
    """How many completions the behaviour rates are computed from (the rules' ``min_samples`` apply to it)."""

    def evaluate(self, model: Any) -> dict[str, float]:
        """The model's scores: metric name -> value."""
        ...


def run_gate(
    suite: EvalSuite,
    candidate_model: Any,
    serving_scores: Mapping[str, float],
    first_scores: Mapping[str, float],
    rules: GateRules | None = None,
    training: Iterable[object] = (),
) -> tuple[dict[str, float], Decision]:
    """Score ``candidate_model`` with ``suite`` and decide on it; (its scores, the decision). ``training``:
    the candidate's ``train_metrics`` rows, judged by ``rules.mismatch``."""
    scores = dict(suite.evaluate(candidate_model))
    return scores, decide(scores, serving_scores, first_scores, suite.samples, rules or GateRules(), training)
