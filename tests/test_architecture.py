"""The import order of rtrl's packages: floors that only look down.

Contract pinned here (every module's imports are parsed, including imports inside functions):

- ``ORDER`` ranks the top-level packages from the bottom: records, the foundation, the data plane
  (pure logic first), the application. A package may import only packages ranked at or below it.
- No cycle exists between top-level packages (a strictly ranked order already forbids one; the
  cycle check reports the path, which is what a reader needs when the order test fails).
- ``rtrl.sections`` holds every component's settings section, one module per package that reads it; :mod:`rtrl.settings` composes them into
  the tree. A section loads nothing but :mod:`rtrl.section`, :mod:`rtrl.errors`, records, pure modules and other
  sections, and no I/O library.
- ``devservices`` (the local broker wrapper, the embedded ClickHouse HTTP front) is dev-only: it
  may import the foundation and records, and only ``app.services`` (the embedded defaults), tests
  and benchmarks may import it - no production code path does.
- Pure modules (windows, rewards, batching, loss, dedup, alerts, the eval gate) import no I/O
  library, directly or through any project module they import (packages' ``__init__`` included),
  and no project module that does I/O (Kafka, ClickHouse, sinks, the trainer's input stream).
- Imports under ``if TYPE_CHECKING:`` never run: they are annotations' names, not edges.
- No cycle exists between modules either: a module imports another that imports it back, directly or through
  others, neither at the top nor inside a function. An import of ``a.b.c`` is an edge to the deepest module it
  names and to the packages above it, whose ``__init__`` runs first, except the importer's own.
- No hand-written source file is longer than :data:`MAX_LINES` lines: Python, shell and SQL files under git,
  tests, benchmarks and docs' generator included. Generated files (the reference pages, the cluster DDL, the
  manifests) are not hand-written. :data:`LONG_FILES` lists the files still to split, each with its reason; a
  file that fits again must leave the list.
- The README's architecture section lists the layers in the same order.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: bottom to top; a package may import itself and anything earlier in this list
ORDER = [
    # records
    "schemas",
    # foundation: settings, errors, Kafka and ClickHouse access
    "rtrl",
    # data plane
    "rewards",
    "monitors",
    "evalgate",
    "client",
    "flows",
    "trainer",
    "simulator",
    # application: CLI, loop, parts, supervisor, report, A/B
    "app",
]
LAYERS = {
    "records": ["schemas"],
    "foundation": ["rtrl"],
    "data plane": ["rewards", "monitors", "evalgate", "client", "flows", "trainer", "simulator"],
    "application": ["app"],
}
DEV = "devservices"
DEV_MAY_IMPORT = {"schemas", "rtrl"}
DEV_IMPORTERS = {"app.services"}
PURE = [
    "flows.windowing",
    "flows.batching",
    "flows.processor",
    "rewards",
    "trainer.loss",
    "trainer.dedup",
    "trainer.batch",
    "monitors.alerts",
    "monitors.reward_compare",
    "evalgate",
    "rtrl.clickhouse_cluster",
    "client.hashing",
    "simulator.generate",
    "simulator.population",
]
#: project modules whose job is I/O: a pure module may not reach them
IO_MODULES = {"rtrl.kafka", "rtrl.clickhouse", "flows.sinks", "flows.kafka_io", "trainer.data", "app", "devservices"}
IO_LIBS = {
    "confluent_kafka",
    "clickhouse_connect",
    "chdb",
    "socket",
    "subprocess",
    "requests",
    "urllib",
    "http",
    "bytewax",
    "noida_db",
}
#: pure parts of those libraries (string parsing): ``urllib.parse`` splits a DSN, it opens nothing
PURE_LIBS = ("urllib.parse",)
PACKAGES = ORDER + [DEV]
#: the settings sections beside their components, and their base: the foundation's loader imports them
CONFIGS = {
    "rtrl.section",
    "rtrl.config",
    "rtrl.sections.rewards",
    "rtrl.sections.client",
    "rtrl.sections.flows",
    "rtrl.sections.trainer",
}
CONFIGS |= {"rtrl.sections.simulator", "rtrl.sections.app"}
CONFIG_PACKAGES = {m.split(".")[0] for m in CONFIGS}
#: what a config may load besides other configs, records and pure modules (a package's ``__init__`` may load its
#: pure core: ``rewards``, ``simulator``)
CONFIG_MAY_LOAD = {"rtrl", "rtrl.errors"}
#: the longest a hand-written source file may be
MAX_LINES = 800
#: hand-written files still over MAX_LINES, with why; a file that fits again must leave the list
LONG_FILES: dict[str, str] = {}
#: files a program writes (their generator is checked instead)
GENERATED = ("deploy/clickhouse/cluster.sql", "deploy/k8s/", "docs/reference/")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: they never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and (ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every absolute module name ``module`` imports (top of file or inside functions, never under
    ``if TYPE_CHECKING:``), with its line."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            found += [(f"{name}.{a.name}", node.lineno) for a in node.names]  # `from pkg import module`
    return found


MODULES = _modules()


def _edges() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> ["module:line", ...] (only imports of our own packages)."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in MODULES.items():
        src = module.split(".")[0]
        for name, line in _imports(module, path):
            dst = name.split(".")[0]
            if dst in PACKAGES and dst != src:
                edges[src][dst].append(f"{module}:{line}")
    return edges


def test_configs_load_only_configs():
    """Every config loads, with its packages' ``__init__``, only configs, records, rtrl.section, rtrl.errors and
    pure modules: the loader imports them all without loading a component that does I/O."""
    assert CONFIGS <= set(MODULES), f"no such config module: {CONFIGS - set(MODULES)}"
    on_disk = {m for m in MODULES if m.endswith(".config") and m.count(".") == 1}
    assert on_disk <= CONFIGS, f"list these in CONFIGS: {on_disk - CONFIGS}"
    allowed = CONFIGS | CONFIG_MAY_LOAD | CONFIG_PACKAGES
    pure = tuple(PURE)
    bad = [
        f"{config} loads {mod} (imported by {via})"
        for config in sorted(CONFIGS)
        for mod, via in _reached(config).items()
        if mod not in allowed and mod.split(".")[0] != "schemas" and not (mod in pure or mod.startswith(pure))
    ]
    bad += [
        f"{config} loads {mod}:{line}, which imports {name}"
        for config in sorted(CONFIGS)
        for mod in _reached(config)
        for name, line in _imports(mod, MODULES[mod])
        if name.split(".")[0] in IO_LIBS and not name.startswith(PURE_LIBS)
    ]
    assert not bad, "a config must load no component and no I/O (move what it needs into a config):\n" + "\n".join(bad)


def test_every_package_is_placed():
    """Each top-level Python package of the project appears in the order (a new one must be placed)."""
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert on_disk == set(PACKAGES), f"place these packages in tests/test_architecture.py: {on_disk ^ set(PACKAGES)}"
    assert [p for layer in LAYERS.values() for p in layer] == ORDER


def test_imports_follow_the_order():
    rank = {p: i for i, p in enumerate(ORDER)}
    wrong = [
        f"{src} imports {dst} ({', '.join(where)})"
        for src, dsts in _edges().items()
        if src in rank
        for dst, where in dsts.items()
        if dst in rank and rank[dst] > rank[src]
    ]
    assert not wrong, "imports against the order (a lower floor may not import a higher one):\n" + "\n".join(wrong)


def test_no_cycles_between_packages():
    edges = {src: set(dsts) for src, dsts in _edges().items()}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = {" -> ".join(c) for p in PACKAGES if (c := cycle_from(p))}
    assert not cycles, "import cycles between packages:\n" + "\n".join(sorted(cycles))


def test_dev_services_stay_apart():
    edges = _edges()
    bad = [f"devservices imports {dst} ({', '.join(w)})" for dst, w in edges[DEV].items() if dst not in DEV_MAY_IMPORT]
    for module, path in MODULES.items():
        if module.split(".")[0] == DEV or module in DEV_IMPORTERS:
            continue
        bad += [f"{module}:{line} imports {name}" for name, line in _imports(module, path) if name.split(".")[0] == DEV]
    assert not bad, "dev-only services reached from production code:\n" + "\n".join(bad)


def _reached(start: str) -> dict[str, str]:
    """Every project module ``start`` loads, transitively, with the module that imports it (a name
    ``a.b.c`` loads ``a`` and ``a.b`` first: their ``__init__`` runs too)."""
    seen: dict[str, str] = {start: ""}
    todo = [start]
    while todo:
        mod = todo.pop()
        for name, _ in _imports(mod, MODULES[mod]):
            for dep in _loaded_by(name):
                if dep not in seen:
                    seen[dep] = mod
                    todo.append(dep)
    return seen


@pytest.mark.parametrize("pure", PURE)
def test_pure_modules_do_no_io(pure):
    roots = [m for m in MODULES if m == pure or m.startswith(pure + ".")]
    assert roots, f"{pure} not found"
    bad = []
    for root in roots:
        for mod, via in _reached(root).items():
            config = mod in CONFIGS or mod in CONFIG_PACKAGES  # test_configs_load_only_configs checks what they load
            if not config and any(mod == io or mod.startswith(io + ".") for io in IO_MODULES):
                bad.append(f"{root} reaches the I/O module {mod} (imported by {via})")
            bad += [
                f"{root} reaches {mod}:{line}, which imports {name}"
                for name, line in _imports(mod, MODULES[mod])
                if name.split(".")[0] in IO_LIBS and not name.startswith(PURE_LIBS)
            ]
    assert not bad, "pure logic must stay free of I/O:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.slow
def test_production_imports_load_no_dev_service():
    """Importing the application's entry points, the flows and the trainer job (as a production run
    with a cluster and a server does) loads nothing of ``devservices``: app.services reaches it only
    inside the functions that start the embedded defaults."""
    import subprocess
    import sys

    mods = [
        "app.cli",
        "app.loop",
        "app.parts",
        "app.supervisor",
        "app.services",
        "app.ab",
        "flows.reward_flow",
        "flows.batch_flow",
        "trainer.run",
        "trainer.__main__",
    ]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in mods)
        + ("print(sorted(m for m in sys.modules if m == 'devservices' or m.startswith('devservices.')))")
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_readme_shows_the_same_order():
    """The README's architecture section names the layers top-down with their packages, in this order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Architecture") :]
    section = section[: section.index("\n## ", 4)]
    positions = []
    for layer, pkgs in reversed(list(LAYERS.items())):
        m = re.search(rf"^{re.escape(layer)}\s+(.*)$", section, re.MULTILINE)
        assert m, f"README architecture section has no line for the {layer} layer"
        for pkg in pkgs:
            assert re.search(rf"\b{pkg}/", m.group(1)), f"README's {layer} line does not name {pkg}/"
        positions.append(m.start())
    assert positions == sorted(positions), "README lists the layers in another order than tests/test_architecture.py"


def test_the_walker_sees_imports_inside_functions(tmp_path):
    """The parser is what the other tests trust: it must see function-level and relative imports."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from app.loop import Loop\n    import flows.windowing\nfrom . import sibling\n")
    names = {n for n, _ in _imports("trainer.m", f)}
    assert {"app.loop", "flows.windowing", "trainer.sibling"} <= names


def _loaded_by(name: str) -> list[str]:
    """The project modules an import of ``name`` loads: ``a.b.c`` loads ``a`` and ``a.b`` first (their
    ``__init__`` runs), then ``a.b.c`` where that is a module."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in MODULES]


def _module_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (top of file or inside functions)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        deps = set()
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}  # itself and its packages
        for name, _ in _imports(module, path):
            deps |= set(_loaded_by(name)) - own  # the deepest module the name reaches and the packages above it
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_cycles_between_modules():
    graph = _module_graph()
    lines = []
    for component in _cycles(graph):
        inside = set(component)
        edges = [
            f"  {m}:{line} imports {name}"
            for m in component
            for name, line in _imports(m, MODULES[m])
            if any(name == d or name.startswith(d + ".") for d in graph[m] & inside)
        ]
        lines.append(" <-> ".join(component) + "\n" + "\n".join(sorted(set(edges))))
    assert not lines, "import cycles between modules (move what both need to a module below them):\n" + "\n".join(lines)


def test_the_cycle_finder_finds_cycles():
    """What test_no_cycles_between_modules trusts: a cycle through three modules is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _hand_written() -> list[str]:
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.sh", "*.sql"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [f for f in listed if not f.startswith(GENERATED) and (ROOT / f).is_file()]


def test_no_hand_written_file_is_too_long():
    files = _hand_written()
    assert "app/loop.py" in files and "tests/test_architecture.py" in files  # the listing sees the tree
    lengths = {f: len((ROOT / f).read_text(encoding="utf-8").splitlines()) for f in files}
    long = sorted(f"{f}: {n} lines" for f, n in lengths.items() if n > MAX_LINES and f not in LONG_FILES)
    assert not long, f"files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)
    fit = sorted(f for f in LONG_FILES if lengths.get(f, 0) <= MAX_LINES)
    assert not fit, f"these fit in {MAX_LINES} lines now (or are gone): remove them from LONG_FILES: {fit}"
