"""Trainer throughput reading micro-batches from Kafka next to the same model fed the same batches from
memory, same run: does the data path starve the trainer?

N packed micro-batches (default 40 of 8 rows x 64 tokens, several samples per row, ~60% of tokens
loss-masked, two policy versions) are encoded once as Arrow IPC and produced once, in order, to one
partition of a ``batches`` topic on a local noida-db broker. Then, alternating for ``--rounds``
rounds, the tiny CPU model (``ModelSettings.tiny()``, fp32) is trained with ``trainer.train.train``

- from memory: a ``MemorySource`` over the already decoded ``Batch`` objects (decode not timed), and
- from Kafka: a ``trainer.data.BatchStream`` on the topic (poll + Arrow decode + validation inside
  the loop),

each time with a fresh model and reference from the same seed, the same steps (2 micro-batches per
step) and the same batch order, so both runs compute the same losses (checked). Reported, medians
over the rounds, for each torch thread count in ``--torch-threads`` (default: torch's own, then 1):

- *trained* tokens/s (loss-masked tokens, what the loss sums over) and *processed* tokens/s
  (rows x seq_len, what the model computes), steady state: from the end of the first optimizer
  step to the end of the last (the first step carries one-off costs: opening the stream, the
  consumer's first fetch, torch's first-call overheads);
- the same over the whole ``train()`` call, stream opening included;
- the Kafka/memory ratio (aim >= 0.9);
- CPU used per step by the trainer process (its librdkafka threads included) and by the broker;
- what the data path costs on its own: ``to_batch`` per micro-batch (split into Arrow IPC read +
  schema check, validating conversion to the record, and the numpy arrays), ``prepare`` (same on
  both sides), and draining the topic through ``BatchStream.get`` without training.

Why thread counts: on a small machine the broker and the consumer's background threads share the
cores torch's intra-op threads use; a torch thread count equal to the core count then stalls at
every parallel region. (noida-db answers an empty fetch at once instead of holding it for
``fetch.wait.max.ms``, so a consumer at the end of its partition costs it ~40% of a core, and the
consumer process as much again, while it waits.)

    .venv/bin/python bench/trainer_input.py [--batches 40] [--rows 8] [--seq 64] [--rounds 5] \\
        [--torch-threads default,1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import numpy as np


def micro_batches(n: int, rows: int, seq: int, vocab: int, seed: int = 0) -> list:
    """Packed micro-batches like the batcher writes them: each row holds whole samples (prompt, then a
    loss-masked completion) back to back, padding (segment -1) after the last one."""
    from schemas.records import MicroBatch

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(1, vocab, (rows, seq))
        seg = np.full((rows, seq), -1, np.int64)
        mask = np.zeros((rows, seq), np.int64)
        adv = np.zeros((rows, seq), np.float32)
        beh = np.zeros((rows, seq), np.float32)
        sample_ids: list[str] = []
        versions: list[int] = []
        for r in range(rows):
            pos = 0
            while True:
                prompt, completion = int(rng.integers(3, 9)), int(rng.integers(8, 25))
                if pos + prompt + completion > seq:
                    if pos == 0:  # a row always holds at least one (truncated) sample
                        completion = seq - prompt
                    else:
                        break
                k, end = len(sample_ids), pos + prompt + completion
                seg[r, pos:end] = k
                mask[r, pos + prompt : end] = 1
                adv[r, pos + prompt : end] = rng.normal()
                beh[r, pos + prompt : end] = rng.uniform(-8.0, -0.05, completion)
                sample_ids.append(f"traj-{i:05d}-{k:03d}")
                versions.append(int(rng.integers(0, 2)))
                pos = end
            tokens[r, pos:] = 0
        out.append(
            MicroBatch(
                batch_id=f"bench-{i:05d}",
                created_at=1_700_000_000_000 + i,
                seq_len=seq,
                token_ids=tokens.tolist(),
                loss_mask=mask.tolist(),
                advantages=adv.tolist(),
                behaviour_logprobs=beh.tolist(),
                segment_ids=seg.tolist(),
                sample_ids=sample_ids,
                policy_versions=versions,
            )
        )
    return out


def median_us(fn, items, repeat: int = 3) -> float:
    """Median over ``repeat`` passes of the mean time per item, in microseconds."""
    per = []
    for _ in range(repeat):
        t = time.perf_counter()
        for x in items:
            fn(x)
        per.append((time.perf_counter() - t) / len(items) * 1e6)
    return statistics.median(per)


def decode_costs(payloads: list[bytes], seq: int) -> dict[str, float]:
    from schemas.codec import decode_batch, decode_batch_table
    from schemas.records import MicroBatch
    from schemas.types import from_arrow
    from trainer.batch import to_batch
    from trainer.train import prepare

    tables = [decode_batch_table(p) for p in payloads]
    records = [decode_batch(p) for p in payloads]
    batches = [to_batch(p, 0, i) for i, p in enumerate(payloads)]

    def arrays(mb):
        rows = len(mb.token_ids)
        for name in ("token_ids", "loss_mask", "advantages", "behaviour_logprobs", "segment_ids"):
            np.asarray(getattr(mb, name)).reshape(rows, seq)

    return {
        "to_batch": median_us(lambda p: to_batch(p, 0, 0), payloads),
        "ipc_read_schema": median_us(decode_batch_table, payloads),
        "to_record": median_us(lambda t: from_arrow(t, MicroBatch), tables),
        "to_numpy": median_us(arrays, records),
        "prepare": median_us(lambda b: prepare(b, 1, 4), batches),
    }


def broker_cpu_s(data_dir: str | None) -> float:
    """CPU seconds used so far by the noida-db processes serving ``data_dir`` (this bench's broker only)."""
    if data_dir is None:
        return 0.0
    import psutil

    total = 0.0
    for p in psutil.process_iter(["cmdline"]):
        try:
            if data_dir in " ".join(p.info["cmdline"] or []):
                c = p.cpu_times()
                total += c.user + c.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def train_round(
    source_kind: str, cfg, make_source, steps: int, mbs: int, policy_version: int, broker_dir: str | None = None
) -> dict:
    from rtrl.sections.trainer import TrainConfig
    from trainer.factory import Policy
    from trainer.model import build_model
    from trainer.train import Hooks, train

    model, reference = build_model(cfg), build_model(cfg)
    reference.load_state_dict(model.state_dict())
    ends: list[float] = []
    tc = TrainConfig(
        run_id=f"bench-{source_kind}",
        steps=steps,
        micro_batches_per_step=mbs,
        checkpoint_dir="",
        idle_timeout_s=30,
        max_policy_lag=4,
        max_delayed_lag=0,
        checkpoint_every=5,
    )
    b0, c0 = broker_cpu_s(broker_dir), time.process_time()
    t0 = time.perf_counter()
    records = train(
        Policy(model, reference, version=policy_version),
        make_source,
        tc,
        Hooks(on_step=lambda s: ends.append(time.perf_counter())),
    )
    total = time.perf_counter() - t0
    cpu, broker = time.process_time() - c0, broker_cpu_s(broker_dir) - b0
    assert len(records) == steps, f"{source_kind}: {len(records)} of {steps} steps"
    tokens = [r.tokens for r in records]
    return {
        "losses": [r.loss for r in records],
        "total_s": total,
        "steady_s": ends[-1] - ends[0],
        "trained_all": sum(tokens),
        "trained_steady": sum(tokens[1:]),
        "cpu_s": cpu,
        "broker_cpu_s": broker,
    }


def drain_s(bootstrap: str, topic: str, n: int) -> tuple[float, float]:
    from trainer.data import BatchStream

    t = time.perf_counter()
    s = BatchStream(bootstrap, topic, topic.rsplit(".", 1)[0] + ".dead_letters", timeout_s=10)
    opened = time.perf_counter()
    got = 0
    while got < n:
        assert s.get(timeout_s=10) is not None, f"drain: only {got} of {n}"
        got += 1
    end = time.perf_counter()
    s.close()
    return end - opened, opened - t


def rates(rs: list[dict], steps: int, mbs: int, processed_per_mb: int) -> dict[str, float]:
    med = statistics.median
    return {
        "trained_steady": med(r["trained_steady"] / r["steady_s"] for r in rs),
        "processed_steady": med((steps - 1) * mbs * processed_per_mb / r["steady_s"] for r in rs),
        "trained_total": med(r["trained_all"] / r["total_s"] for r in rs),
        "processed_total": med(steps * mbs * processed_per_mb / r["total_s"] for r in rs),
        "step_ms": med(r["steady_s"] / (steps - 1) * 1e3 for r in rs),
        "total_s": med(r["total_s"] for r in rs),
        "cpu_per_step_ms": med(r["cpu_s"] / steps * 1e3 for r in rs),
        "broker_per_step_ms": med(r["broker_cpu_s"] / steps * 1e3 for r in rs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40, help="micro-batches (an even number: 2 per step)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="alternating memory/Kafka rounds per thread setting")
    ap.add_argument(
        "--torch-threads",
        default="default,1",
        help="comma list of torch intra-op thread counts to run ('default' = torch's own choice)",
    )
    args = ap.parse_args()
    mbs = 2
    steps = args.batches // mbs

    import megatron.core
    import torch
    from confluent_kafka import Producer

    from devservices.broker import LocalBroker
    from rtrl.kafka import ensure_topics, producer_config
    from rtrl.sections.trainer import ModelSettings
    from schemas.codec import encode_batch
    from trainer.batch import to_batch
    from trainer.data import BatchStream
    from trainer.model import init_parallel
    from trainer.train import MemorySource

    default_threads = torch.get_num_threads()
    thread_settings = [default_threads if t == "default" else int(t) for t in args.torch_threads.split(",")]
    cfg = ModelSettings.tiny(seq_length=args.seq)
    records = micro_batches(args.batches, args.rows, args.seq, cfg.vocab_size)
    payloads = [encode_batch(mb) for mb in records]
    batches = [to_batch(p, 0, i) for i, p in enumerate(payloads)]
    processed_per_mb = args.rows * args.seq
    masked = sum(int(b.loss_mask.sum()) for b in batches) / (len(batches) * processed_per_mb)
    samples = sum(len(b.sample_ids) for b in batches) / len(batches)
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, torch {torch.__version__} (default {default_threads} threads), "
        f"megatron-core {megatron.core.__version__}"
    )
    print(
        f"input: {len(batches)} micro-batches of {args.rows} x {args.seq} tokens, {samples:.1f} samples each, "
        f"{masked:.0%} loss-masked, {statistics.mean(map(len, payloads)) / 1e3:.1f} kB Arrow IPC each; "
        f"{steps} steps x {mbs} micro-batches; model: tiny ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}), fp32"
    )

    init_parallel(cfg)
    costs = decode_costs(payloads, args.seq)
    results: dict[int, tuple[dict, dict]] = {}

    with tempfile.TemporaryDirectory() as d, LocalBroker(d) as broker:
        broker_dir = str(broker.data_dir)
        prefix = "bench."
        ensure_topics(broker.bootstrap, prefix, 2)
        topic = prefix + "batches"
        p = Producer(producer_config(broker.bootstrap))
        for mb, value in zip(records, payloads):  # one partition: the stream sees the memory order
            p.produce(topic, value=value, key=mb.batch_id.encode(), partition=0)
        assert p.flush(30) == 0
        dl = prefix + "dead_letters"
        make_kafka = lambda off: BatchStream(broker.bootstrap, topic, dl, start=off, timeout_s=10)  # noqa: E731
        make_memory = lambda off: MemorySource(batches, off)  # noqa: E731

        # warm-up (not counted): torch's first-call overheads, the broker's first fetch of the topic
        train_round("warmup", cfg, make_memory, 2, mbs, 1)
        drain, open_s = zip(*(drain_s(broker.bootstrap, topic, len(batches)) for _ in range(3)))
        for threads in thread_settings:
            torch.set_num_threads(threads)
            runs: dict[str, list[dict]] = {"memory": [], "kafka": []}
            for _ in range(args.rounds):  # alternate: both see the same machine state
                runs["memory"].append(train_round("memory", cfg, make_memory, steps, mbs, 1, broker_dir))
                runs["kafka"].append(train_round("kafka", cfg, make_kafka, steps, mbs, 1, broker_dir))
            for m, k in zip(runs["memory"], runs["kafka"]):
                assert np.allclose(m["losses"], k["losses"], rtol=1e-5, atol=1e-7), "Kafka and memory runs differ"
            results[threads] = (
                rates(runs["memory"], steps, mbs, processed_per_mb),
                rates(runs["kafka"], steps, mbs, processed_per_mb),
            )
        torch.set_num_threads(default_threads)

    for threads, (mem, kaf) in results.items():
        print(
            f"\ntorch threads {threads}{' (default)' if threads == default_threads else ''}: median of "
            f"{args.rounds} alternating rounds; Kafka and memory runs computed the same losses"
        )
        print(f"{'':36}{'memory':>12}{'kafka':>12}{'kafka/memory':>14}")
        for key, label in (
            ("trained_steady", "trained tokens/s, steady"),
            ("processed_steady", "processed tokens/s, steady"),
            ("trained_total", "trained tokens/s, whole train()"),
            ("processed_total", "processed tokens/s, whole train()"),
        ):
            print(f"{label:36}{mem[key]:>12,.0f}{kaf[key]:>12,.0f}{kaf[key] / mem[key]:>14.3f}")
        print(f"{'ms per step, steady':36}{mem['step_ms']:>12.1f}{kaf['step_ms']:>12.1f}")
        print(f"{'whole train() call, s':36}{mem['total_s']:>12.2f}{kaf['total_s']:>12.2f}")
        print(f"{'trainer process CPU ms per step':36}{mem['cpu_per_step_ms']:>12.1f}{kaf['cpu_per_step_ms']:>12.1f}")
        print(f"{'broker CPU ms per step':36}{mem['broker_per_step_ms']:>12.1f}{kaf['broker_per_step_ms']:>12.1f}")

    step_us = min(m["step_ms"] for m, _ in results.values()) * 1e3
    print("\ndata path on its own (per micro-batch, median):")
    share = costs["to_batch"] * mbs / step_us
    print(
        f"  to_batch (Kafka side only)         {costs['to_batch']:9.0f} us  = {share:.1%} "
        f"of the fastest memory step; {processed_per_mb / costs['to_batch'] * 1e6:,.0f} processed tokens/s"
    )
    print(f"    Arrow IPC read + schema check    {costs['ipc_read_schema']:9.0f} us")
    print(f"    validating conversion to record  {costs['to_record']:9.0f} us")
    print(f"    numpy arrays                     {costs['to_numpy']:9.0f} us")
    print(f"  prepare (both sides)               {costs['prepare']:9.0f} us")
    d_med = statistics.median(drain)
    print(
        f"  BatchStream.get drain, no training {d_med / len(batches) * 1e6:9.0f} us  "
        f"({len(batches) / d_med:,.0f} micro-batches/s = {len(batches) * processed_per_mb / d_med:,.0f} "
        f"processed tokens/s; opening the stream {statistics.median(open_s) * 1e3:.0f} ms)"
    )
    for threads, (mem, kaf) in results.items():
        ratio = kaf["trained_steady"] / mem["trained_steady"]
        print(
            f"ratio kafka/memory (trained tokens/s, steady), torch threads {threads}: {ratio:.3f}  "
            f"aim >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
