"""No input stops a part: every decoder of a Kafka payload turns any byte string into a record or Invalid.

The decoders are ``schemas.codec.JsonCodec.decode`` (events, rollouts, rewards, deployments, experiments, dead
letters),
``schemas.codec.decode_batch_table`` / ``decode_batch`` and ``trainer.batch.to_batch`` (micro-batches).
Hypothesis feeds them random bytes and mutations of valid payloads (truncation, bit flips, byte and
int32 overwrites, insertions, deletions, splices) plus hand-made hostile payloads (nesting 100 000 deep,
numbers of 5 000 digits, invalid UTF-8, lone surrogates, NaN and infinity). A result must be a record
that survives its own round trip, or an ``Invalid`` with a field path, a non-empty reason and a dead-letter
kind. Mutated Arrow IPC runs in a child process: a segfault there (pyarrow reading unvalidated buffers)
fails the test with the payload that did it instead of killing pytest.

End to end, a hostile event between valid ones reaches the dead-letter topic and table while the reward
flow goes on and rewards the valid events exactly as without it; corrupted micro-batches between valid
ones are dead-lettered while ``rtrl train`` goes on and trains the valid ones with the losses of a run
without them.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import cast

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from bytewax.testing import run_main
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flows.reward_flow import build_flow
from rtrl import clickhouse
from rtrl.kafka import ensure_topics, producer_config, read_topic
from schemas.codec import Invalid, JsonCodec, dead_letter, decode_batch, decode_batch_table, encode_batch, event_codec
from schemas.records import (
    EVENT_TYPES,
    Checkpoint,
    DeadLetter,
    EventBase,
    Experiment,
    MicroBatch,
    Reward,
    Rollout,
)
from schemas.types import to_arrow
from tests.dist.train_run import synthetic_batches
from tests.strategies import micro_batches, records
from tests.test_batching import ro, rw
from tests.test_reward_flow import _payloads, _produce, _services_env, _settings
from tests.test_trainer_train import _to_micro
from trainer.batch import BatchLimits, to_batch

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"malformed", "invalid", "unknown_type", "oversize"}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: every JSON decoder of a Kafka topic: (codec, record strategy, record types a decode may return)
JSON_DECODERS: dict[str, tuple[JsonCodec, st.SearchStrategy, tuple[type, ...]]] = {
    "events": (event_codec(), records(EventBase), tuple(EVENT_TYPES)),
    "rollouts": (JsonCodec(Rollout), records(Rollout), (Rollout,)),
    "rewards": (JsonCodec(Reward), records(Reward), (Reward,)),
    "deployments": (JsonCodec(Checkpoint), records(Checkpoint), (Checkpoint,)),
    "experiments": (JsonCodec(Experiment), records(Experiment), (Experiment,)),
    "dead_letters": (JsonCodec(DeadLetter), records(DeadLetter), (DeadLetter,)),
}


def _check_invalid(e: Invalid) -> None:
    assert e.field.startswith("$") and e.reason.strip() and e.kind in KINDS, (e.field, e.reason, e.kind)


def _record_or_invalid(name: str, data: bytes | str | None) -> object:
    """Decode with the topic's codec: a record that round-trips, or Invalid with a reason (else the test fails)."""
    codec, _, types = JSON_DECODERS[name]
    try:
        rec = codec.decode(data)
    except Invalid as e:
        _check_invalid(e)
        return e
    assert isinstance(rec, types)
    assert codec.decode(codec.encode(rec)) == rec
    return rec


# ---------------------------------------------------------------- mutations


_EDGE_BYTES = (0x00, 0xFF, 0x7F, 0x80, 0x22, 0x5B, 0x7B, 0x5C, 0xC0, 0xED)
_EDGE_INT32 = (-1, -(2**31), 2**31 - 1, 2**30, 1 << 24, 65536, 8, 0)


def mutate(data: bytes, rng: random.Random, ops: int) -> bytes:
    """``ops`` edits of ``data`` at uniformly drawn places: truncate, flip a bit, overwrite a byte or an
    aligned int32 (Arrow offsets and lengths) with an edge or random value, insert or delete bytes, repeat
    a slice. Half the edits fall in the second half, where an IPC stream's record batch lies."""
    b = bytearray(data)
    for _ in range(ops):
        op = rng.choice(["truncate", "flip", "flip", "byte", "int32", "int32", "insert", "delete", "repeat"])
        lo = len(b) // 2 if rng.random() < 0.5 else 0
        i = rng.randint(lo, max(lo, len(b) - 1))
        if op == "truncate":
            del b[i:]
        elif op == "flip" and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op == "byte" and b:
            b[i] = rng.choice(_EDGE_BYTES) if rng.random() < 0.5 else rng.randrange(256)
        elif op == "int32" and len(b) >= 4:
            j = min(i - i % 4, len(b) - 4)
            v = rng.choice(_EDGE_INT32) if rng.random() < 0.5 else rng.randint(-(2**31), 2**31 - 1)
            b[j : j + 4] = v.to_bytes(4, "little", signed=True)
        elif op == "insert":
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete":
            del b[i : i + rng.randint(1, 16)]
        elif op == "repeat":
            j = rng.randint(i, len(b))
            b[j:j] = b[i:j][:4096] * rng.randint(1, 3)
    return bytes(b)


def mutated(payloads: st.SearchStrategy[bytes], max_ops: int = 4) -> st.SearchStrategy[bytes]:
    """Valid payloads with 1..max_ops edits (:func:`mutate`); the seed is drawn, so failures replay."""
    return st.tuples(payloads, st.integers(0, 2**32 - 1), st.integers(1, max_ops)).map(
        lambda t: mutate(t[0], random.Random(t[1]), t[2])
    )


def _json_payloads(name: str) -> st.SearchStrategy[bytes]:
    codec, strategy, _ = JSON_DECODERS[name]
    return strategy.map(codec.encode)


# ---------------------------------------------------------------- JSON decoders: fuzz


@pytest.mark.parametrize("name", sorted(JSON_DECODERS))
@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_json_decoders_take_any_bytes(name, data):
    """Random bytes, random text and mutated valid payloads of the topic: a record or Invalid, never anything else."""
    payload = data.draw(
        st.one_of(
            st.binary(max_size=512),
            st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
            mutated(_json_payloads(name)),
            mutated(_json_payloads(name), max_ops=12),
        )
    )
    _record_or_invalid(name, payload)


@pytest.mark.parametrize("name", sorted(JSON_DECODERS))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_valid_payloads_still_decode(name, data):
    """The hardening rejects nothing valid: every valid record decodes to itself."""
    codec, strategy, _ = JSON_DECODERS[name]
    rec = data.draw(strategy)
    assert codec.decode(codec.encode(rec)) == rec


def _nest(depth: int, open_: bytes, close: bytes, inner: bytes = b"1") -> bytes:
    return open_ * depth + inner + close * depth


def _hostile_json(sample: bytes) -> dict[str, bytes | str]:
    """Payloads that broke or could break a JSON decoder, several wrapped around a valid event's fields."""
    body = sample[1:-1]  # a valid object's fields, to put hostile values beside them
    return {
        "deep array, 100k": b"[" * 100_000,
        "deep object, 100k": b'{"a":' * 100_000,
        "deep array under the limit": _nest(20_000, b"[", b"]"),
        "deep object under the limit": _nest(9_000, b'{"a":', b"}"),
        "deep object without a tag": _nest(2_000, b'{"a":', b"}"),
        "deep value before the tag": b'{"x":' + _nest(5_000, b"[", b"]") + b"," + body + b"}",
        "deep value after the tag": b"{" + body + b',"x":' + _nest(5_000, b'{"a":', b"}") + b"}",
        "deep value as a field": b'{"ts":' + _nest(3_000, b"[", b"]") + b"," + body + b"}",
        "1e400": b'{"ts":1e400,' + body + b"}",
        "-1e400": b'{"ts":-1e400,' + body + b"}",
        "5000 digits": b'{"ts":' + b"9" * 5_000 + b"," + body + b"}",
        "5000-digit fraction": b'{"ts":0.' + b"1" * 5_000 + b"," + body + b"}",
        "5000-digit exponent": b'{"ts":1e' + b"9" * 5_000 + b"," + body + b"}",
        "NaN": b'{"ts":NaN,' + body + b"}",
        "Infinity": b'{"ts":Infinity,' + body + b"}",
        "nan string": b'{"ts":"nan",' + body + b"}",
        "invalid UTF-8": b'{"org_id":"\xff\xfe",' + body + b"}",
        "overlong UTF-8": b'{"org_id":"\xc0\xaf",' + body + b"}",
        "UTF-8 surrogate": b'{"org_id":"\xed\xa0\x80",' + body + b"}",
        "escaped lone surrogate": b'{"org_id":"\\udc00",' + body + b"}",
        "escaped high surrogate": b'{"org_id":"\\ud800",' + body + b"}",
        "lone surrogate in str": '{"org_id":"\ud800",' + body.decode() + "}",
        "UTF-16": b"\xff\xfe" + sample.decode().encode("utf-16-le"),
        "BOM": b"\xef\xbb\xbf" + sample,
        "NUL bytes": b"\x00" * 64,
        "empty": b"",
        "whitespace": b" \n\t" * 100,
        "null": b"null",
        "scalar": b"1",
        "string": b'"x"',
        "array of objects": b"[" + sample + b"]",
        "duplicate keys": b"{" + body + b"," + body + b"}",
        "trailing garbage": sample + b"}}}",
        "10k keys": b"{" + b",".join(b'"k%d":1' % i for i in range(10_000)) + b"}",
    }


@pytest.mark.parametrize("name", sorted(JSON_DECODERS))
def test_hostile_json_is_invalid_not_an_exception(name):
    """Deep nesting (the reward flow's crash loop), huge numbers, NaN/inf, bad UTF-8 and surrogates, odd
    documents: each gives Invalid with a reason; the deep ones say so and are 'malformed'."""
    codec = JSON_DECODERS[name][0]
    sample = codec.encode(_SAMPLES[name]())
    results = {label: _record_or_invalid(name, p) for label, p in _hostile_json(sample).items()}
    for label in ("deep object without a tag", "deep array, 100k", "deep object, 100k", "NaN", "invalid UTF-8"):
        assert isinstance(results[label], Invalid), label
    assert "nested too deeply" in results["deep object without a tag"].reason or name != "events"
    for label, r in results.items():
        if label.startswith("deep"):
            assert isinstance(r, Invalid) and r.kind in {"malformed", "oversize", "invalid", "unknown_type"}, label
        if label in ("1e400", "5000 digits", "NaN", "Infinity"):
            assert isinstance(r, Invalid), label


#: one valid record per topic, whose fields the hostile payloads sit beside
_SAMPLES = {
    "events": lambda: event_codec().decode(_payloads(1, seed=1)[0][1]),
    "rollouts": lambda: ro("t1"),
    "rewards": lambda: rw("t1", 0.5),
    "deployments": lambda: Checkpoint(
        version=1,
        parent=0,
        created_at=1,
        steps=2,
        samples=3,
        tokens=4,
        eval_results={"solve": 0.5},
        status="promoted",
        reason="ok",
        kafka_offsets={"rtrl.batches/0": 7},
        path="/ckpt/1",
    ),
    "experiments": lambda: Experiment(
        key="final-ab-0-v3-v0",
        status="running",
        created_at=1,
        share=0.5,
        serving_version=3,
        serving_arm="ab-final",
        candidate_version=0,
        candidate_path="/ckpt/v0",
        candidate_arm="ab-v0",
    ),
    "dead_letters": lambda: dead_letter("malformed", "$", "why", "rtrl.events", 0, 1, b"k", b"{oops", 5),
}


def test_json_size_limit_counts_bytes_of_text_too():
    """A str payload is measured in UTF-8 bytes, as Kafka would carry it."""
    codec = JsonCodec(Reward, max_bytes=1000)
    with pytest.raises(Invalid) as err:
        codec.decode('"' + "\u20ac" * 400 + '"')  # 400 characters, 1200 bytes
    assert err.value.kind == "oversize"


# ---------------------------------------------------------------- micro-batches: crafted cases (in process)

_MB = MicroBatch(
    batch_id="b",
    created_at=1,
    seq_len=4,
    token_ids=[[1, 2, 3, 4], [5, 6, 7, 8]],
    loss_mask=[[1, 1, 0, 0], [1, 1, 0, 0]],
    advantages=[[0.5] * 4, [0.5] * 4],
    behaviour_logprobs=[[-1.0] * 4, [-1.0] * 4],
    segment_ids=[[0, 0, -1, -1], [0, 0, -1, -1]],
    sample_ids=["s"],
    policy_versions=[0],
)
#: a one-byte corruption of encode_batch(_MB) (the high byte of the token_ids outer list's second offset: its
#: buffer starts at 3336 since micro-batches carry reward_version, delayed, adapter, adapter_versions, served_org
#: and data_use) that segfaulted the old decoder
_SEGFAULT = (3343, 248)


def _ipc(table: pa.Table, **options) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _invalid(data: bytes | None, limits: BatchLimits | None = None) -> Invalid:
    with pytest.raises(Invalid) as err:
        to_batch(data, 0, 0, limits)  # type: ignore[arg-type]  # None is a tombstone
    _check_invalid(err.value)
    return err.value


def test_crafted_micro_batches_are_invalid():
    """Compressed bodies (a sender-declared inflated size), dictionary columns, two rows, the old segfault,
    a null value and oversize payloads are refused with a reason; the valid batch still decodes."""
    table = to_arrow([_MB], MicroBatch)
    assert decode_batch(_ipc(table)) == _MB
    for codec in ("zstd", "lz4"):
        assert "compressed" in _invalid(_ipc(table, compression=codec)).reason
    col = table.schema.get_field_index("batch_id")
    dictionary = table.set_column(col, "batch_id", table.column(col).dictionary_encode())
    assert _invalid(_ipc(dictionary)).field == "$.batch_id"
    assert "one micro-batch row" in _invalid(_ipc(pa.concat_tables([table, table]))).reason
    broken = bytearray(encode_batch(_MB))
    broken[_SEGFAULT[0]] = _SEGFAULT[1]
    assert "Offset" in _invalid(bytes(broken)).reason
    assert _invalid(None).kind == "malformed"
    assert _invalid(b"").kind == "malformed"
    with pytest.raises(Invalid) as err:
        decode_batch_table(encode_batch(_MB), max_bytes=100)
    assert err.value.kind == "oversize"


def _with(**changes) -> bytes:
    return encode_batch(msgspec.structs.replace(_MB, **changes))


def test_decoded_batches_that_would_stop_training_are_invalid():
    """Well-formed micro-batches the trainer cannot use: no rows, a loss mask of 2, a negative or
    out-of-vocabulary token, NaN or infinity on a trained token, a shape beyond the limits. NaN on padding
    (loss mask 0) is the loss's business and passes."""
    nan_adv = [[math.nan, 0.5, 0.5, 0.5], [0.5] * 4]
    inf_blp = [[-1.0, -math.inf, -1.0, -1.0], [-1.0] * 4]
    empty = dict(token_ids=[], loss_mask=[], advantages=[], behaviour_logprobs=[], segment_ids=[])
    assert _invalid(_with(**empty)).field == "$.token_ids"
    assert _invalid(_with(loss_mask=[[2, 1, 0, 0], [1, 1, 0, 0]])).field == "$.loss_mask"
    assert _invalid(_with(token_ids=[[1, -2, 3, 4], [5, 6, 7, 8]])).field == "$.token_ids"
    assert _invalid(_with(advantages=nan_adv)).field == "$.advantages"
    assert _invalid(_with(behaviour_logprobs=inf_blp)).field == "$.behaviour_logprobs"
    limits = BatchLimits(max_seq_len=4, max_rows=2, vocab_size=8)
    assert _invalid(_with(token_ids=[[1, 2, 3, 4], [5, 6, 7, 8]]), limits).field == "$.token_ids"  # 8 >= vocab 8
    assert _invalid(_with(token_ids=[[1, 2, 3, 4], [5, 6, 7, 7]]), BatchLimits(max_seq_len=3)).field == "$.seq_len"
    assert _invalid(_with(token_ids=[[1, 2, 3, 4], [5, 6, 7, 7]]), BatchLimits(max_rows=1)).field == "$.token_ids"
    rows4 = _with(token_ids=[[1, 2, 3, 4], [5, 6, 7, 7]])  # 4 tokens per row: 3 positions
    assert "multiple of parallel.tp" in _invalid(rows4, BatchLimits(seq_multiple=2)).reason  # SP over tp = 2
    assert to_batch(rows4, 0, 0, BatchLimits(seq_multiple=3)).tokens.shape == (2, 4)
    ok = to_batch(_with(advantages=[[0.5, 0.5, math.nan, math.inf], [0.5] * 4]), 0, 0, BatchLimits(4, 2, 9))
    assert ok.tokens.shape == (2, 4) and np.isnan(ok.advantages[0, 2])


# ---------------------------------------------------------------- micro-batches: fuzz in a child process

_CHILD = r"""
import sys
from tests.test_fuzz_decoders import _ipc_fuzz
_ipc_fuzz(sys.argv[1], int(sys.argv[2]))
"""


def _ipc_payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(micro_batches().map(encode_batch), st.just(encode_batch(_MB)))


def _ipc_fuzz(last_path: str, examples: int) -> None:
    """Run in a child: to_batch (and so decode_batch, decode_batch_table) over random and mutated IPC
    streams; each payload is written to ``last_path`` first, so a crash names the payload that did it."""
    limits = BatchLimits(max_seq_len=8, max_rows=3, vocab_size=2**31 - 1)
    stats = {"records": 0, "invalid": 0}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        st.one_of(
            mutated(_ipc_payloads()),
            mutated(_ipc_payloads(), max_ops=1),
            mutated(_ipc_payloads(), max_ops=16),
            st.binary(max_size=4096),
        )
    )
    def fuzz(payload: bytes) -> None:
        with open(last_path, "wb") as f:
            f.write(payload)
        for lim in (None, limits):
            try:
                b = to_batch(payload, 0, 0, lim)
            except Invalid as e:
                _check_invalid(e)
                stats["invalid"] += 1
            else:
                assert b.tokens.ndim == 2 and b.tokens.shape == b.loss_mask.shape == b.segment_ids.shape
                stats["records"] += 1

    fuzz()
    # the segfault found before the fix, always included
    broken = bytearray(encode_batch(_MB))
    broken[_SEGFAULT[0]] = _SEGFAULT[1]
    with open(last_path, "wb") as f:
        f.write(bytes(broken))
    try:
        to_batch(bytes(broken), 0, 0)
        raise AssertionError("the old segfault payload decoded")
    except Invalid as e:
        _check_invalid(e)
    print(json.dumps(stats), flush=True)


@pytest.mark.slow
def test_mutated_arrow_ipc_never_crashes_the_decoder(tmp_path):
    """~300 random and mutated micro-batch payloads (plus the byte that used to segfault) through
    trainer.batch.to_batch in a child process: it exits 0 with every payload a batch or Invalid; a crash
    fails with the payload's hex."""
    last = tmp_path / "last_payload"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(last), "300"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        payload = last.read_bytes().hex() if last.exists() else "(none)"
        pytest.fail(
            f"the decoder's process ended with {proc.returncode} on payload {payload}\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-4000:]}"
        )
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["invalid"] > 0 and stats["records"] + stats["invalid"] >= 2 * 300


# ---------------------------------------------------------------- end to end: the reward flow


def _hostile_events(sample: bytes) -> list[bytes]:
    h = _hostile_json(sample)
    keys = ("deep object without a tag", "deep value before the tag", "deep object under the limit")
    return [cast(bytes, h[k]) for k in keys]


def _reward_run(broker, ch_client, ch_dsn, tmp_path, payloads, name: str) -> tuple[list, list, list]:
    """One run of the reward flow over ``payloads`` on its own topics and database: (rewards FINAL without
    the wall-clock stamp, dead letters on the topic, dead letters in the table)."""
    prefix, db = f"fuzz{uuid.uuid4().hex[:8]}.", f"fuzz_{uuid.uuid4().hex[:10]}"
    ensure_topics(broker.bootstrap, prefix, 1)
    clickhouse.migrate(ch_client, db)
    try:
        _produce(broker.bootstrap, prefix + "events", payloads)
        run_main(build_flow(_settings(_services_env(broker, prefix, ch_dsn, db, tmp_path / name))))
        rewards = sorted(
            msgspec.json.encode(msgspec.structs.replace(r, emitted_at=0))
            for r in clickhouse.select(ch_client, db, "rewards")
        )
        dl_codec: JsonCodec[DeadLetter] = JsonCodec(DeadLetter)
        topic = [dl_codec.decode(m.value()) for m in read_topic(broker.bootstrap, prefix + "dead_letters")]
        table = clickhouse.select(ch_client, db, "dead_letters")
        return rewards, topic, table
    finally:
        ch_client.command(f"DROP DATABASE IF EXISTS {db}")


@pytest.mark.slow
def test_hostile_events_are_dead_lettered_and_the_reward_flow_goes_on(broker, ch_client, ch_dsn, tmp_path):
    """Deeply nested events between valid ones (the input that made the flow raise, and crash-loop on
    restart): they reach rtrl.dead_letters and the dead_letters table as malformed, the flow ends normally,
    and the rewards of the valid events equal those of a run without the hostile ones."""
    payloads = _payloads(40, seed=41, duplicate_rate=0.0)
    hostile = _hostile_events(payloads[0][1])
    mixed = list(payloads)
    for i, h in enumerate(hostile):
        mixed.insert((i + 1) * len(payloads) // (len(hostile) + 1) + i, (b"k", h))
    clean_rewards, clean_topic, clean_table = _reward_run(broker, ch_client, ch_dsn, tmp_path, payloads, "clean")
    rewards, topic, table = _reward_run(broker, ch_client, ch_dsn, tmp_path, mixed, "hostile")
    assert clean_rewards and not clean_topic and not clean_table
    assert rewards == clean_rewards
    hostile_offsets = sorted(i for i, (_, v) in enumerate(mixed) if v in hostile)
    for dead in (topic, table):
        assert sorted(d.offset for d in dead) == hostile_offsets
        assert {d.kind for d in dead} == {"malformed"} and all(d.reason for d in dead)
    assert any("nested too deeply" in d.reason for d in table)


# ---------------------------------------------------------------- end to end: the trainer


def _corrupted_batches(valid: bytes) -> list[bytes]:
    """Micro-batches the trainer must skip: the first one-byte corruption (scanning the body) that decodes
    Invalid, truncation, a NaN advantage on a trained token, a token id beyond the vocabulary."""
    corrupt = None
    for pos in range(len(valid) // 2, len(valid)):
        b = bytearray(valid)
        b[pos] ^= 0xF8
        try:
            to_batch(bytes(b), 0, 0)
        except Invalid:
            corrupt = bytes(b)
            break
    assert corrupt is not None
    mb = decode_batch(valid)
    nan = [list(r) for r in mb.advantages]
    row, col = map(int, np.argwhere(np.asarray(mb.loss_mask) > 0)[0])
    nan[row][col] = math.nan
    huge = [list(r) for r in mb.token_ids]
    huge[0][0] = 2**31 - 1
    return [
        corrupt,
        valid[: len(valid) // 2],
        encode_batch(msgspec.structs.replace(mb, batch_id="nan", advantages=nan)),
        encode_batch(msgspec.structs.replace(mb, batch_id="huge", token_ids=huge)),
    ]


def _train_run(broker, tmp_path, payloads: list[bytes], name: str) -> tuple[list, list]:
    """``rtrl train`` over ``payloads`` on its own topics and data folder: (train_metrics rows, dead letters)."""
    prefix, data = f"fuzz{uuid.uuid4().hex[:8]}.", tmp_path / name
    ensure_topics(broker.bootstrap, prefix, 1)
    p = Producer(producer_config(broker.bootstrap))
    for v in payloads:
        p.produce(prefix + "batches", value=v, partition=0)
    assert p.flush(10) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": prefix,
        "RTRL_DATA_DIR": str(data),
        "RTRL_TRAIN__STEPS": "2",
        "RTRL_TRAIN__IDLE_TIMEOUT_S": "5",
        "RTRL_TRAIN__RUN_ID": "fuzz-run",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "train"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    dump = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from rtrl import clickhouse\n"
            f"ch = clickhouse.connect('chdb://{data}/clickhouse')\n"
            "print(json.dumps(ch.query('SELECT step, batch_ids, sample_ids, loss, pg_loss, kl, tokens FROM "
            "rtrl.train_metrics FINAL ORDER BY step').result_rows, default=str))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dump.returncode == 0, dump.stderr[-3000:]
    dl_codec: JsonCodec[DeadLetter] = JsonCodec(DeadLetter)
    dead = [dl_codec.decode(m.value()) for m in read_topic(broker.bootstrap, prefix + "dead_letters")]
    return json.loads(dump.stdout.strip().splitlines()[-1]), dead


@pytest.mark.slow
def test_corrupted_micro_batches_are_dead_lettered_and_training_goes_on(broker, tmp_path):
    """Corrupted and untrainable micro-batches between valid ones on rtrl.batches: ``rtrl train`` dead-letters
    each with a reason, trains its steps, and its steps' batches and losses equal a run without them."""
    valid = [encode_batch(_to_micro(b)) for b in synthetic_batches(4)]
    bad = _corrupted_batches(valid[0])
    mixed = [valid[0], bad[0], valid[1], bad[1], bad[2], valid[2], bad[3], valid[3]]
    clean_steps, clean_dead = _train_run(broker, tmp_path, valid, "clean")
    steps, dead = _train_run(broker, tmp_path, mixed, "mixed")
    assert [s[1] for s in clean_steps] == [["b000", "b001"], ["b002", "b003"]] and not clean_dead
    assert [s[:3] for s in steps] == [s[:3] for s in clean_steps]
    np.testing.assert_array_equal([s[3:] for s in steps], [s[3:] for s in clean_steps])
    assert sorted(d.offset for d in dead) == [1, 3, 4, 6]
    assert all(d.reason and d.kind in KINDS for d in dead)
    assert {d.field for d in dead if d.offset in (4, 6)} == {"$.advantages", "$.token_ids"}
