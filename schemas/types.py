"""Derive Arrow schemas, ClickHouse column types and row conversions from schemas.records.

The mapping is the only place that decides physical types:

=================  =======================  ==============================
python / kind      Arrow                    ClickHouse
=================  =======================  ==============================
str                string                   String
str, lowcard       string                   LowCardinality(String)
Literal[...]       string                   LowCardinality(String)
int                int64                    Int64
int, int32/uint8…  int32/uint8/uint32/…     Int32/UInt8/UInt32/…
int, millis        timestamp[ms, UTC]       DateTime64(3, 'UTC')
float              float64                  Float64
float, float32     float32                  Float32
bool               bool                     Bool
Optional[X]        X (nullable)             Nullable(X) / LowCardinality(Nullable(X))
list[X]            list<X>                  Array(X)
dict[K, V]         map<K, V>                Map(K, V)
=================  =======================  ==============================
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
import numpy as np
import pyarrow as pa

from schemas.fields import Kind
from schemas.records import EVENT_TYPES, Event, EventBase

_INT_KINDS = {
    None: (pa.int64(), "Int64"),
    "int32": (pa.int32(), "Int32"),
    "uint8": (pa.uint8(), "UInt8"),
    "uint32": (pa.uint32(), "UInt32"),
    "uint64": (pa.uint64(), "UInt64"),
    "millis": (pa.timestamp("ms", tz="UTC"), "DateTime64(3, 'UTC')"),
}


@dataclass(frozen=True)
class Column:
    """One stored column of a record."""

    name: str
    arrow: pa.DataType
    clickhouse: str
    nullable: bool
    doc: str

    @property
    def is_millis(self) -> bool:
        return pa.types.is_timestamp(self.arrow)


def _strip(tp: Any) -> tuple[Any, Kind | None, str | None]:
    """Remove Annotated layers, returning (base type, storage kind, docstring)."""
    kind = None
    text = None
    while get_origin(tp) is Annotated:
        base, *meta = get_args(tp)
        for m in meta:
            if isinstance(m, Kind):
                kind = m
            elif isinstance(m, msgspec.Meta) and m.description:
                text = m.description
        tp = base
    return tp, kind, text


def _physical(tp: Any) -> tuple[pa.DataType, str, bool]:
    """(arrow type, ClickHouse type, nullable) of a Python annotation."""
    tp, kind, _ = _strip(tp)
    origin = get_origin(tp)
    kname = kind.name if kind else None
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1 or len(get_args(tp)) != 2:
            raise TypeError(f"only Optional[X] unions are storable, not {tp}")
        arrow, ch, _ = _physical(args[0])
        if ch.startswith("LowCardinality("):
            ch = f"LowCardinality(Nullable({ch[len('LowCardinality(') : -1]}))"
        else:
            ch = f"Nullable({ch})"
        return arrow, ch, True
    if origin is Literal:
        return pa.string(), "LowCardinality(String)", False
    if origin is list:
        arrow, ch, _ = _physical(get_args(tp)[0])
        return pa.list_(arrow), f"Array({ch})", False
    if origin is dict:
        k_arrow, k_ch, _ = _physical(get_args(tp)[0])
        v_arrow, v_ch, _ = _physical(get_args(tp)[1])
        return pa.map_(k_arrow, v_arrow), f"Map({k_ch}, {v_ch})", False
    if tp is bool:
        return pa.bool_(), "Bool", False
    if tp is int:
        arrow, ch = _INT_KINDS[kname]
        return arrow, ch, False
    if tp is float:
        return (pa.float32(), "Float32", False) if kname == "float32" else (pa.float64(), "Float64", False)
    if tp is str:
        return pa.string(), ("LowCardinality(String)" if kname == "lowcard" else "String"), False
    raise TypeError(f"no storage mapping for {tp!r}")


def _fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return [(name, hints[name]) for name in cls.__struct_fields__]  # type: ignore[attr-defined]  # msgspec Struct class


def field_docs(cls: type) -> dict[str, str | None]:
    """Docstring of every field of a record class (None where one is missing)."""
    return {name: _strip(tp)[2] for name, tp in _fields(cls)}


def _column(name: str, tp: Any, force_nullable: bool = False) -> Column:
    arrow, ch, nullable = _physical(tp)
    if force_nullable and not nullable:
        arrow, ch, nullable = _physical(typing.Optional[tp])  # noqa: UP045 - built at run time
    return Column(name, arrow, ch, nullable, _strip(tp)[2] or "")


@cache
def columns(cls: type) -> tuple[Column, ...]:
    """Stored columns of a record class. ``EventBase`` (or ``Event``) means the flattened event table."""
    if cls is EventBase or cls is Event:
        cols = [_column(n, tp) for n, tp in _fields(EventBase)]
        cols.append(Column("type", pa.string(), "LowCardinality(String)", False, "Event type (the union tag)."))
        seen = {c.name for c in cols}
        for et in EVENT_TYPES:
            for n, tp in _fields(et):
                if n in seen:
                    continue
                seen.add(n)
                cols.append(_column(n, tp, force_nullable=True))
        return tuple(cols)
    return tuple(_column(n, tp) for n, tp in _fields(cls))


def arrow_schema(cls: type) -> pa.Schema:
    """Arrow schema of a record class."""
    return pa.schema([pa.field(c.name, c.arrow, nullable=c.nullable) for c in columns(cls)])


def to_arrow(records: list, cls: type) -> pa.Table:
    """Records (msgspec structs) to an Arrow table with the derived schema, in the given order.

    Built column-wise from ``msgspec.structs.astuple`` rows (C speed); events are grouped by type,
    each group filling its own payload columns, then put back in the original order.
    """
    schema = arrow_schema(cls)
    if not records:
        return schema.empty_table()
    if not (cls is EventBase or cls is Event):
        return _table(schema, columns(cls), cls.__struct_fields__, records, None)  # type: ignore[attr-defined]  # a Struct
    groups: dict[type, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(type(r), []).append(i)
    if len(groups) == 1:
        et = next(iter(groups))
        return _table(schema, columns(cls), et.__struct_fields__, records, _TAGS[et])  # type: ignore[attr-defined]  # an event
    parts, order = [], []
    for et, idx in groups.items():
        parts.append(
            _table(
                schema,
                columns(cls),
                et.__struct_fields__,  # type: ignore[attr-defined]  # an event Struct
                [records[i] for i in idx],
                _TAGS[et],
            )
        )
        order += idx
    return pa.concat_tables(parts).take(pa.array(np.argsort(np.asarray(order)), pa.int64()))


def _table(
    schema: pa.Schema, cols: tuple[Column, ...], fields: tuple[str, ...], records: list, tag: str | None
) -> pa.Table:
    n = len(records)
    data = dict(zip(fields, zip(*map(msgspec.structs.astuple, records))))
    arrays = []
    for c in cols:
        if c.name in data:
            arrays.append(pa.array(data[c.name], type=c.arrow))
        elif c.name == "type" and tag is not None:
            arrays.append(pa.array([tag] * n, type=c.arrow))
        else:
            arrays.append(pa.nulls(n, type=c.arrow))
    return pa.Table.from_arrays(arrays, schema=schema)


_TAGS: dict[type, str] = {
    et: typing.cast(str, et.__struct_config__.tag) for et in EVENT_TYPES
}  # every event sets a str tag


def from_arrow(table: pa.Table, cls: type) -> list:
    """An Arrow table (e.g. from ClickHouse ``query_arrow``) back to validated records."""
    cols = columns(cls)
    data: dict[str, list] = {}
    for c in cols:
        if c.name not in table.column_names:  # a field added later: msgspec fills its default (or names it missing)
            continue
        col = table.column(c.name)
        if c.is_millis:
            col = col.cast(pa.int64())
        values = col.to_pylist()
        if pa.types.is_map(c.arrow):
            values = [None if v is None else dict(v) for v in values]
        data[c.name] = values
    rows = [dict(zip(data, vals)) for vals in zip(*data.values())]
    if cls is EventBase or cls is Event:
        allowed = {et.__struct_config__.tag: set(et.__struct_fields__) | {"type"} for et in EVENT_TYPES}
        # a field added later with a default (data_use) is null in rows written before it: the default applies
        defaulted = {
            et.__struct_config__.tag: {
                f.name
                for f in msgspec.structs.fields(et)
                if f.default is not msgspec.NODEFAULT and f.default is not None
            }
            for et in EVENT_TYPES
        }
        rows = [
            {
                k: v
                for k, v in r.items()
                if k in allowed.get(r["type"], r) and not (v is None and k in defaulted.get(r["type"], ()))
            }
            for r in rows
        ]
        return msgspec.convert(rows, list[Event])
    return msgspec.convert(rows, list[cls])  # type: ignore[valid-type]  # cls is a runtime record class


def normalized(t: pa.DataType) -> str:
    """Type text without nullability of nested fields or dictionary encoding (what ClickHouse varies)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return str(t).replace(" not null", "")
