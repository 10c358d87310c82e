"""Kafka payload codecs derived from schemas.records.

Events, rollouts, rewards, checkpoints, experiments and dead letters travel as one JSON object per message
(msgspec: ~1 µs per small event); micro-batches travel as Arrow IPC streams. Decoding validates
every field and raises :class:`Invalid` carrying the offending field's path and the reason,
which is what a dead-letter record stores.

**Any byte string decodes to a record or raises Invalid, nothing else** (the flows and the trainer
dead-letter Invalid and go on; any other exception would stop a part, and a replay after the
restart would stop it again). Hostile input is handled where it is known to bite: JSON nested deeper
than msgspec's recursion limit, numbers out of range, invalid UTF-8; Arrow IPC streams are read
message by message, refused when compressed (a compressed body declares its own inflated size) or
big-endian (swapping reads unvalidated buffers), and every record batch is validated in full
(offsets, lengths, UTF-8) before any value is read, because pyarrow reads unvalidated buffers as
they are and a corrupted offset crashes the process. As a last resort every decode function turns
an exception nobody foresaw into ``Invalid("$", "undecodable: <type>: <message>", "malformed")``.
``tests/test_fuzz_decoders.py`` holds them to this with random and mutated payloads.
"""

from __future__ import annotations

import re
import struct
from typing import Generic, TypeVar

import msgspec
import pyarrow as pa

from schemas.records import DeadLetter, DeadLetterKind, Event, MicroBatch
from schemas.types import arrow_schema, from_arrow, normalized, to_arrow

T = TypeVar("T")

DEFAULT_MAX_BYTES = 64 * 1024
# Largest Arrow IPC micro-batch accepted (a 64 x 8192-token batch is ~9 MiB); brokers cap messages lower.
DEFAULT_MAX_BATCH_BYTES = 32 * 1024 * 1024


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


def _undecodable(err: BaseException) -> Invalid:
    """The safety net: an exception no decoder foresaw, as a malformed-input rejection."""
    return Invalid("$", f"undecodable: {type(err).__name__}: {err}"[:1024], "malformed")


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
        try:
            n = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
            if n > self.max_bytes:
                raise Invalid("$", f"payload of {n} bytes exceeds the limit of {self.max_bytes} bytes", "oversize")
            return self._decoder.decode(data)
        except Invalid:
            raise
        except msgspec.MsgspecError as e:
            raise _invalid_from(e) from None
        except RecursionError:  # msgspec's C decoder stops at the interpreter's recursion limit
            raise Invalid("$", "malformed payload: JSON nested too deeply", "malformed") from None
        except Exception as e:  # the safety net (see the module docstring): never anything but Invalid
            raise _undecodable(e) from None

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
        field=field[:1024],  # paths and reasons may quote hostile input (an unknown field's name)
        reason=reason[:4096],
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


# Arrow IPC metadata is a flatbuffer (format/Message.fbs). Two facts pyarrow does not expose are read
# from it before any body is touched: a record batch's compression and a schema's endianness.
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # MessageHeader union tags


def _fb_int(fmt: str, buf: bytes, pos: int) -> int:
    if pos < 0:  # struct counts negative positions from the end
        raise Invalid("$", "Arrow IPC metadata points outside itself", "malformed")
    return int(struct.unpack_from(fmt, buf, pos)[0])


def _fb_field(buf: bytes, table: int, slot: int) -> int | None:
    """Position of field ``slot`` of the flatbuffer table at ``table``, None when absent."""
    vtable = table - _fb_int("<i", buf, table)
    vt_len = _fb_int("<H", buf, vtable)
    if 4 + 2 * slot + 2 > vt_len:
        return None
    off = _fb_int("<H", buf, vtable + 4 + 2 * slot)
    return table + off if off else None


def _fb_table(buf: bytes, pos: int) -> int:
    """The table an offset field at ``pos`` points to."""
    return pos + _fb_int("<I", buf, pos)


def _check_ipc_metadata(metadata: bytes) -> None:
    """Refuse compressed record batches, dictionary batches and big-endian schemas (raises Invalid)."""
    message = _fb_table(metadata, 0)
    tag_at, header_at = _fb_field(metadata, message, 1), _fb_field(metadata, message, 2)
    tag = _fb_int("<B", metadata, tag_at) if tag_at is not None else 0
    if header_at is None:
        raise Invalid("$", "Arrow IPC message without a header", "malformed")
    header = _fb_table(metadata, header_at)
    if tag == _DICTIONARY_BATCH:
        raise Invalid("$", "dictionary-encoded micro-batch columns are not accepted", "malformed")
    if tag == _RECORD_BATCH and _fb_field(metadata, header, 3) is not None:
        raise Invalid(
            "$",
            "compressed Arrow IPC body (the inflated size is the sender's claim); send it uncompressed",
            "malformed",
        )
    if tag == _SCHEMA and (e := _fb_field(metadata, header, 0)) is not None and _fb_int("<h", metadata, e):
        raise Invalid("$", "big-endian Arrow IPC stream", "malformed")


def _has_dictionary(t: pa.DataType) -> bool:
    return pa.types.is_dictionary(t) or any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


#: micro-batch fields with a default (added after the first release): a batch without their column decodes
_OPTIONAL_BATCH_FIELDS = frozenset(
    MicroBatch.__struct_fields__[len(MicroBatch.__struct_fields__) - len(MicroBatch.__struct_defaults__) :]
)


def _read_micro_batch_ipc(data: bytes | bytearray | memoryview) -> pa.Table:
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(data))
    try:
        first = reader.read_next_message()
    except StopIteration:
        raise Invalid("$", "empty Arrow IPC stream", "malformed") from None
    if first.type != "schema":
        raise Invalid("$", f"Arrow IPC stream starts with a {first.type} message, not a schema", "malformed")
    _check_ipc_metadata(first.metadata.to_pybytes())
    schema = pa.ipc.read_schema(first)
    for f in arrow_schema(MicroBatch):
        idx = schema.get_field_index(f.name)
        if idx < 0:
            if f.name in _OPTIONAL_BATCH_FIELDS:  # a field added later: an older producer's batch takes its default
                continue
            raise Invalid(f"$.{f.name}", "missing column")
        got = schema.field(idx).type
        if _has_dictionary(got) or normalized(got) != normalized(f.type):
            raise Invalid(f"$.{f.name}", f"expected {f.type}, got {got}")
    batches, rows = [], 0
    for message in reader:
        if message.type != "record batch":
            raise Invalid("$", f"unexpected {message.type} message in a micro-batch stream", "malformed")
        _check_ipc_metadata(message.metadata.to_pybytes())
        batch = pa.ipc.read_record_batch(message, schema)
        batch.validate(full=True)  # before any value is read: offsets, lengths, UTF-8, nested children
        rows += batch.num_rows
        if rows > 1:
            break
        batches.append(batch)
    if rows != 1:
        raise Invalid("$", f"expected one micro-batch row, got {rows if rows < 2 else 'more'}")
    return pa.Table.from_batches(batches, schema)


def decode_batch_table(
    data: bytes | bytearray | memoryview | None, max_bytes: int = DEFAULT_MAX_BATCH_BYTES
) -> pa.Table:
    """Read an Arrow IPC micro-batch, validated in full, with its schema checked against
    schemas.records.MicroBatch; raise :class:`Invalid` for anything else (see the module docstring)."""
    if data is None:
        raise Invalid("$", "empty message (null value)", "malformed")
    try:
        if len(data) > max_bytes:
            raise Invalid("$", f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes", "oversize")
        return _read_micro_batch_ipc(data)
    except Invalid:
        raise
    except (pa.ArrowException, OSError, ValueError, struct.error, IndexError) as e:
        raise Invalid("$", f"not a valid Arrow IPC micro-batch: {e}"[:1024], "malformed") from None
    except Exception as e:  # the safety net: never anything but Invalid
        raise _undecodable(e) from None


def decode_batch(data: bytes | bytearray | memoryview | None, max_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> MicroBatch:
    """Decode and validate a micro-batch (shapes, segment ids) from Arrow IPC; raise only :class:`Invalid`."""
    table = decode_batch_table(data, max_bytes)
    try:
        return from_arrow(table, MicroBatch)[0]
    except msgspec.ValidationError as e:
        raise _invalid_from(e) from None
    except Exception as e:  # the safety net: never anything but Invalid
        raise _undecodable(e) from None
