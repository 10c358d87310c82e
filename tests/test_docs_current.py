"""docs/ stays true to the code (fast: no services, no subprocesses).

Contract pinned here:

- the generated reference pages (docs/reference/*.md) equal what ``docs/generate.py`` (and the ``docs/gen_*.py``
  page builders it calls) makes from the code now;
  a page that differs fails with the page named and the command that regenerates it;
- the generator really reads the code: a settings tree with one more field, a parser with one more command
  (nested subcommands too), one more record, one more migration each change the page they feed, and its
  output depends on nothing of the machine (environment, COLUMNS, working folder);
- the files page (docs/reference/files.md) has one line per file, read from the file's own docstring, leading
  comment or opening paragraph; a file with none fails the page, named;
- ``--check`` exits 1 naming each stale page;
- docs/architecture.png is a 1600 x 1000 PNG;
- every relative link (and image) in docs/**/*.md and README.md points at a file in the repository, never
  outside it (``../`` past the root), and a link to a heading of a page points at a heading that exists.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import struct
from pathlib import Path
from typing import Annotated

import msgspec
import pytest
from pydantic import Field

import app.cli
from docs import gen_commands, gen_files, gen_markdown, gen_records, gen_settings, gen_tables
from docs import generate as gen
from rtrl.config import KafkaSettings
from rtrl.section import setting
from rtrl.settings import Settings
from schemas.fields import Label, doc
from schemas.records import RECORDS

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = ".venv/bin/python -m docs.generate"


def _first_difference(have: str, want: str) -> str:
    diff = difflib.unified_diff(have.splitlines(), want.splitlines(), "on disk", "from the code", n=0, lineterm="")
    return "\n".join(list(diff)[:12])


# ---------------------------------------------------------------- the pages are current


def test_reference_pages_are_current():
    """Each generated page on disk equals what the generator makes from the code now."""
    stale = []
    for name, text in gen.pages().items():
        path = ROOT / "docs" / name
        have = path.read_text(encoding="utf-8") if path.exists() else ""
        if have != text:
            stale.append(f"docs/{name}:\n{_first_difference(have, text)}")
    assert not stale, (
        f"generated docs are out of date with the code; fix: run `{REGENERATE}` and commit the result\n"
        + "\n".join(stale)
    )


def test_output_depends_on_nothing_of_the_machine(monkeypatch, tmp_path):
    """No environment variable, terminal width or working folder changes a page; no absolute path is in one."""
    first = gen.pages()
    monkeypatch.setenv("COLUMNS", "37")
    monkeypatch.setenv("RTRL_KAFKA__BOOTSTRAP", "10.1.2.3:9092")
    monkeypatch.setenv("RTRL_DATA_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("RTRL_TRAIN__TORCH_THREADS", "3")
    monkeypatch.chdir(tmp_path)
    assert gen.pages() == first
    for name, text in first.items():
        assert str(ROOT) not in text, name
        if len(Path.home().parts) > 1:  # a user without a home folder has HOME=/, which every path contains
            assert str(Path.home()) not in text, name
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{name} holds a date"


def test_check_exits_1_naming_each_stale_page(monkeypatch, tmp_path, capsys):
    """``--check`` writes nothing and names the stale page; with every page current it exits 0."""
    pages = gen.pages()
    for name, text in pages.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text, encoding="utf-8")
    monkeypatch.setattr(gen, "DOCS", tmp_path / "docs")
    assert gen.main(["--check"]) == 0
    victim = tmp_path / "docs" / "reference" / "settings.md"
    victim.write_text(pages["reference/settings.md"].replace("kafka.bootstrap", "kafka.bootstrp"), encoding="utf-8")
    capsys.readouterr()
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: docs/reference/settings.md" in err and "docs.generate" in err
    assert "commands.md" not in err
    assert "bootstrp" in victim.read_text(encoding="utf-8"), "--check must not write"


def test_make_docs_writes_every_page_and_the_diagram(monkeypatch, tmp_path, capsys):
    """``make docs`` (``python -m docs.generate``): into an empty folder it writes every page, equal to what
    ``--check`` compares against, and draws the diagram; a second run rewrites no page."""
    monkeypatch.setattr(gen, "DOCS", tmp_path / "docs")
    assert gen.main([]) == 0
    for name, text in gen.pages().items():
        assert (tmp_path / "docs" / name).read_text(encoding="utf-8") == text, name
    assert (tmp_path / "docs" / gen.DIAGRAM).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert gen.main(["--no-diagram"]) == 0 and "wrote" not in capsys.readouterr().out
    assert gen.main(["--check"]) == 0


# ---------------------------------------------------------------- the generator reads the code


def test_a_new_setting_changes_the_settings_page():
    class Kafka2(KafkaSettings):
        sasl_mechanism: str = setting("", "SASL mechanism of the brokers (test-only setting)")

    class Settings2(Settings):
        kafka: Kafka2 = Field(default_factory=Kafka2)

    before, after = gen_settings.settings_page(), gen_settings.settings_page(Settings2)
    assert after != before
    row = next(line for line in after.splitlines() if "`kafka.sasl_mechanism`" in line)
    assert "`RTRL_KAFKA__SASL_MECHANISM`" in row and "SASL mechanism of the brokers" in row and '`""`' in row


def test_every_setting_is_on_the_settings_page():
    from rtrl.settings import describe, env_name

    page = gen_settings.settings_page()
    for name, _, help_text in describe():
        row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} is not on the settings page"
        assert f"`{env_name(name)}`" in row and gen_markdown.cell(help_text) in row


def test_a_new_command_changes_the_commands_page(monkeypatch):
    """A command added to ``app.cli.parser()`` (with an argument and nested subcommands) shows up."""
    real = app.cli.parser

    def parser() -> argparse.ArgumentParser:
        p = real()
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        extra = sub.add_parser("frobnicate", help="frobnicate the widgets", description="Frobnicate them all.")
        extra.add_argument("--widgets", type=int, default=3, help="how many (default: %(default)s)")
        nested = extra.add_subparsers(dest="how", title="how")
        nested.add_parser("gently", help="one by one").add_argument("--pause-s", help="seconds between two")
        return p

    before = gen_commands.commands_page()
    monkeypatch.setattr(app.cli, "parser", parser)
    after = gen_commands.commands_page()
    assert after != before
    assert "[`rtrl frobnicate`](#rtrl-frobnicate)" in after and "frobnicate the widgets" in after
    assert "how many (default: 3)" in after
    assert "### `rtrl frobnicate gently`" in after and "seconds between two" in after


def test_commands_page_lists_every_command_and_argument():
    p = app.cli.parser()
    page = gen_commands.commands_page()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, cmd in sub.choices.items():
        assert f"## `rtrl {name}`" in page
        for a in cmd._actions:
            if a.help and a.help is not argparse.SUPPRESS and a.default is not argparse.SUPPRESS:
                if not isinstance(a, argparse._HelpAction):
                    assert gen_commands._argument_name(a) in page, f"rtrl {name} {a.dest}"


def test_a_new_record_changes_the_records_page():
    class Audit(msgspec.Struct, kw_only=True, frozen=True):
        """Who looked at what (test-only record)."""

        who: Annotated[Label, doc("The analyst's name.")]
        rows: Annotated[int, msgspec.Meta(ge=0), doc("Rows read.")] = 0

    page = gen_records.records_page([*RECORDS, Audit])
    assert page != gen_records.records_page()
    assert "## Audit" in page and "Who looked at what (test-only record)." in page
    assert "| `who` | `label` | 1..128 chars | required |" in page
    assert "| `rows` | `int` | 0 <= x | `0` |" in page and "Rows read." in page


def test_every_record_field_and_its_doc_is_on_the_records_page():
    from schemas.records import EVENT_TYPES
    from schemas.types import field_docs

    page = gen_records.records_page()
    for cls in (*RECORDS, *EVENT_TYPES):
        for name, text in field_docs(cls).items():
            assert f"| `{name}` |" in page and gen_markdown.cell(text) in page, f"{cls.__name__}.{name}"


def test_a_new_migration_changes_the_topics_and_tables_page(tmp_path):
    folder = tmp_path / "migrations"
    shutil.copytree(ROOT / "schemas" / "migrations", folder)
    (folder / "0999_audit.sql").write_text(
        "-- Who looked at what.\n"
        "CREATE TABLE IF NOT EXISTS {db}.audit\n(\n    who LowCardinality(String),\n    rows UInt64\n)\n"
        "ENGINE = ReplacingMergeTree\nORDER BY who;\n\n"
        "-- Reads per analyst.\n"
        "CREATE VIEW IF NOT EXISTS {db}.audit_totals AS\nSELECT who, sum(rows) AS total_rows\n"
        "FROM {db}.audit FINAL\nGROUP BY who;\n",
        encoding="utf-8",
    )
    page = gen_tables.topics_tables_page(folder)
    assert page != gen_tables.topics_tables_page()
    assert "### audit" in page and "Who looked at what." in page
    assert "| `who` | `LowCardinality(String)` |" in page and "| `rows` | `UInt64` |" in page
    assert "### audit_totals" in page and "| `total_rows` | `sum(rows)` |" in page and "| `who` | `who` |" in page


def test_every_table_and_topic_is_on_the_topics_and_tables_page():
    from rtrl.clickhouse import TABLES
    from schemas.topics import TOPICS
    from schemas.types import columns

    page = gen_tables.topics_tables_page()
    for t in TOPICS:
        assert f"| `rtrl.{t.name}` |" in page
    for table, cls in TABLES.items():
        assert f"### {table}" in page
        for c in columns(cls):
            assert f"| `{c.name}` | {gen_markdown.code(c.clickhouse)} |" in page, f"{table}.{c.name}"


def _tiny_repo(root: Path) -> None:
    """A repository with one file of each kind the files page describes."""
    (root / "app").mkdir(parents=True)
    (root / "app" / "cli.py").write_text('"""The command line. More prose here."""\n', encoding="utf-8")
    (root / "schemas" / "migrations").mkdir(parents=True)
    (root / "schemas" / "migrations" / "0001_init.sql").write_text("-- The tables.\nCREATE TABLE t;\n")
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text("# Guide\n\nThis page explains it. Then more.\n", encoding="utf-8")


def test_the_files_page_describes_each_file_from_its_own_text(tmp_path):
    """A module's docstring, a migration's comment and a guide's opening give their first sentence; a new module
    changes the page."""
    _tiny_repo(tmp_path)
    page = gen_files.files_page(tmp_path)
    assert "| [`app/cli.py`](../../app/cli.py) | The command line. |" in page
    assert "| [`schemas/migrations/0001_init.sql`](../../schemas/migrations/0001_init.sql) | The tables. |" in page
    assert "| [`docs/guide.md`](../../docs/guide.md) | This page explains it. |" in page
    (tmp_path / "app" / "loop.py").write_text('"""The closed loop."""\n', encoding="utf-8")
    assert "The closed loop." in gen_files.files_page(tmp_path)


def test_an_undescribed_file_fails_the_files_page_naming_it(tmp_path):
    """A module without a docstring, or another file without a ``FILE_NOTES`` line, fails with its name."""
    _tiny_repo(tmp_path)
    (tmp_path / "app" / "bare.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "new.png").write_bytes(b"\x89PNG")
    with pytest.raises(gen_files.UndescribedFile) as e:
        gen_files.files_page(tmp_path)
    assert "app/bare.py has no module docstring" in str(e.value) and "bench/new.png" in str(e.value)


def test_every_module_of_the_project_is_on_the_files_page():
    page = gen_files.files_page()
    for pkg in ("app", "client", "evalgate", "flows", "monitors", "rewards", "rtrl", "schemas", "simulator"):
        for path in sorted((ROOT / pkg).glob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            assert f"| [`{rel}`](../../{rel}) |" in page, f"{rel} is not on the files page"
    for rel in (
        "trainer/loss.py",
        "devservices/chserver/__init__.py",
        "tests/conftest.py",
        "deploy/RUNBOOK.md",
        "Makefile",
    ):
        assert f"| [`{rel}`](../../{rel}) |" in page, f"{rel} is not on the files page"


def test_shorten_cuts_at_a_clause_outside_parentheses():
    text = "A thing (with, commas inside), then a long tail, " + "word " * 40
    short = gen_files.shorten(text, 60)
    assert short == "A thing (with, commas inside), then a long tail ..." and len(short) <= 64
    assert gen_files.shorten("short.", 60) == "short."
    assert gen_files.first_sentence("One line\nwrapped. Second sentence.\n\nNext paragraph.") == "One line wrapped."


# ---------------------------------------------------------------- the diagram and the links


def test_architecture_diagram_is_a_png():
    data = (ROOT / "docs" / "architecture.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "docs/architecture.png is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1600, 1000)


def _markdown_files() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)


def _links(text: str) -> list[str]:
    prose = gen_markdown.strip_code_blocks(text)
    prose = re.sub(r"(`+)(?:(?!\1).)+?\1", "", prose)  # inline code spans hold no links
    return _INLINE.findall(prose) + _REFERENCE.findall(prose)


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))  # http:, https:, mailto: ...


def test_markdown_files_to_check_exist():
    for name in ("README.md", "design.md", "architecture.md", "production.md", "troubleshooting.md", "concepts.md"):
        assert (ROOT / "docs" / name).exists(), f"docs/{name} is missing"


def link_problems(md: Path, root: Path) -> list[str]:
    """What is wrong with the relative links of ``md``: absolute paths, escapes from ``root``, missing files."""
    problems = []
    where = md.relative_to(root)
    for target in _links(md.read_text(encoding="utf-8")):
        if _is_external(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path.startswith("/"):
            problems.append(f"{where}: {target} is an absolute path (use a path relative to the page)")
            continue
        resolved = (md.parent / path).resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{where}: {target} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: {target} does not exist")
    return problems


def test_relative_links_point_inside_the_repository():
    problems = [p for md in _markdown_files() for p in link_problems(md, ROOT)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_links_to_headings_find_them():
    problems = []
    for md in _markdown_files():
        text = md.read_text(encoding="utf-8")
        for target in _links(text):
            if _is_external(target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            page = (md.parent / path).resolve() if path else md
            if page.suffix != ".md" or not page.exists():
                continue
            if anchor not in gen_markdown.anchors(page.read_text(encoding="utf-8")):
                problems.append(f"{md.relative_to(ROOT)}: {target} names no heading of {page.relative_to(ROOT)}")
    assert not problems, "links to missing headings:\n" + "\n".join(problems)


def test_link_checks_catch_escapes_and_missing_files(tmp_path):
    """The link checks are not vacuous: an escaping link, an absolute one and a missing file are caught; code
    spans and external links are left alone."""
    text = "[a](../../etc/passwd) [b](missing.md) `[c](not-a-link.md)` [d](https://example.com) [e](/etc/hosts)\n"
    assert _links(text) == ["../../etc/passwd", "missing.md", "https://example.com", "/etc/hosts"]
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "there.md").write_text("# There\n", encoding="utf-8")
    page = root / "docs" / "page.md"
    page.write_text(text + "[ok](there.md) [up](../docs/there.md)\n", encoding="utf-8")
    problems = link_problems(page, root)
    assert len(problems) == 3, problems
    assert "outside the repository" in problems[0] and "does not exist" in problems[1] and "absolute" in problems[2]
    assert "rtrl-run" in gen_markdown.anchors("## `rtrl run`\n") and "kafka" in gen_markdown.anchors("## kafka\n")
    assert gen_markdown.anchors("## a\n## a\n```\n## not a heading\n```\n") == {"a", "a-1"}
