"""What each request may run on the embedded ClickHouse front, decided on the engine's parse tree (pure: no I/O).

Refused for everyone (code 497): table functions and table/database engines that touch files or the
network (``file``, ``url``, ``s3``, ``remote``, ``mysql``, ``executable``, … - everything but
:data:`TABLE_FUNCTIONS` and :data:`ENGINES`), ``INTO OUTFILE``, client-side ``FROM INFILE``, ``SYSTEM``,
``KILL``, ``BACKUP``/``RESTORE``, dictionaries, ``ATTACH``, access management. A read-only request (the
analyst, or ``readonly=1`` in the URL) may only run read statements (else code 164) and the engine enforces
``readonly=1`` too. No ``SETTINGS`` or ``SET`` may lift or change ``max_execution_time`` (code 452), only
lower it.

A read-only request's tables are checked in the tree (or EXPLAIN AST's text for DESCRIBE, SHOW CREATE,
EXISTS); a CTE named like a real table, or holding a dot, is refused. Its query parameters of type
``Identifier`` are refused (code 497): they could name a table or database around that check. No other
type can stand where a name goes (the engine's parser refuses it), and the functions that take a table,
database or dictionary name as a string (``merge``, ``remote``, ``cluster``, ``joinGet``, ``dict*``, …)
are refused by name. A statement without a JSON tree is explained with its parameters substituted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from devservices.chserver.bodies import Body
from devservices.chserver.limits import Limits, RequestError, _denied, _readonly
from rtrl.clickhouse import ANALYST_TABLES, APPEND_ONLY_TABLES

#: table functions anyone may use (the rest touch files or the network, or read tables by pattern)
TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateseries", "values", "null"}
    | {"view", "format", "generaterandom", "input"}
)
#: table and database engines a CREATE may use (the rest touch files or the network)
ENGINES = frozenset(
    {"mergetree", "replacingmergetree", "summingmergetree", "aggregatingmergetree", "collapsingmergetree"}
    | {"versionedcollapsingmergetree", "coalescingmergetree", "graphitemergetree", "memory", "log", "tinylog"}
    | {"stripelog", "null", "set", "join", "buffer", "view", "materializedview", "atomic", "ordinary"}
)
#: functions refused everywhere besides the engines' and table functions' names (they read files)
FUNCTIONS = frozenset({"file", "catboostevaluate"})
#: further functions a read-only request may not use (they read tables by name, around the table check;
#: so do all ``dict*`` functions, which read dictionaries by name)
ANALYST_FUNCTIONS = frozenset({"merge", "loop", "joinget", "joingetornull", "dictionary", "hascolumnintable"})
#: system tables a read-only request may read (what clients ask on connecting)
ANALYST_SYSTEM_TABLES = frozenset({"one", "numbers", "numbers_mt", "zeros", "settings", "functions", "formats"})
#: statements a read-only request may run (as the engine's parser names them)
READ_KINDS = frozenset(
    {"SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery", "ShowTablesQuery", "ExplainQuery"}
    | {"DescribeQuery", "ShowCreateTableQuery", "ShowCreateViewQuery", "ShowCreateDatabaseQuery"}
    | {"ExistsTableQuery", "ExistsViewQuery", "ExistsDatabaseQuery", "ShowProcesslistQuery"}
)
#: statements the engine cannot give as JSON that may still run (their functions are checked)
INTROSPECTION_KINDS = READ_KINDS - {"SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery"}
#: statements refused for everyone
REFUSED_KINDS = frozenset({"SystemQuery", "KillQueryQuery", "BackupQuery"})
#: settings that bound a statement's time: a statement may only lower max_execution_time (within the cap)
TIME_SETTINGS = frozenset(
    {"max_execution_time", "max_execution_time_leaf", "timeout_overflow_mode", "timeout_overflow_mode_leaf"}
    | {"timeout_before_checking_execution_speed", "max_estimated_execution_time"}
)
#: functions whose right argument, a bare identifier, names a table (``x IN t``)
_IN_FUNCTIONS = frozenset(
    {"in", "notin", "globalin", "globalnotin", "nullin", "notnullin", "globalnullin", "globalnotnullin"}
)
#: introspection statements whose first EXPLAIN AST line names a table: ``Kind db name``
_NAMED_TABLE_KINDS = frozenset({"ShowCreateTableQuery", "ShowCreateViewQuery", "ExistsTableQuery", "ExistsViewQuery"})


@dataclass
class Statement:
    """One statement as the engine parsed it: what runs, and what the policy looks at."""

    kind: str  #: the root node's type, e.g. SelectWithUnionQuery, InsertQuery, CreateQuery
    sql: str  #: the engine's canonical text of it (what runs)
    ast: dict | None  #: parseQueryToJSON's tree (None for the few statements it cannot serialise)
    functions: set[str]  #: every function / table function / engine name in it, lower-case
    data: Body | None = None  #: an INSERT's data (from the body or inline)
    explain: list[str] | None = None  #: EXPLAIN AST's lines when ``ast`` is None
    parameters: dict[str, str] = field(default_factory=dict)  #: its query parameters: name -> type


def _explain_tree(lines: list[str]) -> dict:
    """EXPLAIN AST's indented text as nodes ``{"type", "text", "children"}`` (the root first)."""
    root: dict = {"type": "", "text": "", "children": []}
    stack: list[tuple[int, dict]] = [(-1, root)]
    for line in lines:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip(" "))
        body = re.sub(r"\s*\(children \d+\)$", "", line.strip())
        kind, _, text = body.partition(" ")
        node = {"type": kind, "text": text, "children": []}
        while stack[-1][0] >= depth:
            stack.pop()
        stack[-1][1]["children"].append(node)
        stack.append((depth, node))
    return root


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


class Policy:
    """What each request may run, decided on the engine's parse tree (pure: no I/O)."""

    def __init__(self, table_functions: set[str], engines: set[str], database: str):
        names = {n.lower() for n in table_functions | engines}
        self.forbidden = (names - TABLE_FUNCTIONS - ENGINES) | FUNCTIONS
        self.table_functions = {n.lower() for n in table_functions}
        self.database = database
        self.analyst_tables = {f"{database}.{t}" for t in ANALYST_TABLES} | {
            f"system.{t}" for t in ANALYST_SYSTEM_TABLES
        }

    def check(
        self,
        st: Statement,
        user: str,
        readonly: bool,
        database: str,
        max_time_s: float = Limits.max_execution_time_s,
        existing: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        """Raise RequestError (497, 164 or 452) unless ``user`` may run ``st``. ``max_time_s`` is the server's
        ceiling of max_execution_time; ``existing`` the (database, table) pairs there are (for read-only
        requests: a CTE may not take a real table's name)."""
        for name in sorted(st.functions):
            if name in self.forbidden or name.startswith(("iceberg", "deltalake", "hudi", "paimon")):
                raise _denied(
                    f"{user}: {name} is refused by the embedded ClickHouse front (it reaches files or the network)"
                )
        if st.kind in REFUSED_KINDS:
            raise _denied(f"{user}: {st.kind} is refused by the embedded ClickHouse front")
        if st.ast is None and st.kind not in INTROSPECTION_KINDS:
            raise _denied(
                f"{user}: {st.kind} is not available on the embedded ClickHouse front (access control and "
                "administration belong to a real server: deploy/clickhouse/security.sql)"
            )
        self._check_settings(st, user, max_time_s)
        for node in _walk(st.ast):
            if "out_file" in node:
                raise _denied(f"{user}: INTO OUTFILE is refused (it writes a file on the server)")
            if "infile" in node:
                raise _denied(f"{user}: FROM INFILE is refused (it reads a file on the server)")
            if "attach_from_path" in node or node.get("attach") is True:
                raise _denied(f"{user}: ATTACH is refused by the embedded ClickHouse front")
            if node.get("is_dictionary") is True and node.get("type") == "CreateQuery":
                raise _denied(f"{user}: dictionaries are refused (their sources read files or the network)")
        if not readonly:
            self._check_append_only(st, user, database)
            return
        if st.kind not in READ_KINDS or (
            st.kind == "ExplainQuery" and (st.ast or {}).get("query", {}).get("type") not in READ_KINDS
        ):
            raise _readonly(user, f"{st.kind} is not a read")
        bad = sorted(n for n in st.functions if n in ANALYST_FUNCTIONS or n.startswith("dict"))
        if bad:
            raise _readonly(user, f"{bad[0]} is not available to read-only users")
        names = sorted(n for n, t in st.parameters.items() if t.strip().lower() == "identifier")
        if names:
            raise _denied(
                f"{user}: the query parameter {{{names[0]}:Identifier}} is refused for read-only users (it could "
                "name a table or database, around the table check); write the name in the statement"
            )
        if st.ast is not None:
            tables = self._tables(st.ast, database, user, existing)
        else:
            tables = self._explained_tables(st.explain or [], database, existing)
        for table in sorted(tables):
            if table not in self.analyst_tables:
                raise _denied(
                    f"{user}: Not enough privileges. To execute this query, it's necessary to have the grant "
                    f"SELECT ON {table} (read-only users read {', '.join(sorted(ANALYST_TABLES))})"
                )

    def _check_append_only(self, st: Statement, user: str, database: str) -> None:
        """No one alters, deletes from, truncates, drops, replaces or renames an append-only table (the erasure
        audit), nor drops the database that holds it: the engine's equivalent of the writer role's REVOKE in
        deploy/clickhouse/security.sql."""
        ast = st.ast or {}
        replaces = st.kind == "CreateQuery" and (ast.get("replace_table") or ast.get("create_or_replace"))
        if st.kind not in ("AlterQuery", "DropQuery", "DeleteQuery", "RenameQuery") and not replaces:
            return
        name = lambda x: x.get("name") if isinstance(x, dict) else x  # noqa: E731
        db = name(ast.get("database")) or database
        if st.kind == "DropQuery" and not name(ast.get("table")) and db == self.database:
            raise _denied(f"{user}: dropping {db} would drop its append-only erasure audit; refused")
        pairs = [(db, name(ast.get("table")))]
        for e in ast.get("elements") or []:
            pairs += [(e.get("from_database") or database, e.get("from_table"))]
            pairs += [(e.get("to_database") or database, e.get("to_table"))]
        for db, table in pairs:
            if db == self.database and table in APPEND_ONLY_TABLES:
                raise _denied(
                    f"{user}: {db}.{table} is append-only (the erasure audit): it may be read and inserted into, "
                    "never altered, deleted from, truncated, dropped, replaced or renamed"
                )

    def _check_settings(self, st: Statement, user: str, max_time_s: float) -> None:
        """A statement may lower max_execution_time (SETTINGS or SET), never raise or lift it, nor change how
        the time limit acts: the server's ceiling holds for every user."""

        def refuse(what: str) -> RequestError:
            return RequestError(
                400,
                452,
                "SETTING_CONSTRAINT_VIOLATION",
                f"{user}: {what} (the embedded ClickHouse front caps max_execution_time at {max_time_s:g} s; "
                "a statement may only lower it)",
            )

        if st.ast is None:
            if any(ln.strip() == "Set" for ln in st.explain or []):
                raise refuse(f"SETTINGS on {st.kind} is not available")
            return
        for node in _walk(st.ast):
            if node.get("type") != "SetQuery":
                continue
            for change in node.get("changes", []):
                name = str(change.get("name", "")).lower()
                if name not in TIME_SETTINGS:
                    continue
                value = (change.get("value") or {}).get("value")
                try:
                    seconds = float(value)  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    seconds = -1.0
                if name != "max_execution_time" or not 0 < seconds <= max_time_s:
                    raise refuse(f"setting {name} to {value!r} is not allowed")

    @staticmethod
    def _qualified(node: dict, database: str) -> str:
        """``db.name`` of a table identifier node: qualified only when the engine parsed two parts
        (a backquoted name holding a dot is a name in ``database``)."""
        parts = node.get("name_parts")
        if isinstance(parts, list) and len(parts) == 2:
            return f"{parts[0]}.{parts[1]}"
        return f"{database}.{node.get('name')}"

    def _tables(self, ast: dict, database: str, user: str, existing: frozenset[tuple[str, str]]) -> set[str]:
        """Every table, view or parameterised view ``ast`` reads, as ``db.name``. A bare name that a CTE of
        the query defines is left out; a CTE name holding a dot or equal to a real table's name is refused
        (a CTE is visible in its own scope only: a table of that name elsewhere would pass unchecked)."""
        ctes = {str(n["name"]) for n in _walk(ast) if n.get("type") == "WithElement" and "name" in n}
        real = {name.lower() for _, name in existing} | {t.lower() for t in ANALYST_TABLES}
        for cte in sorted(ctes):
            if "." in cte or cte.lower() in real:
                raise _denied(
                    f"{user}: a CTE named {cte!r} is refused for read-only users (it names or shadows a table)"
                )
        found = set()
        for node in _walk(ast):
            ref = None
            if node.get("type") == "TableIdentifier":
                ref = node
            elif node.get("type") == "TableExpression" and "table_function" in node:
                fn = node["table_function"].get("name", "")
                if fn.lower() not in self.table_functions:
                    ref = {"name": fn, "name_parts": fn.split(".") if "." in fn else None}  # parameterised view
            elif node.get("type") == "Function" and str(node.get("name", "")).lower() in _IN_FUNCTIONS:
                args = node.get("arguments", {}).get("children", [])
                if len(args) == 2 and args[1].get("type") == "Identifier":
                    ref = args[1]  # x IN t reads table t
            if ref is None:
                continue
            if not ref.get("name"):  # a name the tree does not carry (a query parameter's): refused
                found.add(f"{database}.?")
                continue
            bare = not (isinstance(ref.get("name_parts"), list) and len(ref["name_parts"]) == 2)
            if bare and ref["name"] in ctes:
                continue
            found.add(self._qualified(ref, database))
        return found

    def _explained_tables(self, lines: list[str], database: str, existing: frozenset[tuple[str, str]]) -> set[str]:
        """The tables a statement without a JSON tree (DESCRIBE, SHOW CREATE, EXISTS) names, from EXPLAIN
        AST's text. That text cannot tell ``db.t`` from a backquoted dotted name: a dotted name is read as
        both when a table of that dotted name exists in ``database``. CTEs are not exempt here."""

        def names(text: str) -> set[str]:
            if "." not in text:
                return {f"{database}.{text}"}
            bare = f"{database}.{text}"
            return {text, bare} if (database, text) in existing else {text}

        found: set[str] = set()
        head = lines[0] if lines else ""
        kind = head.split(" ")[0]
        if kind in _NAMED_TABLE_KINDS:
            parts = re.sub(r"\s*\(children \d+\)$", "", head).split(" ")
            if len(parts) != 3 or not parts[2]:
                found.add(f"{database}.?")  # a name the text cannot carry: refused
            else:
                found.add(f"{parts[1] or database}.{parts[2]}")
        for node in _walk(_explain_tree(lines)):
            kind = node.get("type")
            if kind == "TableIdentifier":
                found |= names(node["text"])
            elif kind == "TableExpression":
                for child in node["children"]:
                    fn = child["text"] if child["type"] == "Function" else ""
                    if fn and fn.lower() not in self.table_functions:
                        found |= names(fn)
            elif kind == "Function" and node["text"].lower() in _IN_FUNCTIONS:
                args = node["children"][0]["children"] if node["children"] else []
                if len(args) == 2 and args[1]["type"] == "Identifier":
                    found |= names(args[1]["text"])
        return found
