"""Closed-loop figures: cycle time by stage, on-policy token fraction, last event -> trainable latency.

    .venv/bin/python bench/loop.py [--cycles 6] [--samples 2048]

About 3 minutes on 2 vCPUs. Runs :class:`app.loop.Loop` in this process on a fresh local broker and
embedded ClickHouse (reward v2, the main job's settings otherwise), then reads back what happened:

1. **Cycle time by stage**: per cycle, the wall time the trainer spent until the samples trigger
   fired (waiting for micro-batches included) and the eval gate's time; next to it, the trainer's own
   compute for the same steps (sum over steps of tokens / tokens_per_s is not available, so the
   baseline is the same steps replayed from memory right after the run: ``trainer.train.train`` on
   a ``MemorySource`` of the cycle's micro-batches) - the ratio says what the streaming loop costs
   on top of training.
2. **On-policy token fraction** per cycle (``train_metrics``), steady state = cycles 2..N; aim >= 0.95
   with ``max_policy_lag=1``.
3. **Latency from a trajectory's last event to its sample being trainable** (its micro-batch appended
   to ``rtrl.batches``), p50/p99, split into the reward flow's part (last event -> reward emitted)
   and the batch flow's part (reward emitted -> micro-batch appended).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from app.loop import Loop  # noqa: E402
from app.parts import PART_LIST  # noqa: E402
from app.services import Services  # noqa: E402
from rtrl.kafka import read_topic  # noqa: E402
from rtrl.sections.trainer import TrainConfig  # noqa: E402
from rtrl.settings import load_settings  # noqa: E402
from schemas.codec import decode_batch  # noqa: E402
from trainer.batch import to_batch  # noqa: E402
from trainer.factory import Policy  # noqa: E402
from trainer.train import MemorySource, train  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--samples", type=int, default=2048)
    args = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="rtrl-bench-loop-")
    s = load_settings(
        env={
            "RTRL_DATA_DIR": tmp,
            "RTRL_LOOP__CYCLES": str(args.cycles),
            "RTRL_LOOP__SAMPLES_PER_CYCLE": str(args.samples),
        }
    )
    services = Services(s)
    loop = Loop(s, services.bootstrap, services.ch)
    results = []
    try:
        t = time.monotonic()
        loop.initial()
        loop.start_flows([p.flow for p in PART_LIST if p.flow is not None])
        loop.start_server()
        startup = time.monotonic() - t
        for _ in range(args.cycles):
            r = loop.cycle()
            results.append(r)
            print(
                f"  v{r.version}: {r.status}, {len(r.steps)} steps, train {r.seconds['train']:.1f}s, "
                f"eval {r.seconds['eval']:.1f}s",
                flush=True,
            )
    finally:
        loop.close()
    db = loop.db
    try:
        msgs = list(read_topic(services.bootstrap, s.topic("batches")))
        ch = services.ch
        last = dict(ch.query(f"SELECT trajectory_id, last_event_ts FROM {db}.trajectories FINAL").result_rows)
        emitted = dict(
            ch.query(
                f"SELECT trajectory_id, emitted_at FROM {db}.rewards FINAL WHERE reward_version = 'v2' AND revision = 0"
            ).result_rows
        )
    finally:
        services.close()
    batches = {}
    e2e, flow_part, batch_part = [], [], []
    for m in msgs:
        mb = decode_batch(m.value())
        batches[mb.batch_id] = m.value()
        appended = m.timestamp()[1]
        for sid in mb.sample_ids:
            if sid in last and sid in emitted:
                lt = last[sid].timestamp() * 1000 if hasattr(last[sid], "timestamp") else last[sid]
                em = emitted[sid].timestamp() * 1000 if hasattr(emitted[sid], "timestamp") else emitted[sid]
                e2e.append(appended - lt)
                flow_part.append(em - lt)
                batch_part.append(appended - em)

    # baseline: the same steps replayed from memory on a fresh copy of the v0 weights
    ratios = []
    print(
        "\n[1] cycle time by stage (seconds): streamed training until the samples trigger vs the same "
        "micro-batches replayed from memory"
    )
    for r in results:
        ids = [bid for st in r.steps for bid in st.batch_ids]
        mem = [to_batch(batches[b], 0, i) for i, b in enumerate(ids) if b in batches]
        loop.model.load_state_dict(loop.reference.state_dict())
        # the loop's own training config (one mapping: TrainConfig.from_settings), every replayed sample kept
        tc = TrainConfig.from_settings(loop.settings, steps=len(r.steps), resume=False)
        tc = tc.model_copy(update={"max_policy_lag": 10**6, "max_delayed_lag": 0})
        t = time.monotonic()
        train(Policy(loop.model, loop.reference, version=r.parent), lambda _o, m=mem: MemorySource(m), tc)  # type: ignore[misc]
        base = time.monotonic() - t
        ratios.append(r.seconds["train"] / max(base, 1e-9))
        print(
            f"  v{r.version}: streamed {r.seconds['train']:6.1f} | from memory {base:5.1f} | ratio {ratios[-1]:4.1f} "
            f"| eval gate {r.seconds['eval']:4.1f} | {len(r.steps)} steps"
        )
    print(
        f"  startup (broker, ClickHouse, warm start, flows): {startup:.1f}s; median ratio streamed/memory "
        f"{statistics.median(ratios):.1f}"
    )
    onp = [
        sum(st.on_policy_fraction * st.tokens for st in r.steps) / max(1, sum(st.tokens for st in r.steps))
        for r in results
    ]
    steady = onp[1:] or onp
    print(
        f"\n[2] on-policy token fraction per cycle: {', '.join(f'{x:.3f}' for x in onp)}; steady state (cycles 2..) "
        f"mean {statistics.mean(steady):.3f} (aim >= 0.95 with max_policy_lag=1)"
    )
    if e2e:
        print(
            f"\n[3] last event -> trainable (micro-batch appended), {len(e2e):,} samples: p50 {pct(e2e, 0.5):,.0f} ms, "
            f"p99 {pct(e2e, 0.99):,.0f} ms; reward flow part p50 {pct(flow_part, 0.5):,.0f} ms, batch flow part "
            f"p50 {pct(batch_part, 0.5):,.0f} ms"
        )
    os._exit(0)


if __name__ == "__main__":
    main()
