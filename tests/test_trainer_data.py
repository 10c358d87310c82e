"""The trainer's streamed input against the real broker: DP partition split, resume from checkpointed
offsets without skipping or repeating, and invalid micro-batches dead-lettered with a reason."""

from __future__ import annotations

import pyarrow as pa
from confluent_kafka import Producer

from rtrl.kafka import producer_config, read_topic
from schemas.codec import JsonCodec, encode_batch
from schemas.records import DeadLetter, MicroBatch
from schemas.types import to_arrow
from trainer.data import BatchStream


def _batch(i: int) -> MicroBatch:
    seq = 4
    return MicroBatch(
        batch_id=f"b{i:03d}",
        created_at=1_000 + i,
        seq_len=seq,
        token_ids=[[i, i + 1, i + 2, 0]],
        loss_mask=[[0, 1, 1, 0]],
        advantages=[[0.0, 0.5, 0.5, 0.0]],
        behaviour_logprobs=[[0.0, -1.0, -2.0, 0.0]],
        segment_ids=[[0, 0, 0, -1]],
        sample_ids=[f"t{i}"],
        policy_versions=[i % 3],
    )


def _produce(bootstrap, topic, items):
    p = Producer(producer_config(bootstrap))
    for partition, value in items:
        p.produce(topic, value=value, key=b"k", partition=partition)
    assert p.flush(10) == 0


def _drain(stream: BatchStream, n: int):
    got = []
    while len(got) < n:
        b = stream.get(timeout_s=10)
        assert b is not None, f"only {len(got)} of {n} batches arrived"
        got.append(b)
    return got


def test_dp_ranks_split_partitions_and_see_every_batch_once(broker, topic_prefix):
    """Two DP ranks own disjoint partitions; together they read every micro-batch exactly once, decoded
    to arrays with the right shapes and per-sample policy versions."""
    topic = topic_prefix + "batches"  # 2 partitions in tests
    _produce(broker.bootstrap, topic, [(i % 2, encode_batch(_batch(i))) for i in range(10)])
    ranks = [BatchStream(broker.bootstrap, topic, topic_prefix + "dead_letters", r, 2) for r in (0, 1)]
    assert [s.partitions for s in ranks] == [[0], [1]]
    seen = [b for s in ranks for b in _drain(s, 5)]
    assert sorted(b.batch_id for b in seen) == [f"b{i:03d}" for i in range(10)]
    b = next(b for b in seen if b.batch_id == "b004")
    assert b.tokens.tolist() == [[4, 5, 6, 0]] and b.tokens.dtype.name == "int64"
    assert b.segment_ids.tolist() == [[0, 0, 0, -1]] and b.policy_versions.tolist() == [1] and b.loss_mask.sum() == 2
    for s in ranks:
        s.close()


def test_resume_from_position_neither_skips_nor_repeats(broker, topic_prefix):
    """Reading 3 batches, storing position(), and resuming a new stream from it continues with the 4th."""
    topic = topic_prefix + "batches"
    _produce(broker.bootstrap, topic, [(0, encode_batch(_batch(i))) for i in range(8)])
    first = BatchStream(broker.bootstrap, topic, topic_prefix + "dead_letters")
    ids = [b.batch_id for b in _drain(first, 3)]
    pos = first.position()
    first.commit()
    first.close()
    assert pos == {f"{topic}/0": 3, f"{topic}/1": 0}
    again = BatchStream(broker.bootstrap, topic, topic_prefix + "dead_letters", start=pos)
    ids += [b.batch_id for b in _drain(again, 5)]
    assert ids == [f"b{i:03d}" for i in range(8)]
    assert again.get(timeout_s=1) is None
    again.close()


def test_invalid_micro_batches_are_dead_lettered(broker, topic_prefix):
    """Bytes that are not Arrow IPC, a message with no value (a tombstone) and a batch with a bad segment id
    go to the dead-letter topic with a reason; the stream skips them and returns the valid batches around them."""
    topic = topic_prefix + "batches"
    mb = _batch(2)
    table = to_arrow([mb], MicroBatch)
    table = table.set_column(
        table.schema.get_field_index("sample_ids"), "sample_ids", pa.array([[]], pa.list_(pa.string()))
    )
    table = table.set_column(
        table.schema.get_field_index("policy_versions"), "policy_versions", pa.array([[]], pa.list_(pa.int64()))
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    _produce(
        broker.bootstrap,
        topic,
        [
            (0, encode_batch(_batch(0))),
            (0, b"not arrow at all"),
            (0, None),
            (0, sink.getvalue().to_pybytes()),
            (0, encode_batch(_batch(1))),
        ],
    )
    stream = BatchStream(broker.bootstrap, topic, topic_prefix + "dead_letters")
    assert [b.batch_id for b in _drain(stream, 2)] == ["b000", "b001"]
    assert stream.dead_letters == 3 and stream.position()[f"{topic}/0"] == 5
    stream.close()
    dead = [
        JsonCodec(DeadLetter).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "dead_letters")
    ]
    assert [(d.offset, d.kind) for d in dead] == [(1, "malformed"), (2, "malformed"), (3, "invalid")]
    assert "empty message" in dead[1].reason and "segment_ids" in dead[2].reason
