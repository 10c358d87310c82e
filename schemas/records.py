"""The records that flow through rtrl: the single source of truth.

Arrow schemas, ClickHouse columns and the Kafka codecs are derived from these classes
(schemas.types, schemas.codec); tests check the ClickHouse migrations against them.
Every record that flows toward training carries ``policy_version``.

Events are a tagged union on ``type``: each event type is a struct with the shared envelope
fields of :class:`EventBase` followed by its own typed payload fields. On the wire an event is
one flat JSON object; in Arrow/ClickHouse the payload fields of all types are Nullable columns.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union, cast

import msgspec
from msgspec import Meta

from schemas.data_use import DataUse
from schemas.fields import Float32, Id, Int32, Int64, Kind, Label, Millis, UInt8, UInt32, UInt64, UserHash, Version, doc

# gc=False: records hold only scalars and containers of scalars, so they cannot form reference
# cycles; untracked, they cost the cyclic garbage collector nothing (it was ~30% of the flow's CPU).
_STRICT = dict(kw_only=True, frozen=True, forbid_unknown_fields=True, gc=False)

Sentiment = Literal["dissatisfied", "neutral", "satisfied"]
EndStatus = Literal["completed", "abandoned", "error"]
CloseReason = Literal["ended", "deadline", "late"]
Verdict = Literal["merged", "partly_kept", "discarded"]
#: a label that may be empty (a field added later: rows written before it hold "")
MaybeLabel = Annotated[str, Meta(max_length=128), Kind("lowcard")]
CheckpointStatus = Literal["candidate", "promoted", "rejected", "rolled_back"]
ExperimentStatus = Literal["running", "ended"]
DeadLetterKind = Literal[
    "malformed",
    "invalid",
    "unknown_type",
    "oversize",
    "duplicate",
    "too_late",
    "never_started",
    "future",
    "data_use",
    "erased",
    "other",
]


# ---------------------------------------------------------------- events (topic rtrl.events)


class EventBase(msgspec.Struct, tag_field="type", **_STRICT):
    """Envelope shared by every event type; the subclass's tag is the ``type`` field."""

    event_id: Annotated[Id, doc("Globally unique id of this event; duplicates of it are dropped (dedup key).")]
    trajectory_id: Annotated[Id, doc("Trajectory (one agent task for one user) this event belongs to; the Kafka key.")]
    ts: Annotated[Millis, doc("Event time: when it happened at the client, ms since the Unix epoch (UTC).")]
    org_id: Annotated[Label, doc("Organisation of the user; cohort key for baselines and monitors.")]
    user_hash: Annotated[UserHash, doc("Salted HMAC-SHA256 of the user id (32 hex chars); never a raw id.")]
    policy_version: Annotated[Version, doc("Version of the policy checkpoint that served this trajectory.")]
    arm: Annotated[Label, doc("A/B arm the trajectory was served under (e.g. control, candidate).")]


class TrajectoryStarted(EventBase, tag="trajectory_started"):
    """The user gave the agent a task."""

    task_kind: Annotated[Label, doc("Kind of task (bugfix, feature, refactor, ...); cohort key with org_id.")]
    data_use: Annotated[
        DataUse,
        doc(
            "What rtrl may do with the trajectory (schemas.data_use): the stricter of the product's choice and the "
            "org's policy, set by the SDK. Events written before this field read as train."
        ),
    ] = "train"


class ToolCall(EventBase, tag="tool_call"):
    """The agent called a tool; broken calls are negative signal, never discarded."""

    tool: Annotated[Label, doc("Name of the tool the agent called.")]
    valid: Annotated[bool, doc("False when the call was malformed or failed to execute.")]
    error: Annotated[
        Annotated[str, Meta(max_length=2048)] | None, doc("Error text for a broken call; null when valid.")
    ] = None


class EditProposed(EventBase, tag="edit_proposed"):
    """The agent proposed an edit to the user's code."""

    edit_id: Annotated[Id, doc("Id of the edit; later accept/reject/persist events refer to it.")]
    lines: Annotated[UInt32, doc("Lines changed by the edit.")]


class EditAccepted(EventBase, tag="edit_accepted"):
    """The user accepted a proposed edit; a persistence check will follow."""

    edit_id: Annotated[Id, doc("Id of the accepted edit.")]


class EditRejected(EventBase, tag="edit_rejected"):
    """The user rejected a proposed edit."""

    edit_id: Annotated[Id, doc("Id of the rejected edit.")]


class EditPersisted(EventBase, tag="edit_persisted"):
    """A later check of how much of an accepted edit survives in the user's codebase."""

    edit_id: Annotated[Id, doc("Id of the checked edit.")]
    fraction: Annotated[float, Meta(ge=0.0, le=1.0), doc("Fraction of the edit's lines still present, 0..1.")]
    checked_after_s: Annotated[float, Meta(ge=0.0), doc("Seconds between acceptance and the check.")]


class Followup(EventBase, tag="followup"):
    """The user wrote a follow-up message, classified by sentiment."""

    sentiment: Annotated[Sentiment, doc("dissatisfied, neutral or satisfied.")]
    question_needed: Annotated[
        bool | None,
        doc("When the follow-up answers a clarifying question: whether the question was needed (false = unneeded)."),
    ] = None


class ClarifyingQuestion(EventBase, tag="clarifying_question"):
    """The agent asked the user a question instead of acting."""


class Latency(EventBase, tag="latency"):
    """Latency of the agent's response."""

    ttft_ms: Annotated[float, Meta(ge=0.0), doc("Time to first token, ms.")]
    total_ms: Annotated[float, Meta(ge=0.0), doc("Time to the complete response, ms.")]


class TrajectoryEnded(EventBase, tag="trajectory_ended"):
    """The task ended; the reward window closes once pending persistence checks arrive."""

    status: Annotated[EndStatus, doc("completed, abandoned or error.")]


class TaskCheckin(EventBase, tag="task_checkin"):
    """A background task reported interim progress and the user reacted to it (a provisional signal)."""

    progress: Annotated[float, Meta(ge=0.0, le=1.0), doc("Share of the task the agent reports done, 0..1.")]
    sentiment: Annotated[Sentiment, doc("The user's reaction to the check-in: dissatisfied, neutral or satisfied.")]


class TaskVerdict(EventBase, tag="task_verdict"):
    """The user's verdict on a whole background task's outcome, hours or days after it ended."""

    verdict: Annotated[Verdict, doc("merged, partly_kept or discarded.")]
    fraction: Annotated[float, Meta(ge=0.0, le=1.0), doc("Fraction of the task's work the user kept, 0..1.")]
    verdict_after_s: Annotated[float, Meta(ge=0.0), doc("Seconds between the task's end and the verdict.")]


class SecretFound(EventBase, tag="secret_found"):
    """The SDK found a secret in the trajectory's rollout (client/screening.py): the rollout was kept back and the
    trajectory is monitor_only from then on. The event says where, never what."""

    detector: Annotated[Label, doc("The detector that matched, e.g. AWSKeyDetector.")]
    location: Annotated[Literal["prompt", "completion"], doc("Which part of the rollout held it.")]
    char_offset: Annotated[UInt32, doc("Where it starts in that part's decoded text, in characters.")]


EVENT_TYPES: tuple[type[EventBase], ...] = (
    TrajectoryStarted,
    ToolCall,
    EditProposed,
    EditAccepted,
    EditRejected,
    EditPersisted,
    Followup,
    ClarifyingQuestion,
    Latency,
    TrajectoryEnded,
    TaskCheckin,
    TaskVerdict,
    SecretFound,
)
Event = Union[  # noqa: UP007 - a runtime alias msgspec decodes as a tagged union
    TrajectoryStarted,
    ToolCall,
    EditProposed,
    EditAccepted,
    EditRejected,
    EditPersisted,
    Followup,
    ClarifyingQuestion,
    Latency,
    TrajectoryEnded,
    TaskCheckin,
    TaskVerdict,
    SecretFound,
]
EVENT_BY_TYPE: dict[str, type[EventBase]] = {cast(str, c.__struct_config__.tag): c for c in EVENT_TYPES}


def event_type(event: EventBase) -> str:
    """The ``type`` tag of an event."""
    return cast(str, event.__struct_config__.tag)  # every event type sets a str tag


# ---------------------------------------------------------------- rollouts (topic rtrl.rollouts)


# _STRICT spelled out: type checkers must see kw_only=True, or group_size's default before the
# required fields below reads as an error
class Rollout(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """One sampled completion with what the trainer needs to learn from it."""

    trajectory_id: Annotated[Id, doc("Trajectory this completion served; joins with its reward.")]
    policy_version: Annotated[Version, doc("Policy version that sampled the completion.")]
    group_id: Annotated[Id, doc("Samples of the same prompt share a group (group-relative advantages).")]
    group_size: Annotated[
        Annotated[int, Meta(ge=1, le=2**32 - 1), Kind("uint32")],
        doc("How many completions were sampled for the group's prompt (the batch flow waits for them)."),
    ] = 1
    org_id: Annotated[Label, doc("Organisation; cohort key for the running baseline.")]
    task_kind: Annotated[Label, doc("Kind of task; cohort key with org_id.")]
    prompt_ids: Annotated[list[Int32], doc("Prompt token ids.")]
    completion_ids: Annotated[list[Int32], doc("Completion token ids sampled by the policy.")]
    behaviour_logprobs: Annotated[list[Float32], doc("Log-prob of each completion token under the sampling policy.")]
    loss_mask: Annotated[
        list[UInt8], doc("1 for completion tokens that are trained on, 0 otherwise (e.g. tool output).")
    ]
    created_at: Annotated[Millis, doc("When the completion was sampled, ms since epoch.")]
    adapter_version: Annotated[
        Version,
        doc(
            "Which policy sampled it over policy_version (issue 17): 0 = the shared policy alone, else the version "
            "of the org's LoRA adapter (its version in adapter_checkpoints) that answered; the trainers compare "
            "their log-probs with the behaviour log-probs of that policy. Rollouts written before this field hold 0."
        ),
    ] = 0
    data_use: Annotated[
        DataUse,
        doc(
            "The trajectory's data-use class as the SDK published it (train or adapter_only: the SDK publishes no "
            "rollout of a monitor_only or none trajectory). Rollouts written before this field read as train."
        ),
    ] = "train"

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behaviour_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"behaviour_logprobs ({len(self.behaviour_logprobs)}) and loss_mask ({len(self.loss_mask)}) "
                f"must have one entry per completion token ({n})"
            )


# ---------------------------------------------------------------- rewards (table + topic rtrl.rewards)


class Reward(msgspec.Struct, **_STRICT):
    """The reward of one trajectory under one reward version; revisions replace earlier ones."""

    trajectory_id: Annotated[Id, doc("Trajectory the reward is for.")]
    policy_version: Annotated[Version, doc("Policy version that served the trajectory.")]
    reward_version: Annotated[Label, doc("Version of the reward function that computed it.")]
    revision: Annotated[UInt32, doc("0 for the first emission; +1 for each re-emission caused by late events.")]
    reward: Annotated[float, doc("Scalar reward.")]
    components: Annotated[dict[Label, float], doc("Named parts of the reward that sum to it.")]
    flags: Annotated[list[Label], doc("Behaviour flags, e.g. invalid_tool_call, deferred_edit.")]
    close_reason: Annotated[CloseReason, doc("ended (ended and checks arrived), deadline, or late (re-emitted).")]
    org_id: Annotated[Label, doc("Organisation of the trajectory.")]
    arm: Annotated[Label, doc("A/B arm of the trajectory.")]
    task_kind: Annotated[Label, doc("Kind of task.")]
    n_events: Annotated[UInt32, doc("Distinct events seen for the trajectory.")]
    event_counts: Annotated[dict[Label, UInt32], doc("Distinct events by type.")]
    first_event_ts: Annotated[Millis, doc("Event time of the earliest event.")]
    last_event_ts: Annotated[Millis, doc("Event time of the latest event.")]
    emitted_at: Annotated[Millis, doc("Wall-clock time the reward was computed.")]
    provisional: Annotated[
        bool,
        doc(
            "True while a long task awaits its user's verdict (a reward from interim signals); the revision that "
            "carries the verdict replaces it. A trainer trains a trajectory once, on its final reward."
        ),
    ] = False
    data_use: Annotated[
        DataUse, doc("The trajectory's data-use class, from its trajectory_started event (train when none said).")
    ] = "train"


# ---------------------------------------------------------------- micro-batches (topic rtrl.batches, Arrow IPC)


class MicroBatch(msgspec.Struct, **_STRICT):
    """Packed, fixed-shape training input: ``rows`` sequences of ``seq_len`` tokens each."""

    batch_id: Annotated[Id, doc("Unique id; the trainer never trains on the same batch_id twice.")]
    created_at: Annotated[Millis, doc("When the batch was packed, ms since epoch.")]
    seq_len: Annotated[int, Meta(ge=1, le=2**31 - 1), Kind("int32"), doc("Tokens per packed row.")]
    token_ids: Annotated[list[list[Int32]], doc("Packed token ids, rows x seq_len (padding after the last sample).")]
    loss_mask: Annotated[list[list[UInt8]], doc("1 where the token is trained on, rows x seq_len.")]
    advantages: Annotated[list[list[Float32]], doc("Per-token advantage, rows x seq_len.")]
    behaviour_logprobs: Annotated[list[list[Float32]], doc("Per-token behaviour log-prob, rows x seq_len.")]
    segment_ids: Annotated[list[list[Int32]], doc("Index into sample_ids for each token, -1 for padding.")]
    sample_ids: Annotated[list[Id], doc("Trajectory id of each packed sample.")]
    policy_versions: Annotated[list[Version], doc("Policy version of each packed sample (same order as sample_ids).")]
    reward_version: Annotated[
        MaybeLabel, doc("Reward version whose rewards made the advantages; a trainer trains only its own (empty: any).")
    ] = ""
    delayed: Annotated[
        list[bool],
        doc(
            "Per sample (same order as sample_ids): True for a delayed sample (policy lag over train.max_policy_lag, "
            "within train.max_delayed_lag; its advantage has the delayed samples' own baseline and the trainer "
            "corrects it with a truncated importance weight). Empty = no sample is delayed."
        ),
    ] = []
    adapter: Annotated[
        MaybeLabel,
        doc(
            "Organisation whose LoRA adapter this batch trains (on the adapter-batches topic; every sample is that "
            "org's); empty = the shared policy (the batches topic)."
        ),
    ] = ""
    adapter_versions: Annotated[
        list[Version],
        doc(
            "Per sample (same order as sample_ids): the org adapter version that sampled it over its policy "
            "version (Rollout.adapter_version; 0 = the shared policy alone), what its behaviour log-probs belong "
            "to. Empty = every sample 0."
        ),
    ] = []
    served_org: Annotated[
        MaybeLabel,
        doc(
            "Organisation whose adapter versions adapter_versions counts (versions count per org; every sample "
            "an adapter served is that org's); empty when adapter_versions is."
        ),
    ] = ""
    data_use: Annotated[
        list[Label],
        doc(
            "Per sample (same order as sample_ids): its data-use class as the batch flow decided it, the "
            "stricter of its trajectory's and its org's policy. A trainer refuses a batch holding a sample its "
            "class forbids it. Empty = every sample train."
        ),
    ] = []

    def __post_init__(self) -> None:
        rows = len(self.token_ids)
        for name in ("loss_mask", "advantages", "behaviour_logprobs", "segment_ids"):
            col = getattr(self, name)
            if len(col) != rows or any(len(r) != self.seq_len for r in col):
                raise ValueError(f"{name} must be {rows} rows x {self.seq_len} tokens like token_ids")
        if any(len(r) != self.seq_len for r in self.token_ids):
            raise ValueError(f"every token_ids row must hold seq_len={self.seq_len} tokens")
        if len(self.policy_versions) != len(self.sample_ids):
            raise ValueError("policy_versions must have one entry per sample_ids entry")
        if self.delayed and len(self.delayed) != len(self.sample_ids):
            raise ValueError("delayed must be empty (no sample delayed) or have one entry per sample_ids entry")
        if self.adapter_versions and len(self.adapter_versions) != len(self.sample_ids):
            raise ValueError(
                "adapter_versions must be empty (every sample served by the shared policy alone) or have one entry "
                "per sample_ids entry"
            )
        if self.data_use and len(self.data_use) != len(self.sample_ids):
            raise ValueError("data_use must be empty (every sample train) or have one entry per sample_ids entry")
        if bool(self.served_org) != any(self.adapter_versions):
            raise ValueError("served_org names the org of adapter_versions: set exactly when one of them is not 0")
        n = len(self.sample_ids)
        if any(not -1 <= s < n for r in self.segment_ids for s in r):
            raise ValueError(f"segment_ids must be -1 (padding) or an index below {n}")


# ---------------------------------------------------------------- checkpoints (table + topic rtrl.deployments)


class Checkpoint(msgspec.Struct, **_STRICT):
    """A trained policy version and what the eval gate decided about it."""

    version: Annotated[Version, doc("Policy version number; each checkpoint gets the next one.")]
    parent: Annotated[Version | None, doc("Version it was trained from; null for the initial policy.")]
    created_at: Annotated[Millis, doc("When this status was recorded, ms since epoch.")]
    steps: Annotated[UInt64, doc("Optimizer steps taken since the parent.")]
    samples: Annotated[UInt64, doc("Samples trained on since the parent.")]
    tokens: Annotated[UInt64, doc("Tokens trained on since the parent.")]
    eval_results: Annotated[dict[Label, float], doc("Eval suite and behaviour metrics by name.")]
    status: Annotated[CheckpointStatus, doc("candidate, promoted, rejected or rolled_back.")]
    reason: Annotated[Annotated[str, Meta(max_length=4096)], doc("Why the gate promoted, rejected or rolled it back.")]
    kafka_offsets: Annotated[
        dict[Label, Int64], doc("Next offset to consume per 'topic/partition' at this checkpoint.")
    ]
    path: Annotated[Annotated[str, Meta(max_length=4096)], doc("Where the checkpoint's files are stored.")]
    export_path: Annotated[
        Annotated[str, Meta(max_length=4096)],
        doc(
            "Folder of the promoted version's Hugging Face export in the model registry (safetensors, config.json, "
            "rtrl.json), what an inference fleet loads; empty when none was made (not promoted, or not a Hugging "
            "Face model)."
        ),
    ] = ""
    export_sha256: Annotated[
        Annotated[str, Meta(pattern="^([0-9a-f]{64})?$")],
        doc(
            "Content hash of that export (sha256 over the sha256sum lines of its files but rtrl.json, sorted by "
            "name; trainer.registry), checked by a fleet before it loads; empty without an export."
        ),
    ] = ""
    reward_version: Annotated[
        MaybeLabel,
        doc("Reward version the checkpoint's cycle trained on (it changes only between cycles); empty for v0."),
    ] = ""
    reward_checksum: Annotated[
        Annotated[str, Meta(pattern="^([0-9a-f]{64})?$")],
        doc("Checksum of that reward version's weights (table reward_versions); empty for v0."),
    ] = ""
    org: Annotated[
        MaybeLabel,
        doc(
            "Organisation whose LoRA adapter this is (issue 17): then version counts that org's adapter versions and "
            "the record is kept in table adapter_checkpoints; empty = the shared policy (table checkpoints)."
        ),
    ] = ""
    base_version: Annotated[
        Version | None,
        doc(
            "For an adapter: the shared policy version it was trained and gated on, and is served over; null for "
            "the shared policy."
        ),
    ] = None


# ---------------------------------------------------------------- experiments (topic rtrl.experiments)


class Experiment(msgspec.Struct, **_STRICT):
    """A live A/B outside a candidate's evaluation (the main job's final A/B of its final version against v0):
    while it runs, a policy server serves the users whose hash for ``key`` falls below ``share`` the candidate
    version under ``candidate_arm`` and the others its serving version under ``serving_arm``."""

    key: Annotated[Label, doc("The experiment's name; with the user id it decides each user's arm.")]
    status: Annotated[ExperimentStatus, doc("running (serve the arms from now on) or ended (back to normal).")]
    created_at: Annotated[Millis, doc("When this status was announced, ms since epoch.")]
    share: Annotated[float, Meta(ge=0.0, le=1.0), doc("Share of the users served the candidate version, 0..1.")]
    serving_version: Annotated[Version, doc("The version that must serve the other users (what is promoted).")]
    serving_arm: Annotated[Label, doc("Arm label of the serving version's trajectories during the experiment.")]
    candidate_version: Annotated[Version, doc("The version served to the share of users (e.g. v0).")]
    candidate_path: Annotated[
        Annotated[str, Meta(max_length=4096)], doc("Where the candidate version's checkpoint files are stored.")
    ]
    candidate_arm: Annotated[Label, doc("Arm label of the candidate version's trajectories.")]


# ---------------------------------------------------------------- dead letters (topic rtrl.dead_letters)


class DeadLetter(msgspec.Struct, **_STRICT):
    """Input that failed validation, kept with the reason instead of being dropped."""

    kind: Annotated[
        DeadLetterKind,
        doc(
            "Class of problem: malformed, invalid, unknown_type, oversize, duplicate, too_late, never_started, future."
        ),
    ]
    source: Annotated[Label, doc("Topic (or component) the input came from.")]
    partition: Annotated[Int32, doc("Source partition, -1 when not from Kafka.")]
    offset: Annotated[Int64, doc("Source offset, -1 when not from Kafka.")]
    key: Annotated[str | None, doc("Kafka key of the input, if any (decoded leniently).")]
    field: Annotated[str, doc("Path of the offending field ($ for the whole input).")]
    reason: Annotated[str, doc("Why the input was rejected.")]
    payload: Annotated[str, doc("The input as received (decoded leniently, truncated to 4 KiB).")]
    at: Annotated[Millis, doc("When it was dead-lettered, ms since epoch.")]


# ---------------------------------------------------------------- trajectory summaries (table trajectories)


class TrajectorySummary(msgspec.Struct, **_STRICT):
    """Behaviour of one closed trajectory, independent of any reward version (input to the monitors)."""

    trajectory_id: Annotated[Id, doc("Trajectory summarised.")]
    policy_version: Annotated[Version, doc("Policy version that served it.")]
    org_id: Annotated[Label, doc("Organisation of the user.")]
    arm: Annotated[Label, doc("A/B arm it was served under.")]
    task_kind: Annotated[Label, doc("Kind of task.")]
    revision: Annotated[UInt32, doc("0 at first close; +1 for each re-close caused by late events.")]
    close_reason: Annotated[CloseReason, doc("ended, deadline or late.")]
    status: Annotated[Label, doc("End status (completed, abandoned, error) or 'open' when closed by deadline.")]
    n_events: Annotated[UInt32, doc("Distinct events of the trajectory.")]
    tool_calls: Annotated[UInt32, doc("Tool calls made.")]
    broken_tool_calls: Annotated[UInt32, doc("Tool calls that were malformed or failed.")]
    clarifying_questions: Annotated[UInt32, doc("Clarifying questions asked.")]
    unneeded_questions: Annotated[UInt32, doc("Answers showing a question was unneeded.")]
    edits_proposed: Annotated[UInt32, doc("Distinct edits proposed.")]
    edits_accepted: Annotated[UInt32, doc("Edits the user accepted.")]
    persistence_checks: Annotated[UInt32, doc("Accepted edits whose persistence was checked.")]
    persisted_fraction_sum: Annotated[float, doc("Sum of the checked edits' surviving fractions.")]
    followups: Annotated[UInt32, doc("Follow-up messages (answers to questions excluded).")]
    dissatisfied_followups: Annotated[UInt32, doc("Follow-ups classified dissatisfied.")]
    latency_ms: Annotated[float | None, doc("Worst total response latency reported, ms.")]
    ttft_ms: Annotated[float | None, doc("Worst time to first token reported, ms.")]
    first_event_ts: Annotated[Millis, doc("Event time of the earliest event.")]
    last_event_ts: Annotated[Millis, doc("Event time of the latest event.")]
    user_hash: Annotated[str, doc("The user's salted hash: the unit an A/B randomises and is analysed by.")] = ""
    data_use: Annotated[DataUse, doc("The trajectory's data-use class (train when its start did not say).")] = "train"


# ---------------------------------------------------------------- trainer metrics (table train_metrics)


class TrainStep(msgspec.Struct, **_STRICT):
    """What one optimizer step of the trainer did."""

    run_id: Annotated[Label, doc("Training run (a resumed run keeps its id).")]
    step: Annotated[UInt64, doc("Optimizer step number within the run, from 1.")]
    policy_version: Annotated[Version, doc("Version the trainer's weights had before this step.")]
    loss: Annotated[float, doc("Total loss (policy gradient + KL term), normalised by the constant.")]
    pg_loss: Annotated[float, doc("Policy-gradient part of the loss.")]
    kl: Annotated[float, doc("Mean k3 KL to the reference per trained token.")]
    clip_fraction: Annotated[float, doc("Share of trained tokens whose ratio was clipped.")]
    is_truncated_fraction: Annotated[float, doc("Share of off-policy tokens whose importance weight was truncated.")]
    tokens: Annotated[UInt64, doc("Trained (loss-masked) tokens in the step.")]
    on_policy_fraction: Annotated[float, doc("Share of trained tokens whose sample had policy lag 0.")]
    lag_histogram: Annotated[dict[Label, UInt32], doc("Samples per policy lag ('0', '1', ...).")]
    tokens_per_s: Annotated[float, doc("Trained tokens per second of the step (input wait included).")]
    batch_ids: Annotated[
        list[Id], doc("Micro-batches this step trained on (any sample within the policy lag), in order.")
    ]
    at: Annotated[Millis, doc("When the step finished, ms since epoch.")]
    sample_ids: Annotated[
        list[Id], doc("Samples trained in this step: within the policy lag, repeats of trained ones left out.")
    ] = []
    grad_norm: Annotated[
        float,
        doc("Global gradient norm before clipping (over every rank's shard; clipping scales it to train.grad_clip)."),
    ] = 0.0
    dual_clip_fraction: Annotated[
        float, doc("Share of trained tokens whose negative-advantage term the dual-clip bound replaced.")
    ] = 0.0
    seq_guarded_tokens: Annotated[
        UInt64, doc("Tokens whose sequence the per-sequence ratio guard masked (dropped) or truncated.")
    ] = 0
    mismatch_k3: Annotated[
        float,
        doc("Training-inference mismatch: mean k3 KL(behaviour || trainer) over on-policy trained tokens."),
    ] = 0.0
    mismatch_max_abs_log_ratio: Annotated[
        float, doc("Training-inference mismatch: largest |trainer - behaviour log-prob| over on-policy trained tokens.")
    ] = 0.0
    reward_version: Annotated[
        MaybeLabel, doc("Reward version of the micro-batches the step trained on (empty: not recorded).")
    ] = ""
    near_policy_fraction: Annotated[
        float,
        doc("Share of trained tokens of samples that are not delayed and had policy lag 1..train.max_policy_lag."),
    ] = 0.0
    delayed_fraction: Annotated[
        float,
        doc(
            "Share of trained tokens of delayed samples (lag up to train.max_delayed_lag, trained with a truncated "
            "importance weight); on_policy_fraction + near_policy_fraction + delayed_fraction = 1."
        ),
    ] = 0.0
    delayed_tokens: Annotated[UInt64, doc("Trained tokens of delayed samples.")] = 0
    delayed_mean_lag: Annotated[
        float,
        doc("Mean policy lag of the delayed samples' tokens sent for training (before the sequence guard; 0: none)."),
    ] = 0.0
    delayed_lag_histogram: Annotated[
        dict[Label, UInt32], doc("Delayed samples the step trained, per policy lag ('2', '3', ...).")
    ] = {}
    delayed_truncated_fraction: Annotated[
        float,
        doc(
            "Share of delayed trained tokens whose importance weight the cap (loss.delayed_is_cap) truncated "
            "(always 0 with loss.delayed_correction = none)."
        ),
    ] = 0.0
    adapter: Annotated[
        MaybeLabel, doc("Organisation whose LoRA adapter the step trained; empty = the shared policy.")
    ] = ""
    served_through_tokens: Annotated[
        UInt64,
        doc(
            "Trained tokens of the shared policy's micro-batches trained through the frozen adapter version that "
            "served them (adapters.shared_traffic = served); 0 for the others and for an adapter's step."
        ),
    ] = 0


# ---------------------------------------------------------------- batch flow counters (table batch_stats)


class BatchStats(msgspec.Struct, **_STRICT):
    """The batch flow's running counters for one cohort, of the trained reward version's micro-batches (those it
    makes for other trainable versions are not counted); the newest row per cohort is current."""

    cohort: Annotated[Label, doc("'org_id/task_kind' the counters are for.")]
    samples: Annotated[UInt64, doc("Samples packed into micro-batches so far.")]
    batches: Annotated[UInt64, doc("Micro-batches sent so far.")]
    counts: Annotated[dict[Label, UInt32], doc("Inputs not trained on, by reason (unmatched_rollout, too_long, ...).")]
    lag_accepted: Annotated[dict[Label, UInt32], doc("Accepted samples per policy lag ('0', '1', ...).")]
    lag_dropped: Annotated[dict[Label, UInt32], doc("Samples dropped as too stale, per policy lag.")]
    clock: Annotated[Millis, doc("The cohort's event-time clock when the row was written.")]


class RewardVersionRecord(msgspec.Struct, **_STRICT):
    """A reward version as registered in ClickHouse ``reward_versions`` (rewards.versions): its weights and why."""

    name: Annotated[Label, doc("Name of the version, stored as reward_version with each reward it gives.")]
    checksum: Annotated[
        Annotated[str, Meta(pattern="^[0-9a-f]{64}$")],
        doc("sha256 of the canonical JSON of its weights: two versions with the same checksum score alike."),
    ]
    weights: Annotated[str, doc("Every weight of the version as canonical JSON (sorted keys), parent's included.")]
    parent: Annotated[str, doc("Version it was derived from; empty for a root version.")]
    reason: Annotated[
        Annotated[str, Meta(max_length=4096)], doc("Why it exists, e.g. 'broken tool calls are negative'.")
    ]
    author: Annotated[Annotated[str, Meta(max_length=256)], doc("Who defined it.")]
    builtin: Annotated[bool, doc("True for the versions shipped in code (v2, v1-discard-broken).")]
    registered_at: Annotated[Millis, doc("When this definition was registered, ms since epoch; the newest wins.")]


# ---------------------------------------------------------------- erasure (issue 38; app/erasure.py)

ErasureSubject = Literal["user", "org"]


class Erasure(msgspec.Struct, **_STRICT):
    """One run of ``rtrl erase``, appended to the audit table ``erasures`` (never altered). Its subject joins the
    deny list that every consumer honours from the run's first row on."""

    erasure_id: Annotated[Label, doc("Stable id of the subject's erasure: its runs (a resumed one too) share it.")]
    subject_kind: Annotated[ErasureSubject, doc("'user' or 'org'.")]
    subject: Annotated[Label, doc("The user's salted hash, or the organisation's id; never a raw user id.")]
    status: Annotated[Label, doc("'started' before the first deletion, 'done' once every store is clean.")]
    counts: Annotated[dict[Label, UInt64], doc("Per store, the subject's rows or files found (and removed when done).")]
    lineage: Annotated[
        list[Label], doc("Checkpoints whose training saw the subject's samples: 'v3', or 'org-2/v1' for an adapter.")
    ]
    at: Annotated[Millis, doc("When the row was written, ms since epoch.")]


class ErasedTrajectory(msgspec.Struct, **_STRICT):
    """A trajectory of an erased subject: consumers that see no user (rewards, rollouts, micro-batches) skip it."""

    erasure_id: Annotated[Label, doc("The erasure that named it.")]
    trajectory_id: Annotated[Id, doc("The trajectory.")]


RECORDS: tuple[type, ...] = (
    EventBase,
    Rollout,
    Reward,
    MicroBatch,
    Checkpoint,
    Experiment,
    DeadLetter,
    TrajectorySummary,
    TrainStep,
    BatchStats,
    RewardVersionRecord,
    Erasure,
    ErasedTrajectory,
)
