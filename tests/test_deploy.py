"""What ``deploy/`` gives operators (issue 18), checked offline: the Prometheus alert rules, the Grafana dashboard and
the runbook.

The files are made by ``python -m app.deploy`` and must be what it makes now; every query parses under Prometheus'
grammar (promql-parser) and reads only metrics some part exports (:mod:`rtrl.metrics`); the behaviour alerts carry
the promotion gate's own rules (:data:`monitors.alerts.DEFAULT_RULES`); every alert has its runbook section, and the
runbook covers the situations the issue names. Not run here (no Prometheus or Grafana on this machine): loading the
rule file into Prometheus (``promtool check rules deploy/prometheus/rtrl-alerts.yml``) and the dashboard into
Grafana (Dashboards > Import); docs/production.md says how.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import promql_parser
import yaml
from prometheus_client import REGISTRY

from app import deploy
from monitors.alerts import DEFAULT_RULES, MismatchRule
from rtrl import metrics

ROOT = Path(__file__).resolve().parents[1]


def _exported() -> set[str]:
    """Every sample name the project's metrics produce (counters' ``_total``, histograms' ``_bucket``, ...)."""
    assert metrics.EVENTS is not None  # rtrl.metrics registers its families on import
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("rtrl_"):
            names |= {family.name, *(s.name for s in family.samples)}
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(rtrl_[a-z0-9_]+)", expr)) | ({"up"} if re.search(r"\bup\{", expr) else set())


def _rules() -> list[dict]:
    doc = yaml.safe_load(deploy.RULES_FILE.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    board = json.loads(deploy.DASHBOARD_FILE.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_the_files_are_what_app_deploy_makes(tmp_path):
    """`python -m app.deploy --out DIR` writes the same files as the repository holds."""
    run = subprocess.run(
        [sys.executable, "-m", "app.deploy", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    for path in (deploy.RULES_FILE, deploy.DASHBOARD_FILE):
        made = tmp_path / path.relative_to(ROOT)
        assert made.read_text() == path.read_text(), f"{path} is stale: run `python -m app.deploy`"


def test_every_query_parses_and_reads_only_exported_metrics():
    exported = _exported() | {"up"}
    exprs = [r["expr"] for r in _rules()] + _dashboard_exprs()
    assert len(exprs) > 20
    for expr in exprs:
        promql_parser.parse(expr)  # raises on anything Prometheus would refuse
        unknown = _metrics_in(expr) - exported
        assert not unknown, (unknown, expr)


def test_the_behaviour_alerts_carry_the_gates_rules():
    rules = {r["labels"].get("monitor"): r for r in _rules() if "monitor" in r["labels"]}
    mirrored = [rule for rule in DEFAULT_RULES if rule.metric in deploy.LIVE_RATES]
    assert {r.metric for r in mirrored} == set(rules) == set(deploy.LIVE_RATES)
    for rule in mirrored:
        expr = rules[rule.metric]["expr"]
        cur, base = deploy.live_rate(rule.metric), deploy.live_rate(rule.metric, "6h offset 1h")
        bad = f"({cur} - {base})" if rule.direction == "increase" else f"({base} - {cur})"
        assert expr.startswith(f"{bad} > {rule.threshold:g} * clamp_min({base}, {rule.floor:g})"), expr
        assert expr.endswith(f">= {rule.min_samples}")
    # each rate is the behaviour view's: numerator and denominator counters of the same trajectories
    assert deploy.LIVE_RATES["broken_tool_call_rate"] == ("broken_tool_calls", "tool_calls")
    mismatch = next(r for r in _rules() if r["alert"] == "RtrlTrainingInferenceMismatch")
    assert mismatch["expr"].endswith(f"> {MismatchRule().max_abs_log_ratio:g}")


def test_every_alert_has_its_runbook_section_and_the_runbook_covers_the_issue():
    runbook = (ROOT / "deploy" / "RUNBOOK.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    for rule in _rules():
        assert rule["labels"]["severity"] in ("page", "ticket")
        assert rule["annotations"]["summary"]
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "deploy/RUNBOOK.md" and anchor in anchors, (rule["alert"], anchor)
    alerts = {r["alert"] for r in _rules()}
    # the issue's list: a reward-hack alarm, growing lag, a dead-letter spike, a trainer that stopped, a mismatch
    # alarm, a rollback
    for needed in (
        "RtrlBrokenToolCallsRose",
        "RtrlConsumerLagGrowing",
        "RtrlDeadLetterSpike",
        "RtrlTrainerStopped",
        "RtrlTrainingInferenceMismatch",
        "RtrlRollback",
    ):
        assert needed in alerts and needed.lower() in anchors
    assert "rtrl rollback V --reason" in runbook


def test_the_dashboard_shows_every_figure_the_issue_names():
    board = json.loads(deploy.DASHBOARD_FILE.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] and p["gridPos"]["w"] > 0 for p in board["panels"])
    shown = set().union(*(_metrics_in(e) for e in _dashboard_exprs()))
    for name in (
        "rtrl_consumer_lag",  # consumer lag per partition
        "rtrl_events_total",  # events/s
        "rtrl_dead_letters_total",  # dead letters by kind
        "rtrl_open_windows",  # open windows
        "rtrl_window_state_bytes",  # state size
        "rtrl_event_to_reward_seconds_bucket",  # event -> reward latency
        "rtrl_batch_samples_total",  # batch staleness by lag
        "rtrl_trainer_tokens_per_second",
        "rtrl_trainer_loss",
        "rtrl_trainer_kl",
        "rtrl_trainer_grad_norm",
        "rtrl_trainer_mismatch_k3",
        "rtrl_trainer_on_policy_fraction",
        "rtrl_gate_decisions_total",
        "rtrl_serving_version",
    ):
        assert name in shown, name
