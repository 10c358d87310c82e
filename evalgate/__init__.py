"""The eval gate: pure promotion rules and decision (:mod:`evalgate.gate`) and the injected eval
suite's interface (:mod:`evalgate.suite`). Imports only records, the foundation and the monitors'
alert rules; no I/O, no models."""

from evalgate.gate import EVAL_RULES, SUMMARY_METRICS, Decision, GateRules, decide
from evalgate.suite import EvalSuite, run_gate

__all__ = ["EVAL_RULES", "SUMMARY_METRICS", "Decision", "EvalSuite", "GateRules", "decide", "run_gate"]
