"""The application's sections: the main job's loop and the retention of every store."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from rtrl.section import Section, setting


class LoopSettings(Section):
    cycles: int = setting(24, "training cycles the main job runs (candidate -> eval gate -> promote or reject)", gt=0)
    rate: float = setting(100.0, "tasks per second the policy server serves (each sampled group_size times)", gt=0)
    samples_per_cycle: int = setting(2048, "samples the trainer uses per cycle (the samples trigger)", gt=0)
    group_size: int = setting(4, "completions sampled per task (group-relative advantages need >= 2)", gt=0)
    orgs: int = setting(3, "simulated organisations (cohorts are org x task kind)", gt=0)
    specialised_orgs: int = setting(
        0,
        "of the simulated orgs, how many follow a convention of their own on two task kinds (their reviewers "
        "accept an edit there only after a given tool ran, which the prompt does not show: "
        "simulator.tasks.conventions_for): the last ones "
        "(with 3 orgs and 2 specialised, org-1 and org-2; org-0 keeps the global convention); 0 = none; at most "
        "loop.orgs",
        ge=0,
    )
    users_per_org: int = setting(200, "simulated users per organisation (an A/B randomises and analyses by user)", gt=0)
    hard_share: float = setting(0.5, "share of hard tasks", ge=0, le=1)
    cycle_max_s: float = setting(
        120.0, "wall-time trigger: a cycle ends after this long even with fewer samples (production: 5 hours)", gt=0
    )
    warm_start_steps: int = setting(300, "supervised steps that make the initial policy (version 0)", ge=0)
    warm_right_easy: float = setting(
        -1.0,
        "share of right edits on easy tasks in what the initial policy imitates "
        "(-1 = like hard ones, 0.35): near 1 makes a policy whose failures are "
        "predictable from the prompt, where the v1 reward hack shows fastest",
    )
    eval_tasks: int = setting(200, "held-out tasks of the eval suite", gt=0)
    solve_tolerance: float = setting(
        0.03, "smallest drop of the held-out solve rate worth a rejection (it must also be significant)", ge=0
    )
    gate_alpha: float = setting(
        0.05,
        "the eval gate's false-refusal rate: a rate's move refuses a candidate only when Fisher's exact test finds "
        "it at this level, Holm-corrected over the gate's comparisons; 0 = the thresholds alone",
        ge=0,
        lt=1,
    )
    mismatch_log_ratio_max: float = setting(
        15.0,
        "training-inference mismatch alert: a candidate trained by a step whose largest |trainer - behaviour "
        "log-prob| on on-policy tokens exceeded this is refused (it includes the policy's drift within a cycle: "
        "up to ~7 seen on the defaults); 0 = off",
        ge=0,
    )
    mismatch_k3_max: float = setting(
        0.0,
        "training-inference mismatch alert on a step's mean k3 KL between behaviour and trainer log-probs on "
        "on-policy tokens; 0 = off (the default: within the loop's many-step cycles one drifted token, e^5.6, "
        "gave a step 2.4 where the median is 0.03; set it where a version trains few steps)",
        ge=0,
    )
    ab_share: float = setting(
        0.0,
        "A/B mode: share of users (by hash) a candidate that passed the evals serves before the "
        "decision; an always-valid sequential test on their behaviour in ClickHouse against the serving "
        "version's rolls it back or promotes it (0 = off)",
        ge=0,
        le=1,
    )
    ab_trajectories: int = setting(
        400,
        "A/B mode: candidate trajectories after which a candidate no always-valid test found worse is promoted "
        "(one found worse is rolled back at once, at any look)",
        gt=0,
    )
    ab_alpha: float = setting(
        0.05,
        "A/B mode: false-alarm rate of the sequential tests, valid however often they look: half for mSPRT per "
        "guarded metric over all users, half for the same per org (a hack confined to one org's users)",
        gt=0,
        lt=1,
    )
    ab_cuped: bool = setting(
        True,
        "A/B mode: CUPED - each user's behaviour on the serving version before the candidate came is the covariate "
        "of the sequential test (less variance where users differ lastingly, earlier decisions; unbiased either "
        "way; the loop's simulated users differ lastingly in strictness only, simulator.world)",
    )
    ab_tau: float = setting(
        0.1, "A/B mode: the relative effect the sequential test is tuned to (0.1 = 10%; any value keeps alpha)", gt=0
    )
    final_ab_trajectories: int = setting(
        4000,
        "the main job ends with a live A/B of its final version against v0, users split 50/50 by hashed user id, "
        "until each arm has this many trajectories in ClickHouse (0 = no final A/B)",
        ge=0,
    )
    final_ab_max_s: float = setting(
        300.0, "the most wall time the final A/B serves (its table says when an arm fell short)", gt=0
    )
    reset_on_reject: bool = setting(
        True,
        "a rejected candidate's weights are dropped (false: the training run goes on "
        "from them and only serving stays on the last promotion)",
    )
    seed: int = setting(0, "seed of the tasks, sampling and the initial policy")
    checkpoint_every: int = setting(
        8,
        "trainer steps between resumable checkpoints within a cycle (a restarted trainer "
        "continues from the last one; with loop.processes only)",
        gt=0,
    )
    processes: bool = setting(
        False,
        "run each part (reward flow, batch flow, policy server, trainer) as its own process "
        "under a supervisor that restarts any that dies; ClickHouse is then served to them "
        "by devservices.chserver",
    )
    max_restarts: int = setting(
        5,
        "with loop.processes: restarts of one part (or the embedded ClickHouse front) allowed within "
        "loop.restart_window_s; one more death in that window ends the run (systemd's StartLimitBurst)",
        ge=0,
    )
    restart_window_s: float = setting(
        60.0,
        "with loop.processes: the sliding window over which loop.max_restarts is counted, per part "
        "(systemd's StartLimitIntervalSec): a part that crashes now and then is restarted for ever",
        gt=0,
        allow_inf_nan=False,
    )

    @field_validator("warm_right_easy")
    @classmethod
    def _warm(cls, v: float) -> float:
        if v != -1 and not 0 <= v <= 1:
            raise ValueError("must be -1 (off) or within 0..1")
        return v

    @model_validator(mode="after")
    def _specialised_within_orgs(self) -> LoopSettings:
        if self.specialised_orgs > self.orgs:
            raise ValueError(
                f"loop.specialised_orgs = {self.specialised_orgs} exceeds loop.orgs = {self.orgs}: only simulated "
                "orgs can have a convention of their own; fix: lower loop.specialised_orgs or raise loop.orgs"
            )
        return self


#: ClickHouse tables that hold users' data or what was derived from it, and the time column their retention counts
#: from (checkpoints, reward versions and promotions are decisions: kept)
RETAINED_TABLES = {
    "events": "ts",
    "rollouts": "created_at",
    "rewards": "emitted_at",
    "provisional_rewards": "emitted_at",
    "trajectories": "last_event_ts",
    "batches": "created_at",
    "dead_letters": "at",
    "train_metrics": "at",
    "batch_stats": "clock",
}


def _default_table_days() -> dict[str, float]:
    days = dict.fromkeys(RETAINED_TABLES, 365.0)
    return days | {"events": 90.0, "rollouts": 7.0, "batches": 7.0, "dead_letters": 30.0}


class RetentionSettings(Section):
    """How long each store keeps what it holds (issue 38, docs/governance.md); 0 keeps it forever."""

    tables: dict[str, float] = Field(
        default_factory=_default_table_days,
        description="days each ClickHouse table keeps a row, counted from its time column [retention.tables] "
        "(events 90, rollouts and batches 7, dead_letters 30, the others 365); a TTL that `rtrl retention apply` "
        "makes follow this setting, with no migration; 0 = forever",
    )
    archive_days: float = setting(
        90.0, "days the Parquet archive keeps a day's events (`rtrl retention apply`); 0 = forever", ge=0
    )
    checkpoints_keep: int = setting(
        10,
        "newest checkpoint versions `rtrl retention apply` keeps, their Megatron checkpoints and registry exports; "
        "the serving version and its rollback targets are kept too; 0 = keep every version",
        ge=0,
    )
    rollback_versions: int = setting(
        5,
        "promoted ancestors of the serving version kept as rollback targets (`rtrl rollback` re-promotes a parent), "
        "however old",
        ge=0,
    )
    state_days: float = setting(
        7.0,
        "days the flows keep state nothing uses: a recovery folder no running flow holds, a spill file no running "
        "flow holds and no kept snapshot refers to, counted from its last write (`rtrl retention apply`; a "
        "running reward flow prunes its own spill files); 0 = forever",
        ge=0,
    )
    schedule: str = setting(
        "17 3 * * *",
        "when the manifests' CronJob runs `rtrl retention apply`, in cron's five fields (minute hour day month "
        "weekday; default daily at 03:17)",
        pattern=r"^\S+( \S+){4}$",
    )

    @field_validator("tables")
    @classmethod
    def _known_tables(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(RETAINED_TABLES))
        if unknown:
            raise ValueError(f"names tables without a retention {unknown}; fix: choose among {sorted(RETAINED_TABLES)}")
        negative = sorted(t for t, d in v.items() if d < 0)
        if negative:
            raise ValueError(f"gives {negative} fewer than 0 days; fix: 0 keeps rows forever, else days > 0")
        return _default_table_days() | v
