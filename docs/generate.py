"""Generate the reference pages under docs/reference/ (and the diagram docs/architecture.png) from the code.

    .venv/bin/python -m docs.generate            write every page and the diagram
    .venv/bin/python -m docs.generate --check    exit 1 naming each page that differs from the code (no writes)
    python docs/generate.py [--check]            the same

Pages, each built by its own module (its docstring says what the page is read from):

- ``reference/settings.md``: ``docs/gen_settings.py`` (``rtrl/settings.py``, ``app/loop_config.py``).
- ``reference/commands.md``: ``docs/gen_commands.py`` (``app.cli.parser()``).
- ``reference/records.md``: ``docs/gen_records.py`` (``schemas/records.py``).
- ``reference/topics-and-tables.md``: ``docs/gen_tables.py`` (``schemas/topics.py``, ``schemas/migrations/``).
- ``reference/files.md``: ``docs/gen_files.py`` (each file's docstring, leading comment or ``FILE_NOTES``).
- ``architecture.png``: ``docs/gen_diagram.py``.

They share ``docs/gen_markdown.py`` (table cells, code spans, headers, heading ids). Imports go one way: this
module imports the builders, the builders import ``gen_markdown`` (and ``gen_tables`` imports ``gen_records``),
``gen_markdown`` imports none of them.

The output is deterministic: no dates, no absolute paths, nothing read from the environment or the
machine (defaults are the ones written in the code). The diagram is not compared by ``--check``: its pixels
depend on the fonts and matplotlib version that draw it.

docs/ is a dev-only folder (a namespace package: no ``__init__.py``, so tests/test_architecture.py does not
count it as a production package); nothing of the product imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

_REPOSITORY = str(Path(__file__).resolve().parent.parent)
if _REPOSITORY not in sys.path:  # `python docs/generate.py` puts docs/ first, not the repository root
    sys.path.insert(0, _REPOSITORY)

from docs.gen_commands import commands_page  # noqa: E402
from docs.gen_diagram import draw_architecture  # noqa: E402
from docs.gen_files import files_page  # noqa: E402
from docs.gen_markdown import PAGE_NAMES, REGENERATE, ROOT  # noqa: E402
from docs.gen_records import records_page  # noqa: E402
from docs.gen_settings import settings_page  # noqa: E402
from docs.gen_tables import topics_tables_page  # noqa: E402

# ---------------------------------------------------------------- pages, check, main

#: page (relative to docs/) -> its builder
PAGES: dict[str, Callable[[], str]] = dict(
    zip(PAGE_NAMES, (settings_page, commands_page, records_page, topics_tables_page, files_page), strict=True)
)
DIAGRAM = "architecture.png"
#: where the pages are written and checked (docs/ of this repository)
DOCS = ROOT / "docs"


def pages() -> dict[str, str]:
    """Every generated page's text, by path relative to docs/."""
    return {name: build() for name, build in PAGES.items()}


def stale(docs: Path | None = None) -> list[str]:
    """The pages (relative to docs/) whose file is missing or differs from what the code generates."""
    docs = docs or DOCS
    out = []
    for name, text in pages().items():
        path = docs / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m docs.generate", description="generate docs/reference/ from the code")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale page")
    p.add_argument("--no-diagram", action="store_true", help="write the pages only, not docs/architecture.png")
    args = p.parse_args(argv)
    docs = DOCS
    if args.check:
        bad = stale(docs)
        for name in bad:
            print(f"stale: docs/{name}", file=sys.stderr)
        if bad:
            print(f"fix: run {REGENERATE.strip('`')} and commit the result", file=sys.stderr)
            return 1
        print(f"docs/reference is current ({len(PAGES)} pages)")
        return 0
    for name, text in pages().items():
        path = docs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote docs/{name}")
    if not args.no_diagram:
        draw_architecture(docs / DIAGRAM)
        print(f"drew docs/{DIAGRAM}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
