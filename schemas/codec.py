"""Kafka payload codecs derived from schemas.records.

Events, rollouts, rewards, checkpoints and dead letters travel as one JSON object per message
(msgspec: ~1 µs per small event); micro-batches travel as Arrow IPC streams. Decoding validates
every field and raises :class:`Invalid` carrying the offending field's path and the reason,
which is what a dead-letter record stores.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

import msgspec
import pyarrow as pa

from schemas.records import DeadLetter, DeadLetterKind, Event, MicroBatch
from schemas.types import arrow_schema, from_arrow, normalized, to_arrow

T = TypeVar("T")

DEFAULT_MAX_BYTES = 64 * 1024


class Invalid(ValueError):
    """Input that failed validation: ``field`` is a JSON path like ``$.ts``, ``reason`` says why."""

    def __init__(self, field: str, reason: str, kind: DeadLetterKind = "invalid"):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.kind = kind  # a DeadLetter kind: malformed, invalid, unknown_type, oversize


_AT = re.compile(r"^(?P<reason>.*?) - at `(?P<path>[^`]*)`$", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")


def _invalid_from(err: msgspec.MsgspecError) -> Invalid:
    msg = str(err)
    if isinstance(err, msgspec.DecodeError) and not isinstance(err, msgspec.ValidationError):
        return Invalid("$", f"malformed payload: {msg}", "malformed")
    m = _AT.match(msg)
    reason, path = (m["reason"], m["path"]) if m else (msg, "$")
    for pattern in (_MISSING, _UNKNOWN):
        n = pattern.search(reason)
        if n:
            path = f"{path}.{n['name']}"
    if path == "$.type" and reason.startswith("Invalid value"):
        return Invalid(path, f"unknown event type: {reason}", "unknown_type")
    if path == "$" and reason.startswith("Expected `object`"):
        return Invalid(path, reason, "malformed")
    return Invalid(path, reason)


class JsonCodec(Generic[T]):
    """JSON codec for one record type (or the Event union), with size and field validation."""

    def __init__(self, cls: type[T] | object, max_bytes: int = DEFAULT_MAX_BYTES):
        self.cls = cls
        self.max_bytes = max_bytes
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(cls)

    def encode(self, record: T) -> bytes:
        return self._encoder.encode(record)

    def decode(self, data: bytes | bytearray | memoryview | str | None) -> T:
        """Decode and validate one payload; raise :class:`Invalid` with the field and reason."""
        if data is None:
            raise Invalid("$", "empty message (null value)", "malformed")
        if len(data) > self.max_bytes:
            raise Invalid("$", f"payload of {len(data)} bytes exceeds the limit of {self.max_bytes} bytes", "oversize")
        try:
            return self._decoder.decode(data)
        except msgspec.MsgspecError as e:
            raise _invalid_from(e) from None

    def validate(self, record: T) -> T:
        """Re-check a record built in code (constructors don't check constraints)."""
        return self.decode(self.encode(record))


def _lenient(data: bytes | str | None, limit: int) -> str | None:
    if data is None or isinstance(data, str):
        return data if data is None else data[:limit]
    return bytes(data[:limit]).decode("utf-8", errors="replace")


def dead_letter(
    kind: DeadLetterKind,
    field: str,
    reason: str,
    source: str,
    partition: int,
    offset: int,
    key: bytes | str | None,
    payload: bytes | str | None,
    at_ms: int,
) -> DeadLetter:
    """The dead-letter record for rejected input: key and payload decoded leniently and truncated."""
    return DeadLetter(
        kind=kind,
        source=source,
        partition=partition,
        offset=offset,
        key=_lenient(key, 256),
        field=field,
        reason=reason,
        payload=_lenient(payload, 4096) or "",
        at=at_ms,
    )


def event_codec(max_bytes: int = DEFAULT_MAX_BYTES) -> JsonCodec:
    """Codec of the ``rtrl.events`` topic: one flat JSON object per event, tagged by ``type``."""
    return JsonCodec(Event, max_bytes)


# ---------------------------------------------------------------- micro-batches: Arrow IPC


def encode_batch(batch: MicroBatch) -> bytes:
    """A micro-batch as one Arrow IPC stream holding one row."""
    table = to_arrow([batch], MicroBatch)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_batch_table(data: bytes) -> pa.Table:
    """Read an Arrow IPC micro-batch and check its schema against schemas.records.MicroBatch."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise Invalid("$", f"not an Arrow IPC stream: {e}", "malformed") from None
    expected = arrow_schema(MicroBatch)
    for f in expected:
        idx = table.schema.get_field_index(f.name)
        if idx < 0:
            raise Invalid(f"$.{f.name}", "missing column")
        got = table.schema.field(idx).type
        if normalized(got) != normalized(f.type):
            raise Invalid(f"$.{f.name}", f"expected {f.type}, got {got}")
    if table.num_rows != 1:
        raise Invalid("$", f"expected one micro-batch row, got {table.num_rows}")
    return table


def decode_batch(data: bytes) -> MicroBatch:
    """Decode and validate a micro-batch (shapes, segment ids) from Arrow IPC."""
    table = decode_batch_table(data)
    try:
        return from_arrow(table, MicroBatch)[0]
    except msgspec.ValidationError as e:
        raise _invalid_from(e) from None
