"""The records page (docs/reference/records.md): every record and event type, field by field.

Read from the msgspec records of ``schemas/records.py``: each field's type, constraints, default, docstring and
ClickHouse column type (``schemas.types``), and where each record travels (``schemas/topics.py``,
``rtrl.clickhouse.TABLES``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from docs.gen_markdown import cell, code, header, own_doc, toml

_BOUNDS = {
    2**63 - 1: "2^63-1",
    -(2**63): "-2^63",
    2**32 - 1: "2^32-1",
    2**31 - 1: "2^31-1",
    -(2**31): "-2^31",
    10413791999999: "10413791999999 (2299-12-31)",
}
_KIND_TEXT = {
    "int32": "int32",
    "uint8": "uint8",
    "uint32": "uint32",
    "uint64": "uint64",
    "millis": "ms timestamp",
    "float32": "float32",
    "lowcard": "label",
}


def _bound(v: Any) -> str:
    return _BOUNDS.get(v, repr(v))


def _split_annotated(tp: Any) -> tuple[Any, list[Any]]:
    """(base type, metadata) with every Annotated layer removed."""
    meta: list[Any] = []
    while get_origin(tp) is Annotated:
        base, *m = get_args(tp)
        meta = [*m, *meta]
        tp = base
    return tp, meta


def record_type(tp: Any) -> str:
    """A field's type as text: Python types with their storage kind (``int32``, ``ms timestamp``, ``label``)."""
    from schemas.fields import Kind

    base, meta = _split_annotated(tp)
    kind = next((m.name for m in meta if isinstance(m, Kind)), None)
    origin = get_origin(base)
    if origin is Literal:
        return " | ".join(toml(a) for a in get_args(base))
    if origin in (Union, types.UnionType):
        return " | ".join(record_type(a) for a in get_args(base))
    if origin is list:
        return f"list[{record_type(get_args(base)[0])}]"
    if origin is dict:
        k, v = get_args(base)
        return f"dict[{record_type(k)}, {record_type(v)}]"
    if base is type(None):
        return "null"
    if kind is not None:
        return _KIND_TEXT.get(kind, kind)
    return getattr(base, "__name__", str(base))


def record_constraints(tp: Any) -> str:
    """The field's own constraints (not its elements'): ranges, lengths, pattern; ``X | None``: X's."""
    base, meta = _split_annotated(tp)
    if get_origin(base) in (Union, types.UnionType):
        inner = [a for a in get_args(base) if a is not type(None)]
        if len(inner) == 1:
            base, more = _split_annotated(inner[0])
            meta = [*more, *meta]
    out = []
    for m in meta:
        if not isinstance(m, msgspec.Meta):
            continue
        lo = m.ge if m.ge is not None else m.gt
        hi = m.le if m.le is not None else m.lt
        if lo is not None or hi is not None:
            left = f"{_bound(lo)} {'<=' if m.ge is not None else '<'} " if lo is not None else ""
            right = f" {'<=' if m.le is not None else '<'} {_bound(hi)}" if hi is not None else ""
            out.append(f"{left}x{right}")
        if m.min_length is not None or m.max_length is not None:
            unit = "chars" if base is str else "items"
            if m.min_length is not None and m.max_length is not None:
                out.append(f"{m.min_length}..{m.max_length} {unit}")
            elif m.max_length is not None:
                out.append(f"at most {m.max_length} {unit}")
            else:
                out.append(f"at least {m.min_length} {unit}")
        if m.pattern is not None:
            out.append(f"matches `{m.pattern}`")
    return ", ".join(out)


def _record_default(f: Any) -> str:
    if f.default is not msgspec.NODEFAULT:
        return code(msgspec.json.encode(f.default).decode())
    if f.default_factory is not msgspec.NODEFAULT:
        return code(msgspec.json.encode(f.default_factory()).decode())
    return "required"


def _doc_of(tp: Any) -> str:
    _, meta = _split_annotated(tp)
    docs = [m.description for m in meta if isinstance(m, msgspec.Meta) and m.description]
    return docs[-1] if docs else ""


def _record_fields(cls: type, skip: Sequence[str] = ()) -> list[Any]:
    return [f for f in msgspec.structs.fields(cls) if f.name not in skip]


def _field_table(cls: type, columns: Mapping[str, str], skip: Sequence[str] = ()) -> list[str]:
    rows = ["| field | type | constraints | default | ClickHouse | what it is |", "|---|---|---|---|---|---|"]
    for f in _record_fields(cls, skip):
        rows.append(
            f"| `{f.name}` | {code(record_type(f.type))} | {cell(record_constraints(f.type))} | {_record_default(f)} "
            f"| {code(columns[f.name]) if f.name in columns else ''} | {cell(_doc_of(f.type))} |"
        )
    return rows


def records_page(records: Sequence[type] | None = None, event_types: Sequence[type] | None = None) -> str:
    """Every record of ``schemas.records`` (default ``RECORDS``, events as ``EventBase`` + ``EVENT_TYPES``)."""
    from rtrl.clickhouse import TABLES
    from schemas import records as sr
    from schemas.topics import TOPICS
    from schemas.types import columns

    records = list(records if records is not None else sr.RECORDS)
    event_types = list(event_types if event_types is not None else sr.EVENT_TYPES)
    topics_of: dict[str, list] = {}  # a record may travel on several topics (MicroBatch: shared and adapter batches)
    for t in TOPICS:
        topics_of.setdefault(t.record, []).append(t)
    table_of = {cls: name for name, cls in TABLES.items()}
    lines = header("Records", "schemas/records.py, schemas/topics.py and rtrl.clickhouse.TABLES")
    lines += [
        "`schemas/records.py` is the single source of truth: every record is a msgspec struct with a docstring on "
        "every field (`schemas.fields.doc`). Arrow schemas and ClickHouse column types are derived from these "
        "annotations (`schemas/types.py`); Kafka payloads are JSON (msgspec), micro-batches Arrow IPC. Decoding "
        "validates every field and constraint; input that fails becomes a [`DeadLetter`](#deadletter) naming the "
        "field and the reason. Unknown fields are refused.",
        "",
        "Types: `int32`, `uint8`, `uint32`, `uint64`, `float32` are stored at that width; `ms timestamp` is an int "
        "of milliseconds since the Unix epoch (UTC) stored as `DateTime64(3, 'UTC')`; `label` is a short string "
        "stored as `LowCardinality(String)`. Topics and tables: [topics-and-tables.md](topics-and-tables.md).",
        "",
    ]
    where: dict[str, str] = {}
    for cls in records:
        bits = []
        for t in topics_of.get("Event" if cls is sr.EventBase else cls.__name__, []):
            bits.append(f"Kafka topic `rtrl.{t.name}` (key `{t.key}`, {encoding_name(t.encoding)})")
        if cls in table_of:
            bits.append(f"ClickHouse table `rtrl.{table_of[cls]}`")
        where[cls.__name__] = "; ".join(bits)
    index = ["Event", *[c.__name__ for c in event_types]] if sr.EventBase in records else []
    index += [c.__name__ for c in records if c is not sr.EventBase]
    lines += ["Records: " + ", ".join(f"[`{n}`](#{n.lower()})" for n in index) + ".", ""]
    for cls in records:
        cols = {c.name: c.clickhouse for c in columns(cls)} if cls in table_of else {}
        if cls is sr.EventBase:
            lines += ["## Event", ""]
            lines += [
                "A tagged union on `type`: one flat JSON object per event, the envelope fields below plus the "
                "payload fields of its type. In ClickHouse every payload field is a Nullable column of the one "
                "`events` table.",
                "",
                f"Where: {where['EventBase']}." if where.get("EventBase") else "",
                "",
                "| type | event | what happened |",
                "|---|---|---|",
            ]
            for et in event_types:
                tag = et.__struct_config__.tag  # type: ignore[attr-defined]  # a tagged msgspec Struct
                lines.append(f"| `{tag}` | [`{et.__name__}`](#{et.__name__.lower()}) | {cell(own_doc(et))} |")
            lines += ["", "Envelope (every event type):", "", *_field_table(cls, cols), ""]
            envelope = [f.name for f in msgspec.structs.fields(cls)]
            for et in event_types:
                tag = et.__struct_config__.tag  # type: ignore[attr-defined]
                lines += [f"### {et.__name__}", "", f'`type = "{tag}"`. {own_doc(et)}', ""]
                if _record_fields(et, envelope):
                    lines += ["Payload (after the envelope):", "", *_field_table(et, cols, envelope), ""]
                else:
                    lines += ["No payload: the envelope only.", ""]
            continue
        lines += [f"## {cls.__name__}", ""]
        doc = own_doc(cls)
        if doc:
            lines += [doc, ""]
        if where.get(cls.__name__):
            lines += [f"Where: {where[cls.__name__]}.", ""]
        lines += [*_field_table(cls, cols), ""]
    return "\n".join(line for i, line in enumerate(lines) if line or (i and lines[i - 1])).rstrip("\n") + "\n"


def encoding_name(name: str) -> str:
    """A topic's payload encoding as the pages write it (``json``: JSON, ``arrow-ipc``: Arrow IPC)."""
    return {"json": "JSON", "arrow-ipc": "Arrow IPC"}.get(name, name)


def record_anchor(cls: type) -> str:
    """The heading id of ``cls``'s section on the records page (``EventBase``'s is ``event``)."""
    from schemas.records import EventBase

    return "event" if cls is EventBase else cls.__name__.lower()
