"""schemas/ is the single source of truth: documented fields, derived Arrow schemas, a validating codec.

Pure tests (no services): the codec round-trips every record and reports the field and the
reason for every kind of bad input the flows will see.
"""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import Invalid, JsonCodec, decode_batch, encode_batch, event_codec
from schemas.records import (
    EVENT_TYPES,
    RECORDS,
    Checkpoint,
    DeadLetter,
    EventBase,
    Experiment,
    MicroBatch,
    Reward,
    Rollout,
    ToolCall,
    event_type,
)
from schemas.types import arrow_schema, columns, field_docs, from_arrow, to_arrow
from tests.strategies import records

JSON_RECORDS = [EventBase, Rollout, Reward, Checkpoint, Experiment, DeadLetter]


def _tool_call(**kw) -> ToolCall:
    base = dict(
        event_id="e1",
        trajectory_id="t1",
        ts=1_767_225_600_000,
        org_id="acme",
        user_hash="0" * 32,
        policy_version=3,
        arm="control",
        tool="grep",
        valid=False,
        error="bad regex",
    )
    return ToolCall(**(base | kw))


@pytest.mark.parametrize("cls", list(RECORDS) + list(EVENT_TYPES), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    """Every field of every record (and event payload) carries a non-trivial docstring."""
    docs = field_docs(cls)
    assert docs, cls
    missing = [name for name, text in docs.items() if not text or len(text) < 8]
    assert missing == [], f"{cls.__name__} fields without docs: {missing}"
    assert cls.__doc__


def test_event_columns_are_the_envelope_plus_nullable_payloads():
    """The flattened event table holds the envelope, the type tag, and every payload field as nullable."""
    cols = {c.name: c for c in columns(EventBase)}
    for name in EventBase.__struct_fields__:
        assert not cols[name].nullable
    assert cols["type"].clickhouse == "LowCardinality(String)"
    for et in EVENT_TYPES:
        for name in set(et.__struct_fields__) - set(EventBase.__struct_fields__):
            assert cols[name].nullable, name
            assert "Nullable" in cols[name].clickhouse


def test_payload_fields_with_one_name_have_one_type():
    """A payload field name shared by several event types (edit_id) has the same storage type in each."""
    seen: dict[str, str] = {}
    for et in EVENT_TYPES:
        for c in columns(et):
            assert seen.setdefault(c.name, c.clickhouse) == c.clickhouse, c.name


@pytest.mark.parametrize("cls", JSON_RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_json_codec_round_trips(cls, data):
    """encode then decode returns an equal record for every record type."""
    record = data.draw(records(cls))
    codec = event_codec() if cls is EventBase else JsonCodec(cls)
    assert codec.decode(codec.encode(record)) == record


@pytest.mark.parametrize("cls", list(RECORDS), ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_arrow_round_trips(cls, data):
    """Records -> Arrow table with the derived schema -> records is the identity."""
    recs = data.draw(st.lists(records(cls), min_size=1, max_size=5))
    table = to_arrow(recs, cls)
    assert table.schema == arrow_schema(cls)
    assert from_arrow(table, cls) == recs


@settings(max_examples=30, deadline=None)
@given(batch=records(MicroBatch))
def test_micro_batch_arrow_ipc_round_trips(batch):
    """A micro-batch survives the Arrow IPC wire format unchanged."""
    assert decode_batch(encode_batch(batch)) == batch


def test_event_type_is_the_tag():
    """The ``type`` field on the wire is the event class's tag."""
    e = _tool_call()
    assert event_type(e) == "tool_call"
    assert msgspec.json.decode(event_codec().encode(e))["type"] == "tool_call"


@pytest.mark.parametrize(
    "mutate, field, reason",
    [
        (lambda b: b"{not json", "$", "malformed"),
        (lambda b: b.replace(b'"tool_call"', b'"teleport"'), "$.type", "unknown event type"),
        (lambda b: b.replace(b',"tool":"grep"', b""), "$.tool", "missing required field"),
        (lambda b: b.replace(b'"ts":1767225600000', b'"ts":"yesterday"'), "$.ts", "Expected `int`"),
        (lambda b: b.replace(b'"ts":1767225600000', b'"ts":-5'), "$.ts", ">= 0"),
        (lambda b: b.replace(b'"valid":false', b'"valid":"no"'), "$.valid", "Expected `bool`"),
        (lambda b: b.replace(b'"0000', b'"alice@example.com'), "$.user_hash", "regex"),
        (lambda b: b.replace(b'"event_id":"e1"', b'"event_id":""'), "$.event_id", "length >= 1"),
        (lambda b: b[:-1] + b',"extra":1}', "$.extra", "unknown field"),
        (lambda b: b"[1,2]", "$", "Expected `object`"),
        (lambda b: b"null", "$", "Expected `object`"),
        (lambda b: b[:-1] + b',"error":"' + b"x" * 70_000 + b'"}', "$", "exceeds the limit"),
    ],
    ids=[
        "malformed",
        "unknown-type",
        "missing",
        "mistyped",
        "negative-ts",
        "bad-bool",
        "raw-user-id",
        "empty-id",
        "unknown-field",
        "array",
        "null",
        "oversize",
    ],
)
def test_bad_events_name_the_field_and_reason(mutate, field, reason):
    """Each kind of bad input decodes to Invalid(field, reason) — what a dead letter records."""
    good = event_codec().encode(_tool_call())
    with pytest.raises(Invalid) as err:
        event_codec().decode(mutate(good))
    assert err.value.field == field
    assert reason in err.value.reason


def test_edit_persisted_fraction_is_bounded():
    """fraction outside 0..1 is rejected with the field named."""
    raw = msgspec.json.encode(
        {
            "type": "edit_persisted",
            "event_id": "e",
            "trajectory_id": "t",
            "ts": 1,
            "org_id": "o",
            "user_hash": "a" * 32,
            "policy_version": 0,
            "arm": "control",
            "edit_id": "x",
            "fraction": 1.5,
            "checked_after_s": 60.0,
        }
    )
    with pytest.raises(Invalid) as err:
        event_codec().decode(raw)
    assert err.value.field == "$.fraction"


def test_rollout_lengths_must_agree():
    """A rollout whose log-probs don't cover every completion token is rejected."""
    raw = msgspec.json.encode(
        {
            "trajectory_id": "t",
            "policy_version": 1,
            "group_id": "g",
            "org_id": "o",
            "task_kind": "bugfix",
            "prompt_ids": [1],
            "completion_ids": [2, 3],
            "behaviour_logprobs": [-1.0],
            "loss_mask": [1, 1],
            "created_at": 5,
        }
    )
    with pytest.raises(Invalid) as err:
        JsonCodec(Rollout).decode(raw)
    assert "one entry per completion token" in err.value.reason


def test_micro_batch_rejects_ragged_rows_and_foreign_ipc():
    """Micro-batches with a row of the wrong length, or bytes that are not Arrow IPC, are Invalid."""
    with pytest.raises(Invalid):
        decode_batch(b"definitely not arrow")
    good = MicroBatch(
        batch_id="b",
        created_at=1,
        seq_len=2,
        token_ids=[[1, 2]],
        loss_mask=[[1, 1]],
        advantages=[[0.5, 0.5]],
        behaviour_logprobs=[[-1.0, -1.0]],
        segment_ids=[[0, 0]],
        sample_ids=["t"],
        policy_versions=[1],
    )
    table = to_arrow([good], MicroBatch)
    idx = table.schema.get_field_index("segment_ids")
    ragged = table.set_column(idx, table.schema.field(idx), pa.array([[[0, 0, 0]]], table.schema.field(idx).type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ragged.schema) as w:
        w.write_table(ragged)
    with pytest.raises(Invalid) as err:
        decode_batch(sink.getvalue().to_pybytes())
    assert "segment_ids" in err.value.reason
