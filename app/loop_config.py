"""The closed loop's fixed settings and :func:`loop_settings`, without torch: what every part of the main job reads
first (the flow parts import no trainer; :mod:`app.loop` re-exports these)."""

from __future__ import annotations

import re

from rtrl.settings import Settings, refuse_overrides, refuse_user_set
from simulator.tasks import COMPLETION_LEN, PROMPT_LEN, VOCAB

#: samples per packed row and rows per micro-batch the loop's model is built for
SEQ_LEN, ROWS, MICRO_BATCHES_PER_STEP = 64, 2, 4
SAMPLES_PER_STEP = (SEQ_LEN // (PROMPT_LEN + COMPLETION_LEN)) * ROWS * MICRO_BATCHES_PER_STEP


def cycle_run_id(seed: int, version: int) -> str:
    """The training run of the loop's cycle that makes candidate ``version`` (``train_metrics.run_id``)."""
    return f"loop-{seed}-v{version}"


def adapter_run_id(seed: int, org: str, version: int) -> str:
    """The training run of ``org``'s adapter version ``version``."""
    return f"loop-{seed}-{org}-a{version}"


def trained_by(run_id: str) -> tuple[str, int] | None:
    """What a loop's training run made: ``("", N)`` for the shared policy's vN, ``(org, N)`` for an org's adapter
    version N; None for a run the loop did not name (the trainer job's)."""
    if m := re.fullmatch(r"loop-\d+-v(\d+)", run_id):
        return "", int(m[1])
    if m := re.fullmatch(r"loop-\d+-(.+)-a(\d+)", run_id):
        return m[1], int(m[2])
    return None


#: what the loop's tiny task world needs, and why; a user value that differs is refused, never changed
LOOP_FIXED: dict[str, tuple[object, str]] = {
    "flow.tail": (True, "the loop's flows follow the topics while it runs"),
    "flow.grace_s": (0.2, "the simulated users' events arrive in order within 0.2 s of event time"),
    "flow.batch_seconds": (0.2, "rewards must reach ClickHouse within a cycle"),
    # a closed window stays in the flow's state (and in every snapshot, pickled while holding the GIL the trainer
    # needs) until first_ts + deadline + lateness: with the defaults (1 h + 1 day) the whole run's windows did,
    # and the growing snapshots starved the trainer (bench/RESULTS.md, the collapse from cycle 7-9)
    "flow.deadline_s": (30.0, "a simulated trajectory ends within seconds, its persistence checks within 1 s after"),
    "flow.allowed_lateness_s": (
        30.0,
        "the simulated users' late events arrive within a second of their trajectory's end",
    ),
    "batching.tail": (True, "the loop's flows follow the topics while it runs"),
    "batching.seq_len": (SEQ_LEN, "the loop's policy is built for rows of this many tokens"),
    "batching.rows": (ROWS, "micro-batches of the loop's tiny tasks"),
    "batching.flush_s": (0.5, "a cycle lasts seconds: samples may not wait longer for a full micro-batch"),
    "batching.group_wait_s": (2.0, "a cycle lasts seconds: groups may not wait longer for their samples"),
    "batching.idle_flush_s": (0.5, "a cycle lasts seconds"),
    "train.micro_batches_per_step": (MICRO_BATCHES_PER_STEP, "the samples trigger counts whole steps of this size"),
    "model.vocab_size": (VOCAB, "the simulator's task vocabulary"),
    "model.seq_length": (SEQ_LEN, "the packed rows of the batch flow (batching.seq_len)"),
    "parallel.tp": (1, "the loop trains in one process"),
    "parallel.pp": (1, "the loop trains in one process"),
}

#: train settings the loop decides itself; a user value is refused with the reason (it would be ignored)
LOOP_OWNS: dict[str, str] = {
    "train.steps": "a cycle ends on the samples trigger (loop.samples_per_cycle) or after loop.cycle_max_s",
    "train.checkpoint_every": "the loop checkpoints every loop.checkpoint_every steps within a cycle",
    "train.checkpoint_dir": "the loop keeps its checkpoints under <data_dir>/loop",
    "train.run_id": "each cycle is its own training run, loop-<loop.seed>-v<version>",
    "train.idle_timeout_s": "a cycle waits at most min(30 s, loop.cycle_max_s) for a micro-batch",
    "train.torch_threads": "the loop's parts share the cores: torch runs one thread in each",
}


def loop_settings(settings: Settings, trains: bool = True) -> Settings:
    """The settings the loop runs with: rows, sequence length and waits fitted to its tiny tasks
    (:data:`LOOP_FIXED`). A setting the user gave another value is refused with the reason. ``trains`` off: for a
    part that never trains (a flow, the policy server), whose settings file may hold a separate trainer's ``train``
    section (:mod:`app.local_cluster`): :data:`LOOP_OWNS` is not its to refuse."""
    if trains:
        refuse_user_set(settings, LOOP_OWNS, "the closed loop (rtrl run)")
    fixed = LOOP_FIXED
    if settings.model.hf_path:  # the checkpoint decides the vocabulary: loop_model_config checks it fits the tasks
        fixed = {k: v for k, v in LOOP_FIXED.items() if k != "model.vocab_size"}
    return refuse_overrides(settings, fixed, "the closed loop (rtrl run)")
