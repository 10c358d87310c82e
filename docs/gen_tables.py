"""The topics and tables page (docs/reference/topics-and-tables.md): Kafka topics, ClickHouse tables and views.

Kafka topic specs come from ``schemas/topics.py``; ClickHouse tables from the records ``rtrl.clickhouse.TABLES``
names (columns derived by ``schemas.types``) and the DDL in ``schemas/migrations/`` (engine, keys, comments);
views from their SQL.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from pathlib import Path

from docs.gen_markdown import ROOT, cell, code, header
from docs.gen_records import encoding_name, record_anchor


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside parentheses, brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _top_keyword(text: str, word: str, start: int = 0) -> int:
    """Index of ``word`` (a whole SQL keyword) outside parentheses and quotes, from ``start``; -1 if none."""
    depth, quote = 0, ""
    pattern = re.compile(rf"\b{word}\b", re.IGNORECASE)
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and pattern.match(text, i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            return i
    return -1


class Statement(typing.NamedTuple):
    migration: str  # file name
    comment: tuple[str, ...]  # the lines of the comment block right above it, without the leading "-- "
    sql: str  # without comments, whitespace kept


def comment_markdown(lines: Sequence[str], db: str) -> list[str]:
    """A SQL comment block as Markdown: prose lines joined, indented lines (examples) as a SQL code block;
    ``{db}`` as the default database name."""
    out: list[str] = []
    prose: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if prose:
            out.extend([" ".join(prose), ""])
            prose.clear()
        if block:
            out.extend(["```sql", *block, "```", ""])
            block.clear()

    for raw in lines:
        line = raw.replace("{db}", db)
        if line.startswith("  ") and line.strip():
            if prose:
                flush()
            block.append(line.strip())
        elif not line.strip():
            flush()
        else:
            if block:
                flush()
            prose.append(line.strip())
    flush()
    return out


def sql_statements(folder: Path) -> list[Statement]:
    """Each statement of each migration file (in version order) with the comment block right above it."""
    out = []
    for path in sorted(folder.glob("*.sql")):
        comment: list[str] = []
        current: list[str] = []
        above: tuple[str, ...] = ()
        for raw in path.read_text(encoding="utf-8").splitlines():
            line = raw.rstrip()
            if not current:
                if line.startswith("--"):
                    comment.append(line[3:] if line.startswith("-- ") else line[2:])
                    continue
                if not line.strip():
                    comment = []
                    continue
                above = tuple(comment)
                comment = []
            if line.lstrip().startswith("--"):
                continue
            current.append(re.sub(r"\s--\s.*$", "", line))
            if line.endswith(";"):
                out.append(Statement(path.name, above, "\n".join(current).rstrip(";")))
                current = []
    return out


_CREATE_TABLE = re.compile(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?\{db\}\.(\w+)\s*\(", re.IGNORECASE)
_CREATE_VIEW = re.compile(r"CREATE\s+VIEW\s+(?:IF\s+NOT\s+EXISTS\s+)?\{db\}\.(\w+)\s+AS\b", re.IGNORECASE)
_ALTER = re.compile(r"ALTER\s+TABLE\s+\{db\}\.(\w+)\s+(.*)", re.IGNORECASE | re.DOTALL)


def _table_parts(sql: str) -> dict[str, str]:
    """Columns body, engine, PARTITION BY and ORDER BY of a CREATE TABLE statement."""
    m = _CREATE_TABLE.search(sql)
    assert m is not None
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(sql[i], 0)
        i += 1
    body, rest = sql[m.end() : i - 1], " ".join(sql[i:].split())
    out = {"columns": body}
    for key, pat in (
        ("engine", r"ENGINE\s*=\s*(.+?)(?=\s+(?:PARTITION BY|ORDER BY|PRIMARY KEY|SETTINGS)\b|$)"),
        ("partition", r"PARTITION BY\s+(.+?)(?=\s+(?:ORDER BY|PRIMARY KEY|SETTINGS)\b|$)"),
        ("order", r"ORDER BY\s+(.+?)(?=\s+(?:PRIMARY KEY|SETTINGS)\b|$)"),
    ):
        found = re.search(pat, rest, re.IGNORECASE)
        out[key] = found.group(1).strip() if found else ""
    return out


def view_columns(sql: str) -> list[tuple[str, str]]:
    """(column, expression) of a view's outer SELECT list, read from its SQL."""
    m = _CREATE_VIEW.search(sql)
    body = sql[m.end() :] if m else sql
    select = _top_keyword(body, "SELECT")
    if select < 0:
        return []
    end = _top_keyword(body, "FROM", select)
    items = _split_top(body[select + len("SELECT") : end if end >= 0 else len(body)])
    out = []
    for item in items:
        expr = " ".join(item.split())
        alias = re.search(r"\bAS\s+([A-Za-z_][A-Za-z0-9_]*)\s*$", expr, re.IGNORECASE)
        if alias and _top_keyword(expr, "AS", alias.start()) == alias.start():
            out.append((alias.group(1), expr[: alias.start()].strip()))
        else:
            out.append((expr.rsplit(".", 1)[-1], expr))
    return out


def topics_tables_page(migrations: Path | None = None) -> str:
    """Kafka topics (``schemas.topics.TOPICS``), ClickHouse tables and views (``schemas/migrations``)."""
    from rtrl.clickhouse import ANALYST_TABLES, TABLES
    from rtrl.settings import Settings
    from schemas.topics import TOPICS
    from schemas.types import columns

    folder = migrations or ROOT / "schemas" / "migrations"
    k = Settings.model_fields["kafka"].annotation.model_fields  # type: ignore[union-attr]  # a section model
    db = Settings.model_fields["clickhouse"].annotation.model_fields["database"].default  # type: ignore[union-attr]
    prefix = k["topic_prefix"].default
    lines = header("Kafka topics and ClickHouse tables", "schemas/topics.py, schemas/migrations/ and schemas/types.py")
    lines += [
        "## Kafka topics",
        "",
        f"Names are `kafka.topic_prefix` (default `{prefix}`) + the name. `rtrl topics` (and every job that sets the "
        "services up) creates missing topics with these specs, `kafka.replication_factor` replicas (default "
        f"{k['replication_factor'].default}) and, when above 1, `min.insync.replicas` = `kafka.min_insync_replicas`; "
        "existing topics are checked against the partitions and replication factor. Producers are idempotent "
        "(`acks=all`) and compress with `kafka.compression`.",
        "",
        "| topic | record | key | partitions | retention | cleanup.policy | payload |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in TOPICS:
        n_parts = str(t.partitions) if t.partitions else f"`kafka.partitions` (default {k['partitions'].default})"
        days = t.retention_ms / 86_400_000
        keep = "forever" if t.retention_ms < 0 else f"{days:g} day{'s' if days != 1 else ''}"
        payload = encoding_name(t.encoding)
        record = "Event" if t.record == "Event" else t.record
        lines.append(
            f"| `{prefix}{t.name}` | [`{record}`](records.md#{record.lower()}) | `{t.key}` | {n_parts} | {keep} "
            f"| `{t.cleanup_policy}` | {payload} |"
        )
    lines += [""]
    statements = sql_statements(folder)
    created: dict[str, Statement] = {}
    altered: dict[str, list[str]] = {}
    views: list[tuple[str, Statement]] = []
    for st in statements:
        if m := _CREATE_TABLE.search(st.sql):
            created[m.group(1)] = st
        elif m := _CREATE_VIEW.search(st.sql):
            views.append((m.group(1), st))
        elif m := _ALTER.search(st.sql):
            altered.setdefault(m.group(1), [])
            if st.migration not in altered[m.group(1)]:
                altered[m.group(1)].append(st.migration)
    lines += [
        "## ClickHouse tables",
        "",
        f"In the database `clickhouse.database` (default `{db}`), created by `rtrl migrate` (and every job that sets "
        "the services up) from [`schemas/migrations/`](../../schemas/migrations/), each file once, in order "
        f"(recorded in `{db}.schema_migrations`). The columns below are derived from the records "
        "(`schemas/types.py`); the migrations are checked against them by the tests and at start-up "
        "(`rtrl.clickhouse.verify`). Every table is a ReplacingMergeTree on the record's natural key: read with "
        "`FINAL`, a replayed row replaces itself.",
        "",
        "| table | record | engine | ORDER BY | analysts may read |",
        "|---|---|---|---|---|",
    ]
    names = list(created) + [n for n in TABLES if n not in created]
    for name in names:
        ddl = created.get(name)
        parts = _table_parts(ddl.sql) if ddl else {"engine": "", "order": ""}
        rec = TABLES.get(name)
        rec_name = ("Event" if record_anchor(rec) == "event" else rec.__name__) if rec else ""
        rec_link = f"[`{rec_name}`](records.md#{record_anchor(rec)})" if rec else ""
        lines.append(
            f"| [`{name}`](#{name}) | {rec_link} | {code(parts['engine'])} | {code(parts['order'])} "
            f"| {'yes' if name in ANALYST_TABLES else 'no'} |"
        )
    lines.append("")
    for name in names:
        ddl = created.get(name)
        lines += [f"### {name}", ""]
        if ddl and ddl.comment:
            lines += comment_markdown(ddl.comment, db)
        if ddl:
            parts = _table_parts(ddl.sql)
            facts = [f"Engine `{parts['engine']}`"]
            if parts["partition"]:
                facts.append(f"PARTITION BY `{parts['partition']}`")
            facts.append(f"ORDER BY `{parts['order']}`")
            where = f"[`{ddl.migration}`](../../schemas/migrations/{ddl.migration})"
            more = altered.get(name, [])
            if more:
                where += ", columns added by " + ", ".join(f"[`{m}`](../../schemas/migrations/{m})" for m in more)
            lines += [f"{', '.join(facts)}. Created by {where}.", ""]
        rec = TABLES.get(name)
        if rec is not None:
            lines += ["| column | ClickHouse type | what it is |", "|---|---|---|"]
            lines += [f"| `{c.name}` | {code(c.clickhouse)} | {cell(c.doc)} |" for c in columns(rec)]
        elif ddl:
            lines += ["| column | ClickHouse type |", "|---|---|"]
            for col in _split_top(_table_parts(ddl.sql)["columns"]):
                col_name, _, col_type = col.partition(" ")
                lines.append(f"| `{col_name}` | {code(col_type)} |")
        lines.append("")
    if views:
        lines += [
            "## ClickHouse views",
            "",
            "Plain (not materialized) views: computed at query time from the tables read with `FINAL`. Analyst "
            "queries over them: [`monitors/ANALYST_QUERIES.md`](../../monitors/ANALYST_QUERIES.md).",
            "",
        ]
        for name, st in views:
            lines += [f"### {name}", ""]
            if st.comment:
                lines += comment_markdown(st.comment, db)
            else:
                lines += [
                    f"Described in the header comment of [`{st.migration}`](../../schemas/migrations/{st.migration}).",
                    "",
                ]
            sources = sorted(set(re.findall(r"\{db\}\.(\w+)", st.sql.split(" AS", 1)[-1])))
            params = re.findall(r"\{(\w+):(\w+)\}", st.sql)
            said = f"Reads {', '.join(f'`{s}`' for s in sources)}" if sources else "Reads no table"
            if params:
                said += "; parameters " + ", ".join(f"`{n}` ({t})" for n, t in params)
                said += f" (query it as `{db}.{name}({', '.join(f'{n} = ...' for n, _ in params)})`)"
            said += f". Created by [`{st.migration}`](../../schemas/migrations/{st.migration})."
            lines += [
                said,
                "",
                "| column | expression |",
                "|---|---|",
                *[f"| `{c}` | {code(e)} |" for c, e in view_columns(st.sql)],
                "",
            ]
    return "\n".join(lines).rstrip("\n") + "\n"
