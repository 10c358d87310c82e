"""What ``deploy/`` holds for operators, made from the code it describes (issue 18): Prometheus alert rules and a
Grafana dashboard over the metrics of :mod:`rtrl.metrics`.

The behaviour alerts mirror the promotion gate's monitors (:data:`monitors.alerts.DEFAULT_RULES`) on the live
stream: the same metrics, directions, thresholds and floors, computed from the reward flow's
``rtrl_trajectory_behaviour_total`` counters over the last hour against the six hours before it (a promoted
candidate that starts a reward hack shows there before the next gate). The operational alerts cover what the
runbook (``deploy/RUNBOOK.md``) tells an on-call engineer to do: consumer lag growing, a flow that stopped
polling, a dead-letter spike, a trainer that stopped, a training-inference mismatch, a rollback, a part down (its
scrape job named ``rtrl-<part>``). The mismatch limits are the rendered settings' (``loop.mismatch_log_ratio_max``,
``loop.mismatch_k3_max``), the gate's own.
``python -m app.deploy`` writes the files; ``tests/test_deploy.py`` fails when they differ from what this module makes.
It also writes the Kubernetes manifests and the docker-compose file of :mod:`app.manifests`, made from a settings
file (``--config``; the committed ones from ``deploy/production.example.toml``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from app import manifests
from monitors.alerts import DEFAULT_RULES, MismatchRule
from rtrl.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
RULES_FILE = ROOT / "deploy" / "prometheus" / "rtrl-alerts.yml"
DASHBOARD_FILE = ROOT / "deploy" / "grafana" / "rtrl-dashboard.json"
RUNBOOK = "deploy/RUNBOOK.md"
K8S_DIR = ROOT / "deploy" / "k8s"
COMPOSE_FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
#: the settings the committed manifests are made from
SOURCE = ROOT / "deploy" / "production.example.toml"

#: the behaviour view's rate metrics as (numerator, denominator) of ``rtrl_trajectory_behaviour_total{what}``
#: (``trajectories``: ``rtrl_trajectories_total``); edit persistence and latency come later than a trajectory's
#: close or not per trajectory, and stay with the gate
LIVE_RATES: dict[str, tuple[str, str]] = {
    "broken_tool_call_rate": ("broken_tool_calls", "tool_calls"),
    "edit_rate": ("edited", "trajectories"),
    "clarification_rate": ("clarified", "trajectories"),
    "dissatisfied_rate": ("dissatisfied", "trajectories"),
}
ALERT_NAMES = {
    "broken_tool_call_rate": "RtrlBrokenToolCallsRose",
    "edit_rate": "RtrlEditRateFell",
    "clarification_rate": "RtrlClarificationRose",
    "dissatisfied_rate": "RtrlDissatisfiedRose",
}


def _sum_rate(what: str, window: str) -> str:
    """``sum(rate(...[range] offset o))`` of one counter; ``window`` is a range, or ``range offset o``."""
    span, _, offset = window.partition(" offset ")
    at = f" offset {offset}" if offset else ""
    if what == "trajectories":
        return f"sum(rate(rtrl_trajectories_total[{span}]{at}))"
    return f'sum(rate(rtrl_trajectory_behaviour_total{{what="{what}"}}[{span}]{at}))'


def live_rate(metric: str, window: str = "1h") -> str:
    """PromQL of one behaviour rate over ``window`` (a window ``6h offset 1h`` is the baseline)."""
    num, den = LIVE_RATES[metric]
    return f"({_sum_rate(num, window)} / {_sum_rate(den, window)})"


def _anchor(alert: str) -> str:
    return f"{RUNBOOK}#{alert.lower()}"


def prometheus_rules(settings: Settings | None = None) -> dict[str, Any]:
    """The alert rules, as Prometheus' rule-file structure; the mismatch limits are ``settings``' (the gate's:
    ``loop.mismatch_log_ratio_max`` and, when set, ``loop.mismatch_k3_max``), else :class:`MismatchRule`'s."""
    behaviour = []
    for rule in DEFAULT_RULES:
        if rule.metric not in LIVE_RATES:
            continue
        cur, base = live_rate(rule.metric), live_rate(rule.metric, "6h offset 1h")
        bad = f"{cur} - {base}" if rule.direction == "increase" else f"{base} - {cur}"
        name = ALERT_NAMES[rule.metric]
        behaviour.append(
            {
                "alert": name,
                # the gate's rule: the move in the bad direction over max(baseline, floor) beyond the threshold,
                # with at least min_samples trajectories on both sides
                "expr": f"({bad}) > {rule.threshold:g} * clamp_min({base}, {rule.floor:g})\n"
                f"and sum(increase(rtrl_trajectories_total[1h])) >= {rule.min_samples}\n"
                f"and sum(increase(rtrl_trajectories_total[6h] offset 1h)) >= {rule.min_samples}",
                "for": "15m",
                "labels": {"severity": "page", "monitor": rule.metric},
                "annotations": {
                    "summary": f"{rule.metric} {'rose' if rule.direction == 'increase' else 'fell'} more than "
                    f"{rule.threshold:.0%} in the last hour against the six hours before (the gate's rule)",
                    "runbook_url": _anchor(name),
                },
            }
        )
    limits = (
        MismatchRule(settings.loop.mismatch_k3_max, settings.loop.mismatch_log_ratio_max)
        if settings
        else MismatchRule()
    )
    mismatch = limits.max_abs_log_ratio
    mismatch_expr = f"max by (adapter) (rtrl_trainer_mismatch_max_abs_log_ratio) > {mismatch:g}"
    mismatch_text = f"by more than e^{mismatch:g} on some token (loop.mismatch_log_ratio_max)"
    if limits.k3 > 0:
        mismatch_expr = f"({mismatch_expr})\nor\n(max by (adapter) (rtrl_trainer_mismatch_k3) > {limits.k3:g})"
        mismatch_text += f", or by a mean k3 over {limits.k3:g} (loop.mismatch_k3_max)"
    ops = [
        {
            "alert": "RtrlConsumerLagGrowing",
            "expr": "sum by (flow, topic) (rtrl_consumer_lag) > 10000\n"
            "and sum by (flow, topic) (deriv(rtrl_consumer_lag[15m])) > 0",
            "for": "15m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.flow }} is {{ $value }} messages behind on {{ $labels.topic }} and falling "
                "further behind",
                "runbook_url": _anchor("RtrlConsumerLagGrowing"),
            },
        },
        {
            "alert": "RtrlDeadLetterSpike",
            # duplicates, late and future events come with at-least-once delivery and clocks: not a producer bug
            "expr": 'sum by (flow) (rate(rtrl_dead_letters_total{kind!~"duplicate|too_late|future"}[10m]))\n'
            "/ sum by (flow) (rate(rtrl_events_total[10m])) > 0.05",
            "for": "10m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "more than 5% of what {{ $labels.flow }} reads is dead-lettered as malformed or invalid",
                "runbook_url": _anchor("RtrlDeadLetterSpike"),
            },
        },
        {
            "alert": "RtrlTrainerStopped",
            # no step in an hour while batches come (a trainer never started counts: its series starts at 0); an hour
            # leaves room for the eval gate and the live A/B between a cycle's steps
            "expr": "sum(rate(rtrl_batches_total[1h])) > 0\n"
            'unless sum(increase(rtrl_trainer_steps_total{adapter=""}[1h])) > 0',
            "for": "15m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "micro-batches keep coming but the shared policy's trainer has not stepped for an hour",
                "runbook_url": _anchor("RtrlTrainerStopped"),
            },
        },
        {
            "alert": "RtrlFlowStalled",
            "expr": "time() - max by (flow) (rtrl_consumer_last_poll_timestamp_seconds) > 300",
            "for": "5m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.flow }} has not polled Kafka for 5 minutes: it is hung (its lag is stale)",
                "runbook_url": _anchor("RtrlFlowStalled"),
            },
        },
        {
            "alert": "RtrlTrainingInferenceMismatch",
            "expr": mismatch_expr,
            "for": "10m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": f"the trainer's log-probs and the inference fleet's disagree {mismatch_text}",
                "runbook_url": _anchor("RtrlTrainingInferenceMismatch"),
            },
        },
        {
            "alert": "RtrlRollback",
            # a rollback in the last hour; the second part catches an org's first one (a new series, which
            # increase() cannot see)
            "expr": 'sum by (org) (increase(rtrl_gate_decisions_total{status="rolled_back"}[1h])) > 0\n'
            'or (sum by (org) (rtrl_gate_decisions_total{status="rolled_back"}) > 0\n'
            'unless sum by (org) (rtrl_gate_decisions_total{status="rolled_back"} offset 1h))',
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "a promoted version was rolled back (org '{{ $labels.org }}'; '' is the shared policy)",
                "runbook_url": _anchor("RtrlRollback"),
            },
        },
        {
            "alert": "RtrlPartDown",
            "expr": 'up{job=~"rtrl.*"} == 0',
            "for": "5m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.job }} at {{ $labels.instance }} does not answer its metrics scrape",
                "runbook_url": _anchor("RtrlPartDown"),
            },
        },
    ]
    return {
        "groups": [
            {"name": "rtrl-behaviour", "interval": "1m", "rules": behaviour},
            {"name": "rtrl-operations", "interval": "1m", "rules": ops},
        ]
    }


def _panel(i: int, title: str, exprs: dict[str, str], unit: str = "short") -> dict[str, Any]:
    return {
        "id": i,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * ((i - 1) % 2), "y": 8 * ((i - 1) // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + n), "expr": expr, "legendFormat": legend}
            for n, (legend, expr) in enumerate(exprs.items())
        ],
    }


def grafana_dashboard() -> dict[str, Any]:
    """One dashboard over every part's metrics (Grafana's JSON model, a Prometheus data source variable)."""
    panels = [
        ("Events read per second", {"{{flow}}": "sum by (flow) (rate(rtrl_events_total[1m]))"}, "ops"),
        ("Dead letters per second, by kind", {"{{flow}} {{kind}}": "sum by (flow, kind) (rate(rtrl_dead_letters_total[5m]))"}, "ops"),
        ("Consumer lag (messages)", {"{{flow}} {{topic}}/{{partition}}": "rtrl_consumer_lag"}, "short"),
        (
            "Event -> reward latency",
            {
                "p50": "histogram_quantile(0.5, sum by (le) (rate(rtrl_event_to_reward_seconds_bucket[5m])))",
                "p99": "histogram_quantile(0.99, sum by (le) (rate(rtrl_event_to_reward_seconds_bucket[5m])))",
            },
            "s",
        ),
        ("Open windows", {"partition {{partition}}": "rtrl_open_windows"}, "short"),
        ("Window state in memory", {"partition {{partition}}": "rtrl_window_state_bytes"}, "bytes"),
        (
            "Batch staleness: samples per second by policy lag",
            {
                "packed, lag {{lag}}": "sum by (lag) (rate(rtrl_batch_samples_total[5m]))",
                "dropped as stale, lag {{lag}}": "sum by (lag) (rate(rtrl_batch_samples_dropped_total[5m]))",
            },
            "ops",
        ),
        ("Trainer tokens/s", {"{{adapter}}": "rtrl_trainer_tokens_per_second"}, "short"),
        ("Loss", {"{{adapter}}": "rtrl_trainer_loss"}, "short"),
        ("KL to the reference", {"{{adapter}}": "rtrl_trainer_kl"}, "short"),
        ("Gradient norm", {"{{adapter}}": "rtrl_trainer_grad_norm"}, "short"),
        (
            "Training-inference mismatch",
            {
                "k3 {{adapter}}": "rtrl_trainer_mismatch_k3",
                "max |log-ratio| {{adapter}}": "rtrl_trainer_mismatch_max_abs_log_ratio",
            },
            "short",
        ),
        ("On-policy fraction", {"{{adapter}}": "rtrl_trainer_on_policy_fraction"}, "percentunit"),
        # the trainer part counts its decisions, the policy server those it sees: the larger is every one
        ("Gate decisions", {"{{status}} {{org}}": "max by (status, org) (increase(rtrl_gate_decisions_total[1h]))"}, "short"),
        ("Serving version", {"{{part}}": "max by (part) (rtrl_serving_version)"}, "short"),
        ("Behaviour, live (the gate's rates)", {m: live_rate(m, "1h") for m in LIVE_RATES}, "percentunit"),
        (
            "Data use: what was kept from training, per second",
            {
                "batch flow, {{reason}}": "sum by (reason) (rate(rtrl_data_use_excluded_total[5m]))",
                "SDK withheld, {{data_use}}": "sum by (data_use) (rate(rtrl_sdk_withheld_total[5m]))",
                "trainer refused": 'sum(rate(rtrl_dead_letters_total{flow="trainer", kind="data_use"}[5m]))',
                "secret found, {{detector}}": "sum by (detector) (rate(rtrl_secrets_found_total[5m]))",
            },
            "ops",
        ),
        (
            "Erasure: runs, and erased subjects' records skipped, per hour",
            {
                "erasures, {{subject_kind}}": "sum by (subject_kind) (increase(rtrl_erasures_total[1h]))",
                "skipped by {{consumer}}": "sum by (consumer) (increase(rtrl_erased_skipped_total[1h]))",
            },
            "short",
        ),
    ]  # fmt: skip
    return {
        "title": "rtrl",
        "uid": "rtrl-overview",
        "schemaVersion": 39,
        "version": 1,
        "tags": ["rtrl"],
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": [_panel(i + 1, *p) for i, p in enumerate(panels)],
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the alert expressions) as literal blocks, nothing folded, no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def source_settings(path: Path = SOURCE) -> Settings:
    """The settings the manifests are made from. Loaded as a container would, but without its secrets: those
    are left out of every file made here (they come from the Secret), so a stand-in satisfies the check that a
    deployment has a salt of its own."""
    import tomllib

    kafka = tomllib.loads(path.read_text(encoding="utf-8")).get("kafka", {})
    stand_ins = {"RTRL_SDK__SALT": "stand-in"}
    if kafka.get("sasl_mechanism") == "OAUTHBEARER":
        stand_ins["RTRL_KAFKA__OAUTH_CLIENT_SECRET"] = "stand-in"
    elif kafka.get("sasl_mechanism"):
        stand_ins["RTRL_KAFKA__SASL_PASSWORD"] = "stand-in"
    return load_settings(path, env=stand_ins)


def _yaml(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=10_000)


def render(settings: Settings | None = None, shape: manifests.Shape = manifests.Shape()) -> dict[Path, str]:
    """Each file's text; the manifests from ``settings`` (default: :data:`SOURCE`'s)."""
    header = "# Made by `python -m app.deploy` from app/deploy.py (tests/test_deploy.py checks it); do not edit.\n"
    settings = settings if settings is not None else source_settings()
    made = f"# Made by `python -m app.deploy` from {SOURCE.relative_to(ROOT)} (app/manifests.py); do not edit.\n"
    out = {
        RULES_FILE: header + yaml.dump(prometheus_rules(settings), Dumper=_Dumper, sort_keys=False, width=10_000),
        DASHBOARD_FILE: json.dumps(grafana_dashboard(), indent=2) + "\n",
        COMPOSE_FILE: header + yaml.dump(manifests.compose(None, shape), Dumper=_Dumper, sort_keys=False, width=10_000),
    }
    for name, docs in manifests.kubernetes(settings, shape).items():
        out[K8S_DIR / name] = made + _yaml(docs)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m app.deploy [--out DIR]``: write the files under the repository (or under DIR, same layout)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m app.deploy", description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--out", type=Path, default=ROOT, help="root to write deploy/... under (default: the repository)")
    ap.add_argument(
        "--config",
        type=Path,
        default=SOURCE,
        help=f"settings file the manifests are made from (default: {SOURCE.relative_to(ROOT)})",
    )
    base = manifests.Shape()
    for field in dataclasses.fields(manifests.Shape):  # every part of the cluster's shape as an option
        ap.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(getattr(base, field.name)),
            default=getattr(base, field.name),
            help=f"(default: {getattr(base, field.name)!r})",
        )
    args = ap.parse_args(argv)
    shape = manifests.Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(manifests.Shape)})
    for path, text in render(source_settings(args.config), shape).items():
        target = args.out / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
