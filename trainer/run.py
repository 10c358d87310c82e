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
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rtrl import clickhouse, metrics
from rtrl.kafka import connection
from rtrl.sections.trainer import TrainConfig, check_input_shapes
from rtrl.settings import Settings
from schemas.records import TrainStep
from trainer import checkpoint
from trainer.batch import BatchLimits
from trainer.data import BatchStream
from trainer.factory import build_policy, model_config
from trainer.train import Hooks, train


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
    bootstrap = connection(settings.kafka, bootstrap)  # the cluster's security travels with the address
    ts = settings.train
    torch.set_num_threads(torch_threads(ts.torch_threads))
    cfg, precision = model_config(settings)
    check_input_shapes(settings)
    # each rank its own endpoint: metrics.port + the local rank (torchrun's LOCAL_RANK; ranks share a host); up
    # before the models are built, so a long Hugging Face load is covered by the startup probe, not the liveness one
    endpoint = metrics.serve_part(settings, "trainer", int(os.environ.get("LOCAL_RANK", "0")))
    policy = build_policy(cfg, precision)
    info, model, reference = policy.parallel, policy.model, policy.reference
    assert info is not None  # build_policy started the parallel groups
    # The KL reference: the run's initial weights (with model.hf_path the checkpoint's, which the factory
    # loaded; train() then resumes the policy from the run's own newest checkpoint, if any: it wins).
    reference.load_state_dict(model.state_dict())
    ckpt = Path(ts.checkpoint_dir or settings.data_path / "checkpoints")
    tc = TrainConfig.from_settings(settings, run_id=ts.run_id or ckpt.name, checkpoint_dir=str(ckpt))
    lead = info.rank == 0
    last = checkpoint.latest(ckpt)  # what train() resumes: its step says whether anything is left to train
    start_step = int(checkpoint.read_extra(last).get("step", 0)) if last is not None else 0
    if lead:
        p = cfg.parallel
        console.print(
            f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
            f"({cfg.kv_heads} kv), {cfg.normalization}, {cfg.activation}; "
            f"tp {p.tp} pp {p.pp} dp {info.dp}{' sp' if p.sequence_parallel else ''}; "
            f"{'bf16' if precision.bf16 else 'fp32'}{' fp8 ' + precision.fp8 if precision.fp8 else ''}; "
            f"{sum(x.numel() for x in model.parameters()):,} parameters on this rank"
            + (f"; initial weights from {cfg.hf_path}" if cfg.hf_path else "")
        )
    ch = clickhouse.setup_from(settings) if lead else None
    streams: list[BatchStream] = []
    deny = clickhouse.deny_watch(settings)  # samples of an erased subject are refused

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
                # token ids below the model's vocabulary: with model.hf_path the checkpoint's, not model.vocab_size
                limits=replace(BatchLimits.from_settings(settings), vocab_size=cfg.vocab_size),
                deny=deny,
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

        endpoint.ready()
        steps = train(policy, make_source, tc, Hooks(on_step=on_step))
    endpoint.close()
    for s in streams:
        s.close()
    if lead:
        read = sum(sum(s.next.values()) - sum(s.committed.values()) for s in streams)  # since the last step
        invalid = sum(s.dead_letters for s in streams)
        for line in summary(settings, bootstrap, steps, start_step, read, invalid, tc.run_id, ckpt):
            console.print(line, highlight=False, soft_wrap=True)
    return steps


#: what makes the trainer's input, for the line that says why it trained nothing: the batch flow joins
#: rollouts (from a policy server: the inference fleet; locally ``rtrl part serve``, which serves once the
#: loop's trainer part announced v0) with the reward flow's rewards; ``rtrl run`` runs all of it
FEEDERS = "start what feeds it: rtrl flow rewards, rtrl flow batches and a policy server (or all: rtrl run)"


def summary(
    settings: Settings,
    bootstrap: str,
    steps: list[TrainStep],
    start_step: int,
    read: int,
    invalid: int,
    run_id: str,
    ckpt: Path,
) -> list[str]:
    """What ``rtrl train`` prints when it ends: the steps and tokens it trained and its last loss, or the
    reason it trained nothing and what to start. ``start_step`` is the step of the checkpoint it resumed;
    ``read`` and ``invalid`` count the micro-batches it read after its last step (invalid: dead-lettered)."""
    ts, topic, within = settings.train, settings.topic("batches"), f"within {settings.train.idle_timeout_s:g}s"
    where = f"checkpoints of run {run_id} in {ckpt}"
    if steps:
        last = steps[-1]
        done = f"step {last.step} of {ts.steps}" + (f": too few micro-batches {within}" if last.step < ts.steps else "")
        return [
            f"trained {len(steps):,} step{'s' if len(steps) != 1 else ''}, {sum(s.tokens for s in steps):,} tokens, "
            f"last loss {last.loss:+.4f} ({done})",
            where,
        ]
    if start_step >= ts.steps:
        return [
            f"trained nothing: run {run_id} is at step {start_step}, train.steps is {ts.steps}",
            where,
            "raise train.steps (RTRL_TRAIN__STEPS) to train on, or set a new train.checkpoint_dir for a new run",
        ]
    valid = read - invalid
    if valid <= 0 and not invalid:
        why = f"no micro-batch on {topic} at {bootstrap} {within}"
    elif valid <= 0:
        why = f"only invalid micro-batches on {topic} {within} ({invalid:,} dead-lettered)"
    else:
        why = (
            f"{valid:,} micro-batch{'es' if valid != 1 else ''} {within}, a step takes {ts.micro_batches_per_step} "
            "(train.micro_batches_per_step)"
        )
    return [f"trained nothing: {why}", FEEDERS]
