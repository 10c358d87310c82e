"""The files page (docs/reference/files.md): one line per file of the project, read from the file itself.

The files are those of ``FILE_GROUPS``. A Python module gives its docstring's first sentence, a migration its
leading ``--`` comment's, a guide in docs/ the paragraph after its title. Other files have a line in
``FILE_NOTES``. A file with none of these fails the page, named (``UndescribedFile``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from docs.gen_markdown import PAGE_NAMES, ROOT, cell, header, rst_to_md, strip_code_blocks

#: the folders of the files page, in order (top-down through the floors, then what surrounds the product), each
#: with the patterns of its files; Python modules and SQL migrations describe themselves
FILE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("top level", ("Makefile", "pyproject.toml", "LICENSE", "CHANGELOG.md", "CONTRIBUTING.md", "README.md")),
    ("app/", ("app/*.py", "app/report/*.py")),
    ("rewards/", ("rewards/*.py",)),
    ("monitors/", ("monitors/*.py", "monitors/*.md")),
    ("evalgate/", ("evalgate/*.py",)),
    ("client/", ("client/*.py",)),
    ("flows/", ("flows/*.py",)),
    ("trainer/", ("trainer/*.py", "trainer/hf/*.py", "trainer/lora/*.py")),
    ("simulator/", ("simulator/*.py",)),
    ("rtrl/", ("rtrl/*.py",)),
    ("schemas/", ("schemas/*.py", "schemas/migrations/*.sql")),
    ("devservices/", ("devservices/*.py", "devservices/chserver/*.py")),
    ("examples/", ("examples/*.py",)),
    ("bench/", ("bench/*.py", "bench/*.png", "bench/*.md")),
    ("deploy/", ("deploy/**/*",)),
    ("docs/", ("docs/*.py", "docs/*.md", "docs/*.png", "docs/reference/*.md")),
    ("tests/", ("tests/*.py", "tests/dist/*.py", "tests/golden/*")),
    (".ci/", (".ci/*",)),
)

#: files that carry no docstring or leading SQL comment, each with its line (a new such file needs one here)
FILE_NOTES: dict[str, str] = {
    "Makefile": "the two entry points: `make run`, `make test` (plus setup, demo, lint, test-fast, docs, bench, clean)",
    "pyproject.toml": "the package and its pinned stack (Python 3.11; Transformer Engine only in the `gpu` extra)",
    "LICENSE": "the Apache License 2.0 (SPDX `Apache-2.0` in pyproject.toml)",
    "CHANGELOG.md": "notable changes per release (Keep a Changelog)",
    "CONTRIBUTING.md": "setup, tests, lint and types, benchmarks, house rules, commit style",
    "README.md": "what rtrl is, the two commands, what the main job shows, where to read on",
    "monitors/ANALYST_QUERIES.md": "SQL for analysts: behaviour per checkpoint, the A/B table, per user, the final A/B, "
    "rewards, dead letters",
    "bench/RESULTS.md": "dated benchmark results, with the machine each ran on",
    "bench/ab_stats.png": "A/A false alarms under peeking and power by users per arm (`bench/ab_stats.py`)",
    "bench/ab_stats_abworld.png": "the same measures on the per-user A/B world (`bench/ab_stats.py`)",
    "bench/adapters.png": "serving tokens/s and memory with 0, 1, 8 and 64 adapters loaded (`bench/adapters.py`)",
    "bench/capacity.png": "trainer GPUs against tokens per cycle for 8B, 32B and 70B models (`bench/capacity.py`)",
    "bench/long_loop.png": "held-out success, KL and gradient norms per cycle per arm (`bench/long_loop.py`)",
    "bench/per_org.png": "each org's held-out P(solve) per cycle: shared alone, with adapters, that arm's base alone",
    "deploy/Dockerfile": "the images the manifests run: CPU, and the trainer's GPU one by build arguments",
    "deploy/RUNBOOK.md": "what each alert means and what to do",
    "deploy/beam/README.md": "running the backfill on Flink, Spark or Dataflow: pipeline options alone",
    "deploy/beam/dataflow.options": "example Beam pipeline options for Google Cloud Dataflow",
    "deploy/beam/flink.options": "example Beam pipeline options for a Flink cluster",
    "deploy/beam/spark.options": "example Beam pipeline options for a Spark cluster",
    "deploy/clickhouse/cluster.sql": "`rtrl migrate --print` for a cluster named rtrl_cluster: the DDL to review",
    "deploy/clickhouse/security.sql": "a ClickHouse server's writer user, read-only analyst role, grants, profiles, quota",
    "deploy/compose/docker-compose.yml": "one host: apache/kafka, clickhouse-server, setup, the main job on them",
    "deploy/demo.toml": "`make demo`: the main job in three cycles and a smaller final A/B",
    "deploy/grafana/rtrl-dashboard.json": "one Grafana dashboard over every part's metrics",
    "deploy/k8s/00-config.yaml": "the namespace, and the settings as a ConfigMap",
    "deploy/k8s/10-setup-job.yaml": "a Job: topics, then migrations and verification",
    "deploy/k8s/20-reward-flow.yaml": "the reward flow as a Bytewax cluster: headless Service, StatefulSet, recovery volumes",
    "deploy/k8s/30-batch-flow.yaml": "the batch flow as a Bytewax cluster, likewise",
    "deploy/k8s/40-trainer.yaml": "the trainer as a Kubeflow PyTorchJob (torchrun on every node), shared checkpoints",
    "deploy/k8s/50-retention-cronjob.yaml": "`rtrl retention apply` as a CronJob on `retention.schedule`",
    "deploy/k8s/secret/rtrl-secrets.example.yaml": "the Secret's keys (salt, passwords), empty; outside the applied folder",
    "deploy/production.example.toml": "wiring for a Kafka cluster and a ClickHouse server",
    "deploy/prometheus/rtrl-alerts.yml": "alert rules: behaviour (the gate's rules, live), lag, dead letters, trainer, rollback",
    "deploy/rtrl.example.toml": "every setting with its default and help (`rtrl config --example`)",
    "docs/architecture.png": "the architecture diagram, drawn by `docs/gen_diagram.py`",
    "docs/reference/commands.md": "(generated) every `rtrl` command and argument",
    "docs/reference/files.md": "(generated) this page: every file and what it is for",
    "docs/reference/records.md": "(generated) every record and event type, field by field",
    "docs/reference/settings.md": "(generated) every setting: type, default, environment variable, help",
    "docs/reference/topics-and-tables.md": "(generated) Kafka topics, ClickHouse tables and views",
    "tests/golden/tiny_loss_curve.json": "the golden loss curve of `tests/test_trainer_train.py`",
    ".ci/run": "CI: runs `make test` (lint and types first); no tests collected is a failure",
}


class UndescribedFile(ValueError):
    """A file of the files page with no line to show: a module without a docstring, a migration without a
    leading comment, or another file missing from ``FILE_NOTES``."""


def first_sentence(text: str) -> str:
    """The first sentence of ``text``'s first paragraph, on one line (a sentence ends at ``. `` before a capital)."""
    para = " ".join(text.strip().split("\n\n", 1)[0].split())
    m = re.search(r"[.!?](?=\s+[A-Z(`])", para)
    return (para[: m.start() + 1] if m else para).strip()


def shorten(text: str, limit: int = 150) -> str:
    """``text`` cut to at most ``limit`` characters (plus " ...") at the last clause boundary (``; ``, ``: ``,
    ``, ``, then a space) where no parenthesis or code span is left open."""
    if len(text) <= limit:
        return text

    def closed(head: str) -> bool:
        return head.count("(") == head.count(")") and head.count("[") == head.count("]") and head.count("`") % 2 == 0

    for marks in (("; ", ": ", ", "), (" ",)):
        cuts = [i for i in range(min(limit, len(text)), 0, -1) if text.startswith(marks, i) and closed(text[:i])]
        if cuts:
            return text[: cuts[0]].rstrip(" ,;:") + " ..."
    return text


def describe_file(root: Path, rel: str) -> str:
    """The line the files page shows for ``rel``: a module's docstring, a migration's leading comment, or its
    entry in ``FILE_NOTES``. Raises :class:`UndescribedFile` naming the file when it has none."""
    path = root / rel
    if rel in FILE_NOTES:
        return FILE_NOTES[rel]
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not doc:
            raise UndescribedFile(f"{rel} has no module docstring: its first sentence is its line on the files page")
        return shorten(rst_to_md(first_sentence(doc)))
    if path.suffix == ".sql" and rel.startswith("schemas/migrations/"):
        comment = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("--"):
                break
            comment.append(line[2:].strip())
        if not any(comment):
            raise UndescribedFile(f"{rel} opens with no -- comment: its first sentence is its line on the files page")
        return shorten(first_sentence("\n".join(comment)))
    if path.suffix == ".md" and rel.startswith("docs/") and "/" not in rel.removeprefix("docs/"):
        opening = _opening_paragraph(path.read_text(encoding="utf-8"))
        if not opening:
            raise UndescribedFile(f"{rel} opens with no paragraph after its title saying what the page is for")
        return shorten(first_sentence(opening))
    raise UndescribedFile(f"{rel} has no line on the files page: add it to FILE_NOTES in docs/gen_files.py")


def _opening_paragraph(markdown: str) -> str:
    """The first prose paragraph of a page after its title (a quote's ``>`` markers dropped); '' if none."""
    para: list[str] = []
    for line in strip_code_blocks(markdown).splitlines():
        text = line.strip().removeprefix(">").strip()
        if text.startswith(("#", "![", "<!--", "*Drawn")) or not text:
            if para:
                break
            continue
        para.append(text)
    return " ".join(para)


def listed_files(root: Path) -> list[tuple[str, list[str]]]:
    """(group, files relative to ``root``) for each group of ``FILE_GROUPS``, files sorted, caches left out."""
    out = []
    for group, patterns in FILE_GROUPS:
        found: set[str] = set()
        for pattern in patterns:
            for path in root.glob(pattern):
                rel = path.relative_to(root).as_posix()
                if path.is_file() and "__pycache__" not in rel and not rel.endswith(".pyc"):
                    found.add(rel)
        if group == "docs/":  # the generated pages, written or not yet (this page lists itself on its first run)
            found |= {f"docs/{name}" for name in PAGE_NAMES}
        out.append((group, sorted(found)))
    return out


def files_page(root: Path | None = None) -> str:
    """One line per file of the project (``FILE_GROUPS``): the first sentence of a module's docstring, of a
    migration's leading comment, or the file's ``FILE_NOTES`` entry. Every undescribed file is named at once."""
    root = root or ROOT
    lines = header("Files", "each module's docstring, each migration's leading comment and `FILE_NOTES`")
    lines += [
        "One line per file: what it is for. Python modules and migrations describe themselves (the first sentence of "
        "the docstring or the leading comment); other files have a line in `FILE_NOTES` of "
        "[`docs/gen_files.py`](../gen_files.py).",
        "",
    ]
    missing = []
    for group, files in listed_files(root):
        lines += [f"## {group}", "", "| file | what it is |", "|---|---|"]
        for rel in files:
            try:
                text = describe_file(root, rel)
            except UndescribedFile as e:
                missing.append(str(e))
                continue
            lines.append(f"| [`{rel}`](../../{rel}) | {cell(text)} |")
        lines.append("")
    if missing:
        raise UndescribedFile("files without a line on the files page:\n" + "\n".join(missing))
    return "\n".join(lines).rstrip("\n") + "\n"
