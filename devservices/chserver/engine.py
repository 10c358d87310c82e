"""The chdb folder behind the embedded ClickHouse front: each request's one statement parsed, checked and run in turn.

The statement is classified by the engine's own parser (``formatQuerySingleLine`` refuses several
statements; ``parseQueryToJSON`` / ``EXPLAIN AST`` give the tree) and what runs is the engine's
canonical text of the one statement that was checked (by :class:`~devservices.chserver.policy.Policy`).
Statements run one at a time (:class:`~devservices.chserver.gates.Gate`); a request waits at most
``queue_timeout_s`` for the engine (then 503, code 202).

``INSERT … FORMAT F`` / ``VALUES`` with the data in the body or inline: the data is written to a private
file and inserted ``FROM INFILE``; small ``VALUES`` data runs as ``INSERT … SELECT * FROM values(<data>)``,
so its expressions are checked like any statement's, and larger data is read as literals only.

Each request runs in a fresh engine session with its own database and settings: one client's
``USE`` or ``SET`` ends with its request.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, cast

from devservices.chserver.auth import ANALYST
from devservices.chserver.bodies import Body
from devservices.chserver.gates import Gate
from devservices.chserver.limits import Limits, RequestError
from devservices.chserver.policy import Policy, Statement, _walk
from rtrl.clickhouse import on_engine_thread
from rtrl.files import private_dir

#: the keys an INSERT whose data comes in the request may have in its tree
_DATA_INSERT_KEYS = frozenset({"type", "database", "table", "columns", "format"})
#: what every session runs first: VALUES data is read as literals (never evaluated: ``file()`` in data)
SESSION_SETTINGS = ("input_format_values_interpret_expressions", "input_format_values_deduce_templates_of_expressions")
_DATA_START = re.compile(rb"\bVALUES\b|\bFORMAT\s+[A-Za-z0-9_]+", re.IGNORECASE)
_SEPARATOR = re.compile(rb"[ \t]*\r?\n?")  # always matches (maybe empty)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PARAMETER = re.compile(r"\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([^{}]+)\}")


def _escape_param(text: str) -> str:
    """A string as a ``{q:String}`` query parameter (chdb reads parameters in the escaped TSV form)."""
    return (
        text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace("\0", "\\0")
    )


def _quote_ident(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


class Engine:
    """The chdb folder; every call runs on the process's one chdb thread
    (:func:`rtrl.clickhouse.on_engine_thread`: chdb wants Python-created threads, one at a time)."""

    def __init__(self, path: str, limits: Limits = Limits(), database: str = "rtrl"):
        import chdb

        self.path, self.limits = str(Path(path).resolve()), limits
        self.conn = on_engine_thread(chdb.connect, self.path)  # holds the folder; parses statements
        # INSERT data on its way in: inside the folder (owner-only), emptied at each start, so a front
        # killed with SIGKILL leaves nothing behind that the next start does not clear
        self.spool = Path(self.path) / "rtrl-spool"
        shutil.rmtree(self.spool, ignore_errors=True)
        private_dir(self.spool)
        self.gate = Gate()  # one request on the engine at a time (writers first); the others wait, bounded
        names = on_engine_thread(self._names)
        self.policy = Policy(names["table_functions"], names["table_engines"] | names["database_engines"], database)

    def _names(self) -> dict[str, set[str]]:
        out = {}
        for table in ("table_functions", "table_engines", "database_engines"):
            text = self.conn.query(f"SELECT name FROM system.{table}", "TabSeparatedRaw").bytes().decode()
            out[table] = set(text.split())
        return out

    def _call(self, fn: str, text: str) -> str:
        res = self.conn.query(f"SELECT {fn}({{q:String}})", "TabSeparatedRaw", params={"q": _escape_param(text)})
        return res.bytes().decode().removesuffix("\n")

    def _parse(self, text: str, params: dict[str, str] | None = None) -> Statement:
        """The one statement in ``text`` (SYNTAX_ERROR if there are several), parsed by the engine.
        Its query parameters are listed with their types. A statement without a JSON tree is explained
        with ``params`` substituted (as it runs), so the policy sees the names they fill in."""
        canonical = self._call("formatQuerySingleLine", text)  # refuses multi-statements
        try:
            ast = json.loads(self._call("parseQueryToJSON", canonical))
        except Exception as e:  # noqa: BLE001 - a statement the JSON form does not cover: EXPLAIN AST's tree
            if "does not support JSON" not in str(e) and "not supported by parseQueryToJSON" not in str(e):
                raise
            explained = self.conn.query(f"EXPLAIN AST {canonical}", "TabSeparatedRaw", params=params or {})
            lines = explained.bytes().decode().splitlines()
            kind = lines[0].split()[0] if lines else "?"
            functions = {
                ln.split()[1].lower() for ln in lines if ln.strip().startswith("Function ") and len(ln.split()) > 1
            }
            # the text's {name:Type} (one inside a string literal too: only ever a stricter check)
            parameters = {m[0]: m[1].strip() for m in _PARAMETER.findall(canonical)}
            return Statement(kind, canonical, None, functions, explain=lines, parameters=parameters)
        functions = {str(n["name"]).lower() for n in _walk(ast) if n.get("type") == "Function" and "name" in n}
        parameters = {
            str(n.get("name")): str(n.get("param_type")) for n in _walk(ast) if n.get("type") == "QueryParameter"
        }
        return Statement(str(ast.get("type")), canonical, ast, functions, parameters=parameters)

    def _data_insert(self, text: Body) -> tuple[Statement, int] | None:
        """An ``INSERT … FORMAT F`` / ``VALUES`` at the head of ``text`` whose data follows it: the statement
        and where the data starts. The engine decides: the first candidate prefix it parses as a complete
        INSERT with a format and no SELECT is the head (a keyword inside a comment or string never is)."""
        head = text[: self.limits.max_query_bytes]
        for m in list(_DATA_START.finditer(head))[:32]:
            try:
                prefix = head[: m.end()].decode()
                ast = json.loads(self._call("parseQueryToJSON", prefix))
            except Exception:  # noqa: BLE001,S112 - not a complete statement there: the next candidate
                continue
            if ast.get("type") != "InsertQuery" or "format" not in ast or "select" in ast:
                continue
            st = Statement("InsertQuery", self._call("formatQuerySingleLine", prefix), ast, set())
            st.functions = {str(n["name"]).lower() for n in _walk(ast) if n.get("type") == "Function" and "name" in n}
            return st, m.end()
        return None

    def time_cap(self, user: str) -> float:
        """The ceiling (and default) of ``user``'s max_execution_time: the analyst's is the lower one."""
        cap = self.limits.max_execution_time_s
        return min(cap, self.limits.analyst_max_execution_time_s) if user == ANALYST else cap

    def execute(self, query: str, body: Body, user: str, readonly: bool, database: str, run_args: dict) -> Any:
        """Parse, check and run one request's statement, waiting at most ``limits.queue_timeout_s`` for the
        engine (it runs one statement at a time); 503 / code 202 once that wait is over. A writer waits
        for the statement running now, never for queued analysts' (their statements are capped too)."""
        wait = self.limits.queue_timeout_s
        if not self.gate.acquire(user != ANALYST, wait):
            raise RequestError(
                503,
                202,
                "TOO_MANY_SIMULTANEOUS_QUERIES",
                f"Too many simultaneous queries: waited {wait:g} s for the engine, which runs one statement at "
                "a time (try again later)",
            )
        try:
            st = self.prepare(query, body, run_args["params"])
            existing = self.tables() if readonly else frozenset()
            self.policy.check(st, user, readonly, database, self.time_cap(user), existing)
            return self.run(st, database=database, readonly=readonly, **run_args)
        finally:
            self.gate.release()

    def tables(self) -> frozenset[tuple[str, str]]:
        """Every (database, table) there is now."""
        text = on_engine_thread(
            lambda: self.conn.query("SELECT database, name FROM system.tables", "JSONCompactEachRow").bytes()
        )
        return frozenset(tuple(json.loads(ln)) for ln in text.decode().splitlines() if ln.strip())  # type: ignore[misc]

    def _values_as_sql(self, st: Statement) -> Statement:
        """An ``INSERT … VALUES`` whose data is small enough to parse as the statement
        ``INSERT INTO t SELECT * FROM values(<data>)``: expressions in its data (``now()``, ``file(…)``) are
        then parsed, checked by the policy and run as any statement's are. Larger data, or data that does
        not parse so, stays data and is read as literals only (the session never evaluates VALUES data)."""
        ast = st.ast or {}
        if str(ast.get("format", "")).lower() != "values" or set(ast) - _DATA_INSERT_KEYS:
            return st
        data = (st.data or b"").strip().removesuffix(b";").strip()
        if not data:
            return st
        if len(data) > self.limits.max_query_bytes or not data.startswith(b"("):
            return st
        try:
            text = f"INSERT INTO {self._target(ast)} SELECT * FROM values({data.decode()})"
            return self._parse(text)
        except Exception:  # noqa: BLE001 - not one expression list: the literal-only data path
            return st

    @staticmethod
    def _target(ast: dict) -> str:
        target = _quote_ident(ast["table"]["name"])
        if "database" in ast:
            target = f"{_quote_ident(ast['database']['name'])}.{target}"
        cols = ast.get("columns", {}).get("children", [])
        if cols:
            target += " (" + ", ".join(_quote_ident(c["name"]) for c in cols) + ")"
        return target

    def prepare(self, url_query: str, body: Body, params: dict[str, str] | None = None) -> Statement:
        return cast(Statement, on_engine_thread(self._prepare, url_query, body, params))

    def _prepare(self, url_query: str, body: Body, params: dict[str, str] | None = None) -> Statement:
        if url_query and body:
            found = self._data_insert(url_query.encode())
            if found and not url_query.encode()[found[1] :].strip():
                found[0].data = body  # the statement in the URL, the data in the body
                return self._values_as_sql(found[0])
            text: Body = url_query.encode() + b"\n" + body  # ClickHouse concatenates them
        else:
            text = url_query.encode() or body
        found = self._data_insert(text)
        if found is not None:
            st, start = found
            if st.ast and st.ast.get("format", "").lower() != "values":
                start = _SEPARATOR.match(text, start).end()  # type: ignore[union-attr]  # the one after FORMAT F
            st.data = text[start:]  # one copy of the data
            return self._values_as_sql(st)
        if len(text) > self.limits.max_query_bytes:
            raise RequestError(
                400, 62, "SYNTAX_ERROR", f"Max query size exceeded ({len(text)} > {self.limits.max_query_bytes} bytes)"
            )
        try:
            sql = text.decode()
        except UnicodeDecodeError:
            raise RequestError(400, 62, "SYNTAX_ERROR", "the statement is not valid UTF-8") from None
        return self._parse(sql, params)

    def run(self, st: Statement, fmt: str, params: dict[str, str], database: str, readonly: bool, max_time: float):
        return on_engine_thread(self._run, st, fmt, params, database, readonly, max_time)

    def _run(self, st: Statement, fmt: str, params: dict[str, str], database: str, readonly: bool, max_time: float):
        import chdb

        session = chdb.connect(self.path)  # a fresh session: no USE or SET outlives its request
        try:
            session.query(f"SET max_execution_time = {max_time:g}")
            for name in SESSION_SETTINGS:
                session.query(f"SET {name} = 0")
            if database:
                session.query(f"USE {_quote_ident(database)}")
            if readonly:
                session.query("SET readonly = 1")  # the engine enforces it as well
            if st.data is None:
                return session.query(st.sql, fmt, params=params)
            return self._insert(session, st, fmt, params)
        finally:
            session.close()

    def _insert(self, session: Any, st: Statement, fmt: str, params: dict[str, str]):
        ast = st.ast or {}
        extra = set(ast) - _DATA_INSERT_KEYS
        if extra:
            raise RequestError(
                400, 48, "NOT_IMPLEMENTED", f"INSERT with {', '.join(sorted(extra))} and data is not supported here"
            )
        target = self._target(ast)
        form = str(ast["format"])
        if not _IDENT.match(form):
            raise RequestError(400, 73, "UNKNOWN_FORMAT", f"unknown format {form!r}")
        spool = self.spool / f"{uuid.uuid4().hex}.{form}"
        spool.write_bytes(st.data or b"")
        try:  # the one FROM INFILE that runs: ours, of a file we wrote
            return session.query(f"INSERT INTO {target} FROM INFILE '{spool}' FORMAT {form}", fmt, params=params)
        finally:
            spool.unlink(missing_ok=True)

    def close(self) -> None:
        try:
            on_engine_thread(self.conn.close)
        finally:
            shutil.rmtree(self.spool, ignore_errors=True)
