"""Capacity model (issue 18): what a deployment needs for a target load, from this project's measured figures.

    .venv/bin/python bench/capacity.py                  # the worked example: the seed's scale (below)
    .venv/bin/python bench/capacity.py --trajectories-per-day 2e6 --tokens-per-cycle 4e9 --cycle-hours 5 \\
        --params 70e9 --layers 80 --hidden 8192 --gpu h200 --plot /tmp/capacity.png
    .venv/bin/python bench/capacity.py --measure-storage # measure ClickHouse bytes per row on this machine

Input: a target (trajectories a day and events per trajectory, tokens trained per cycle, cycle length) and the
model (parameters, layers, hidden size, mean packed sequence length). Output, as a table with how each figure was
derived:

* the stream side: events/s at peak, Kafka partitions of the events topic, reward-flow workers, window state,
  the ClickHouse insert rate (rows/s and inserts/s per table) and storage per day, the batches topic's
  partitions;
* the trainer side: FLOPs per cycle, trainer GPUs for the model (compute and memory bound, whole nodes of 8),
  from a published MFU or one this project measured (``--mfu``), and whether the trainer's input path keeps up.

The per-worker figures are the ones :data:`MEASURED` quotes from ``bench/RESULTS.md`` (a test keeps the two in
step), measured on a 2-vCPU VM with the broker on the same cores: conservative for a dedicated machine. Storage
per row is measured by ``--measure-storage`` (the real reward processor over simulator events, the real tables in
the embedded ClickHouse engine, compressed bytes on disk after a merge) and recorded the same way. GPU figures are
vendor peaks and a published Megatron-Core MFU (this project's own MFU is pending a GPU session; pass it with
``--mfu`` once measured). Each assumption is a flag; the printed table names them.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).with_name("RESULTS.md")


@dataclass(frozen=True)
class Figure:
    """A figure measured in this project: the number ``bench/RESULTS.md`` records, the text it is recorded in (a
    test checks that the text is there and holds that number, so the model and the record cannot drift
    apart) and the factor to the model's unit (``value``: e.g. MB per 100k open trajectories to bytes per one)."""

    number: float
    unit: str
    quote: str
    where: str
    scale: float = 1.0

    @property
    def value(self) -> float:
        return self.number * self.scale


MEASURED: dict[str, Figure] = {
    "flow_events_per_s": Figure(
        70_232, "events/s per worker", "**70,232 events/s per worker**", "Reward flow, 2026-11-30 (dev-2c)"
    ),
    "sdk_events_per_s": Figure(82_643, "events/s per process", "82,643 events/s", "SDK produce throughput"),
    "event_json_bytes": Figure(
        58.2, "bytes per event (JSON)", "202,593 simulator events (58.2 MB JSON", "Reward flow", 1e6 / 202_593
    ),
    "open_heap_bytes": Figure(
        164.9, "bytes per open trajectory (heap)", "164.9 MB Python heap", "Reward flow, memory", 1e6 / 100_000
    ),
    "open_snapshot_bytes": Figure(
        49.5, "bytes per open trajectory (snapshot)", "49.5 MB pickled snapshot", "Reward flow, memory", 1e6 / 100_000
    ),
    "reader_batches_per_s": Figure(
        2_475, "micro-batches/s per trainer reader", "2,475/s = 1.27M processed tokens/s", "Trainer, input path"
    ),
    "reward_latency_p99_ms": Figure(1_458, "ms, event to reward row (p99)", "p99 1,458 ms", "Reward flow, latency"),
    # bytes on disk per row, compressed, after a merge (--measure-storage; bench/RESULTS.md, "Capacity model")
    "events_row_bytes": Figure(60.9, "bytes per events row", "events 60.9 B/row", "Capacity model, storage"),
    "rewards_row_bytes": Figure(61.0, "bytes per rewards row", "rewards 61.0 B/row", "Capacity model, storage"),
    "trajectories_row_bytes": Figure(
        86.6, "bytes per trajectories row", "trajectories 86.6 B/row", "Capacity model, storage"
    ),
    "rollout_token_bytes": Figure(5.03, "bytes per rollout token", "rollouts 5.03 B/token", "Capacity model, storage"),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense peak, vendor datasheet (SXM)
    memory_gb: float


GPUS = {
    "a100": Gpu("A100 80GB SXM", 312.0, 80.0),
    "h100": Gpu("H100 SXM", 989.0, 80.0),
    "h200": Gpu("H200 SXM", 989.0, 141.0),
    "b200": Gpu("B200", 2250.0, 180.0),
}
#: bytes of model states per parameter in training (bf16 weights, fp32 gradients, master weights, Adam moments)
STATE_BYTES = 18
#: Megatron-Core's published model FLOP utilisation for dense GPT training on H100 clusters ("up to 47%"); 0.40
#: leaves room for RL's shorter steps and packed, variable-length batches
PUBLISHED_MFU = 0.40


@dataclass(frozen=True)
class Target:
    trajectories_per_day: float = 1e6
    events_per_trajectory: float = 10.0
    peak_to_mean: float = 3.0  # daytime peak over the day's mean
    headroom: float = 2.0  # workers for catching up after an outage at this multiple of the peak
    reward_versions: int = 2  # rewards rows per trajectory (the trained version and one candidate)
    tokens_per_cycle: float = 2e9  # trained (loss-masked plus prompt) tokens per cycle
    tokens_per_trajectory: float = 16_000.0  # prompt + completion tokens of one sample (its rollout row)
    cycle_hours: float = 5.0
    train_share: float = 0.5  # of each cycle: training; the rest is the eval gate, promotion and rollout
    params: float = 32e9
    layers: int = 64
    hidden: int = 5120
    seq_len: int = 32_768  # mean packed sequence length
    updates_per_step: int = 1
    kl_reference: bool = True  # a reference model's forward per token (the KL term)
    gpu: str = "h200"
    mfu: float = PUBLISHED_MFU
    window_minutes: float = 30.0  # how long a trajectory's window stays open on average (until its close)
    retention_days: float = 30.0
    replicas: int = 2  # ClickHouse replicas
    flush_s: float = 1.0  # the flow sinks' flush interval (flow.batch_seconds)
    partition_mb_s: float = 5.0  # what one partition of the events topic should carry at most
    rows: int = 8  # rows per micro-batch (batching.rows)
    min_partitions: int = 8  # partitions of the events topic at least, to add workers later without re-keying
    model_parallel: int = 8  # tp x pp of the trainer (the data-parallel ranks are the GPUs over it)


@dataclass(frozen=True)
class Line:
    section: str
    what: str
    value: str
    how: str


def _n(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 10 else f"{x:.2f}"


def _bytes(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:,.1f} {unit}"
    return f"{x:.0f} B"


def attention_span(t: Target) -> float:
    """Tokens a token attends over: its sample's, not the packed row's (the trainer masks attention per sample)."""
    return min(t.seq_len, t.tokens_per_trajectory)


def flops_per_token(t: Target) -> float:
    """Training FLOPs per trained token: forward and backward (6N plus attention, 12 L d s, as Megatron's papers
    count it, s the sample's length) per update, plus the reference model's forward (2N + 4 L d s) for the KL
    term."""
    s = attention_span(t)
    train = 6 * t.params + 12 * t.layers * t.hidden * s
    ref = 2 * t.params + 4 * t.layers * t.hidden * s if t.kl_reference else 0.0
    return t.updates_per_step * train + ref


def trainer_gpus(t: Target) -> tuple[int, int, int]:
    """(GPUs, of which the compute bound, the memory bound), each rounded up to whole nodes of 8."""
    gpu = GPUS[t.gpu]
    seconds = t.cycle_hours * 3600 * t.train_share
    per_gpu = gpu.bf16_tflops * 1e12 * t.mfu * seconds
    compute = math.ceil(t.tokens_per_cycle * flops_per_token(t) / per_gpu)
    # bf16 weights, fp32 gradients (Megatron's DDP accumulates in fp32), fp32 master weights and two Adam moments:
    # 18 bytes a parameter, and 2 of the bf16 reference model, in 60% of a GPU's memory (the rest for activations,
    # not modelled). A lower bound: it assumes every byte sharded, where Megatron's distributed optimizer shards
    # the 12 of master weights and moments over the data-parallel ranks and tensor/pipeline parallelism the rest
    state = t.params * (STATE_BYTES + (2 if t.kl_reference else 0))
    memory = math.ceil(state / (gpu.memory_gb * 1e9 * 0.6))

    def node(n: int) -> int:
        return 8 * math.ceil(n / 8)

    return node(max(compute, memory)), node(compute), node(memory)


def plan(t: Target, measured: dict[str, Figure] = MEASURED) -> list[Line]:
    m = {k: f.value for k, f in measured.items()}
    out: list[Line] = []
    traj_s = t.trajectories_per_day / 86_400
    mean_events = traj_s * t.events_per_trajectory
    peak = mean_events * t.peak_to_mean
    out.append(Line("stream", "events/s, mean / peak", f"{_n(mean_events)} / {_n(peak)}", "target x peak_to_mean"))
    workers = math.ceil(peak * t.headroom / m["flow_events_per_s"])
    out.append(
        Line(
            "stream",
            "reward-flow workers",
            str(workers),
            f"peak x headroom {t.headroom:g} / {_n(m['flow_events_per_s'])} events/s per worker (measured)",
        )
    )
    mb_s = peak * m["event_json_bytes"] / 1e6
    by_bytes = math.ceil(mb_s / t.partition_mb_s)
    # adding partitions later re-keys trajectories and breaks the windows' per-partition state: start with room
    partitions = max(workers, by_bytes, t.min_partitions)
    partitions = workers * math.ceil(partitions / workers)  # each worker the same number of partitions
    out.append(
        Line(
            "stream",
            "events topic partitions",
            str(partitions),
            f"max(workers, {mb_s:,.1f} MB/s at peak / {t.partition_mb_s:g} MB/s a partition, {t.min_partitions} to "
            "grow into: adding some later re-keys open windows), a multiple of workers",
        )
    )
    out.append(
        Line(
            "stream",
            "SDK producer processes at peak",
            str(math.ceil(peak / m["sdk_events_per_s"])),
            f"{_n(m['sdk_events_per_s'])} events/s per process (measured); usually one per agent host anyway",
        )
    )
    open_now = traj_s * t.peak_to_mean * t.window_minutes * 60
    out.append(
        Line(
            "stream",
            "open windows at peak (all workers)",
            f"{_n(open_now)}: {_bytes(open_now * m['open_heap_bytes'])} heap, "
            f"{_bytes(open_now * m['open_snapshot_bytes'])} snapshots",
            f"trajectories/s x {t.window_minutes:g} min open; measured bytes per open trajectory",
        )
    )
    rows = {
        "events": mean_events,
        "rewards": traj_s * t.reward_versions,
        "trajectories": traj_s,
        "rollouts": traj_s,
    }
    inserts = 1 / t.flush_s  # the flow's ClickHouse sink is one partition: one writer, whatever the workers
    for table, r in rows.items():
        out.append(
            Line(
                "clickhouse",
                f"{table}: rows/s mean, peak",
                f"{_n(r)}, {_n(r * t.peak_to_mean)}",
                "one per event"
                if table == "events"
                else f"per trajectory x {t.reward_versions} versions"
                if table == "rewards"
                else "one per trajectory",
            )
        )
    out.append(
        Line(
            "clickhouse",
            "inserts/s per table (flow sinks)",
            f"{_n(inserts)}",
            f"1 / flow.batch_seconds {t.flush_s:g}: the flow's ClickHouse sink is one writer (it caps a flow's "
            "rows/s, not the workers' reading); keep it under ~10/s a table",
        )
    )
    per_day = {
        "events": rows["events"] * 86_400 * m["events_row_bytes"],
        "rewards": rows["rewards"] * 86_400 * m["rewards_row_bytes"],
        "trajectories": rows["trajectories"] * 86_400 * m["trajectories_row_bytes"],
        "rollouts": t.trajectories_per_day * t.tokens_per_trajectory * m["rollout_token_bytes"],
    }
    for table, b in per_day.items():
        out.append(Line("clickhouse", f"{table}: storage per day", _bytes(b), "rows/day x measured bytes/row"))
    total = sum(per_day.values()) * t.replicas * t.retention_days
    out.append(
        Line(
            "clickhouse",
            f"storage for {t.retention_days:g} days, {t.replicas} replicas",
            _bytes(total),
            "compressed, as measured on disk",
        )
    )
    flops = t.tokens_per_cycle * flops_per_token(t)
    out.append(
        Line(
            "trainer",
            "FLOPs per trained token / per cycle",
            f"{flops_per_token(t):.3g} / {flops:.3g}",
            f"{t.updates_per_step} x (6N + 12 L d s)"
            + (" + reference forward (2N + 4 L d s)" if t.kl_reference else "")
            + f", s = {attention_span(t):,.0f} (a sample's tokens: attention is masked per sample)",
        )
    )
    gpus, compute, memory = trainer_gpus(t)
    gpu = GPUS[t.gpu]
    dp = max(1, gpus // t.model_parallel)
    out.append(
        Line(
            "trainer",
            f"trainer GPUs ({gpu.name})",
            f"{gpus} ({gpus // 8} nodes of 8)",
            f"compute: {compute} at MFU {t.mfu:g} of {gpu.bf16_tflops:g} TFLOP/s bf16 in {t.train_share:g} of a "
            f"{t.cycle_hours:g} h cycle; memory: {memory} ({STATE_BYTES} B/param of model states"
            + (" + 2 of the reference" if t.kl_reference else "")
            + f" in 60% of {gpu.memory_gb:g} GB)",
        )
    )
    out.append(
        Line(
            "trainer",
            "batches topic partitions",
            str(dp),
            f"at least the trainer's data-parallel ranks: {gpus} GPUs / tp x pp {t.model_parallel} (kafka.partitions "
            "sets every keyed topic: take the larger of the two)",
        )
    )
    train_s = t.cycle_hours * 3600 * t.train_share
    batches_s = t.tokens_per_cycle / train_s / (t.rows * t.seq_len)
    per_reader = batches_s / max(1, gpus)
    out.append(
        Line(
            "trainer",
            "micro-batches/s to read, per GPU",
            f"{batches_s:,.2f}, {per_reader:.4f}",
            f"{t.rows} rows x {t.seq_len} tokens each; a reader drains {_n(m['reader_batches_per_s'])}/s (measured): "
            "the input path is never the bottleneck",
        )
    )
    samples = t.tokens_per_cycle / t.tokens_per_trajectory
    served = t.trajectories_per_day * t.cycle_hours / 24
    out.append(
        Line(
            "trainer",
            "samples trained per cycle / served",
            f"{_n(samples)} / {_n(served)}",
            f"tokens per cycle / {t.tokens_per_trajectory:,.0f} tokens a sample"
            + ("" if samples <= served else "; MORE than the traffic of a cycle: lengthen the cycle or train less"),
        )
    )
    return out


def table(lines: list[Line]) -> str:
    width = max(len(line.what) for line in lines)
    vwidth = max(len(line.value) for line in lines)
    rows, section = [], ""
    for line in lines:
        if line.section != section:
            section = line.section
            rows.append(f"\n{section}")
        rows.append(f"  {line.what:<{width}}  {line.value:>{vwidth}}  {line.how}")
    return "\n".join(rows).lstrip("\n")


def measure_storage(trajectories: int = 5_000, seed: int = 0) -> dict[str, float]:
    """Compressed bytes on disk per row of events, rewards and trajectories, and per token of rollouts, here:
    ``trajectories`` simulated trajectories through the real reward processor (v2 and v1-discard-broken), their
    rows inserted as the flow's sinks insert them into the embedded ClickHouse engine, merged, measured in
    ``system.parts``; rollouts of 2,000 random tokens each (ids over a 150k vocabulary, log-probs, masks)."""
    import random

    from flows.processor import Message, RewardProcessor
    from flows.windowing import WindowConfig
    from rtrl import clickhouse
    from rtrl.settings import load_settings
    from schemas.codec import event_codec
    from schemas.records import Rollout
    from schemas.types import to_arrow
    from simulator.generate import generate

    salt = "capacity-measure"
    settings = load_settings(env={"RTRL_SDK__SALT": salt})
    sim = settings.simulator.model_copy(update={"trajectories": trajectories, "seed": seed})
    emissions = generate(sim, salt)
    codec = event_codec()
    proc = RewardProcessor("capacity", WindowConfig(settings.flow), ["v2", "v1-discard-broken"])
    msgs = [Message(e.event.trajectory_id.encode(), codec.encode(e.event), 0, i) for i, e in enumerate(emissions)]
    out = proc.process(msgs, now_ms=1)
    out.extend(proc.finish(now_ms=2))
    rng = random.Random(seed)
    rollouts = [
        Rollout(
            trajectory_id=f"r{i}",
            policy_version=1,
            group_id=f"g{i // 4}",
            group_size=4,
            org_id=f"org-{i % 4}",
            task_kind="bugfix",
            prompt_ids=[rng.randrange(150_000) for _ in range(1_500)],
            completion_ids=[rng.randrange(150_000) for _ in range(500)],
            behaviour_logprobs=[-rng.expovariate(2.0) for _ in range(500)],
            loss_mask=[1] * 500,
            created_at=1_000 + i,
        )
        for i in range(1_000)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        client = clickhouse.setup(f"chdb://{tmp}/ch", "rtrl")
        for table_name, records in (
            ("events", out.events),
            ("rewards", out.rewards),
            ("trajectories", out.summaries),
            ("rollouts", rollouts),
        ):
            clickhouse.insert_table(client, "rtrl", table_name, to_arrow(records, clickhouse.TABLES[table_name]))
            client.command(f"OPTIMIZE TABLE rtrl.{table_name} FINAL")
        sizes = {
            t: (rows, size)
            for t, rows, size in client.query(
                "SELECT table, sum(rows), sum(bytes_on_disk) FROM system.parts WHERE database = 'rtrl' AND active "
                "AND table IN ('events', 'rewards', 'trajectories', 'rollouts') GROUP BY table"
            ).result_rows
        }
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    return {
        "events_row_bytes": sizes["events"][1] / sizes["events"][0],
        "rewards_row_bytes": sizes["rewards"][1] / sizes["rewards"][0],
        "trajectories_row_bytes": sizes["trajectories"][1] / sizes["trajectories"][0],
        "rollout_token_bytes": sizes["rollouts"][1] / tokens,
        "events": sizes["events"][0],
        "rewards": sizes["rewards"][0],
        "trajectories": sizes["trajectories"][0],
    }


def plot(t: Target, path: Path) -> None:
    """Trainer GPUs against tokens per cycle for the target's model and three others, at the target's cycle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    presets = {"8B": (8e9, 32, 4096), "32B": (32e9, 64, 5120), "70B": (70e9, 80, 8192)}  # (params, layers, hidden)
    models = {k: v for k, v in presets.items() if v != (t.params, t.layers, t.hidden)}
    models[f"this target: {t.params / 1e9:g}B"] = (t.params, t.layers, t.hidden)
    tokens = [x * 1e9 for x in (0.5, 1, 2, 4, 8, 16)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (params, layers, hidden) in models.items():
        gpus = [trainer_gpus(Target(**{**t.__dict__, "params": params, "layers": layers, "hidden": hidden,
                                        "tokens_per_cycle": n}))[0] for n in tokens]  # fmt: skip
        ax.plot([n / 1e9 for n in tokens], gpus, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("trained tokens per cycle (billions)")
    ax.set_ylabel(f"trainer GPUs ({GPUS[t.gpu].name})")
    ax.set_title(
        f"{t.cycle_hours:g} h cycle, {t.train_share:g} of it training, MFU {t.mfu:g}, "
        f"{attention_span(t):,.0f}-token samples"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    d = Target()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    for name, value in d.__dict__.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value)
        elif name == "gpu":
            ap.add_argument(flag, choices=sorted(GPUS), default=value)
        else:
            ap.add_argument(flag, type=type(value) if not isinstance(value, float) else float, default=value)
    ap.add_argument("--measure-storage", action="store_true", help="measure ClickHouse bytes per row here first")
    ap.add_argument("--plot", type=Path, help="write a PNG of trainer GPUs against tokens per cycle")
    args = ap.parse_args(argv)
    for name, value in d.__dict__.items():
        got = getattr(args, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not got > 0:
            ap.error(f"--{name.replace('_', '-')} must be above 0, got {got:g}")
    for name in ("train_share", "mfu"):
        if getattr(args, name) > 1:
            ap.error(f"--{name.replace('_', '-')} is a fraction: at most 1, got {getattr(args, name):g}")
    t = Target(**{k: getattr(args, k) for k in d.__dict__})
    measured = dict(MEASURED)
    if args.measure_storage:
        got = measure_storage()
        print(
            "measured storage (compressed, on disk, after a merge): "
            f"events {got['events_row_bytes']:.1f} B/row ({got['events']:,} rows), "
            f"rewards {got['rewards_row_bytes']:.1f} B/row ({got['rewards']:,}), "
            f"trajectories {got['trajectories_row_bytes']:.1f} B/row ({got['trajectories']:,}), "
            f"rollouts {got['rollout_token_bytes']:.2f} B/token"
        )
        for k in ("events_row_bytes", "rewards_row_bytes", "trajectories_row_bytes", "rollout_token_bytes"):
            measured[k] = Figure(got[k], measured[k].unit, "", "measured in this run")  # scale 1
    print(table(plan(t, measured)))
    if args.plot:
        plot(t, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
