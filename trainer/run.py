"""The trainer job: ``rtrl train`` (one process) or ``torchrun --nproc_per_node N -m trainer`` (DP/TP/PP).

Builds the model the settings describe (architecture, parallel layout, precision), reads ``rtrl.batches`` for this rank's data-parallel
share (every tensor- and pipeline-parallel rank of a replica reads the same micro-batches), trains with
Dr. GRPO + KL (through megatron's pipeline schedule when ``parallel.pp > 1``: :mod:`trainer.train`),
checkpoints with the consumed offsets, and records one ``train_metrics`` row per step in ClickHouse
(rank 0, the first pipeline stage: every stage ends a step with the same metrics) while showing
progress on the console.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rtrl import clickhouse
from rtrl.settings import Settings
from schemas.records import TrainStep
from trainer.batch import BatchLimits
from trainer.config import check_input_shapes, model_config
from trainer.data import BatchStream
from trainer.model import build_model, init_parallel
from trainer.train import TrainConfig, train


def torch_threads(setting: int) -> int:
    """Threads for torch: the setting, or on a CPU-only machine all cores but one — with torch on every
    core beside the broker, input starved the trainer (0.22 of memory-fed speed; 0.97 with one spare
    core: bench/RESULTS.md)."""
    if setting:
        return setting
    if torch.cuda.is_available():
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 2) - 1)


def run(settings: Settings, bootstrap: str, console: Console | None = None) -> list[TrainStep]:
    """Train on ``rtrl.batches`` with the model, layout and precision of the settings (``model``,
    ``parallel``, ``precision``) and the optimizer and loss of ``train`` and ``loss``."""
    console = console or Console()
    ts = settings.train
    torch.set_num_threads(torch_threads(ts.torch_threads))
    cfg, precision = model_config(settings)
    check_input_shapes(settings)
    info = init_parallel(cfg)
    model, reference = build_model(cfg, precision), build_model(cfg, precision)
    reference.load_state_dict(model.state_dict())  # the KL reference: the run's initial weights
    ckpt = Path(ts.checkpoint_dir or settings.data_path / "checkpoints")
    tc = TrainConfig.from_settings(settings, run_id=ts.run_id or ckpt.name, checkpoint_dir=str(ckpt))
    lead = info.rank == 0
    if lead:
        p = cfg.parallel
        console.print(
            f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
            f"({cfg.num_query_groups or cfg.num_attention_heads} kv), {cfg.normalization}, {cfg.activation}; "
            f"tp {p.tp} pp {p.pp} dp {info.dp}{' sp' if p.sequence_parallel else ''}; "
            f"{'bf16' if precision.bf16 else 'fp32'}{' fp8 ' + precision.fp8 if precision.fp8 else ''}; "
            f"{sum(x.numel() for x in model.parameters()):,} parameters on this rank"
        )
    ch = (
        clickhouse.setup(settings.clickhouse_dsn, settings.clickhouse.database, settings.clickhouse.timeout_s)
        if lead
        else None
    )
    streams: list[BatchStream] = []

    def make_source(offsets):
        streams.append(
            BatchStream(
                bootstrap,
                settings.topic("batches"),
                settings.topic("dead_letters"),
                info.dp_rank,
                info.dp,
                start=offsets,
                timeout_s=settings.kafka.timeout_s,
                limits=BatchLimits.from_settings(settings),
            )
        )
        return streams[-1]

    bar = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not lead,
    )

    with bar:
        task = bar.add_task("train", total=ts.steps, info="")

        def on_step(s: TrainStep) -> None:
            if ch is not None:
                clickhouse.insert(ch, settings.clickhouse.database, "train_metrics", [s])
            bar.update(
                task,
                completed=s.step,
                info=f"loss {s.loss:+.4f} kl {s.kl:.4f} clip {s.clip_fraction:.2f} "
                f"on-policy {s.on_policy_fraction:.2f} {s.tokens_per_s:,.0f} tok/s",
            )

        steps = train(model, reference, make_source, tc, on_step=on_step)
    for s in streams:
        s.close()
    if lead:
        console.print(
            f"trained {len(steps)} steps ({sum(s.tokens for s in steps):,} tokens) in run {tc.run_id}; "
            f"checkpoints in {ckpt}"
        )
    return steps
