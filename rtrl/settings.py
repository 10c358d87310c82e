"""One typed configuration for every rtrl job.

Sources, later ones winning: built-in defaults, a TOML file (``--config`` or ``RTRL_CONFIG``),
then environment variables ``RTRL_<SECTION>__<KEY>`` (e.g. ``RTRL_KAFKA__BOOTSTRAP``).
Unknown keys and bad values raise :class:`ConfigError` naming the setting, where it came
from, and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from rtrl.errors import ConfigError

ENV_PREFIX = "RTRL_"
ENV_CONFIG_FILE = "RTRL_CONFIG"
#: Kafka producer codecs librdkafka supports (``compression.type``)
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")


def _setting(default: Any, help: str, check: Callable[[Any], str | None] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "check": check})


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _probability(v: Any) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be a probability between 0 and 1"


def _dsn(v: str) -> str | None:
    if v == "" or v.startswith(("chdb://", "http://", "https://")):
        return None
    return "must be empty (embedded chdb under data_dir), chdb:///abs/path, chdb://memory or http(s)://host:port"


def _bootstrap(v: str) -> str | None:
    if v == "":
        return None
    for part in v.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            return f"must be host:port[,host:port...]; {part.strip()!r} is not"
    return None


def _compression(v: str) -> str | None:
    return None if v in COMPRESSIONS else f"must be one of {', '.join(COMPRESSIONS)}"


def _prefix(v: str) -> str | None:
    ok = all(c.isalnum() or c in "._-" for c in v)
    return None if ok and v else "may only contain letters, digits, '.', '_' and '-'"


@dataclass
class KafkaSettings:
    bootstrap: str = _setting(
        "", "host:port list of the Kafka brokers; empty = start a local noida-db broker", _bootstrap
    )
    topic_prefix: str = _setting("rtrl.", "prefix of every topic name (rtrl.events, ...)", _prefix)
    partitions: int = _setting(4, "partitions of the keyed data topics when rtrl creates them", _positive)
    timeout_s: float = _setting(10.0, "seconds to wait for the broker before reporting it unreachable", _positive)
    idle_backoff_s: float = _setting(
        0.1, "how long a flow's reader of an empty partition pauses before fetching again (extra latency after a quiet spell)",
        _positive,
    )
    compression: str = _setting(
        "zstd", "codec of every rtrl producer (none, gzip, snappy, lz4, zstd); JSON batches shrink several-fold", _compression
    )


@dataclass
class ClickHouseSettings:
    dsn: str = _setting("", "ClickHouse DSN; empty = embedded chdb:///<data_dir>/clickhouse", _dsn)
    database: str = _setting("rtrl", "database holding rtrl's tables", _prefix)
    timeout_s: float = _setting(10.0, "seconds to wait for a ClickHouse server before reporting it unreachable", _positive)


@dataclass
class SdkSettings:
    salt: str = _setting(
        "rtrl-local-dev-salt", "secret salt for hashing user ids; set your own in production", lambda v: None if len(v) >= 8 else "must be at least 8 characters"
    )
    queue_size: int = _setting(100_000, "events the SDK buffers before it drops (and counts) new ones", _positive)
    linger_ms: int = _setting(5, "producer linger: how long to wait to fill a batch", _non_negative)
    delivery_timeout_s: float = _setting(300.0, "how long the producer retries an event before reporting it failed", _positive)
    max_event_bytes: int = _setting(64 * 1024, "largest encoded event accepted anywhere in rtrl", _positive)


@dataclass
class SimulatorSettings:
    seed: int = _setting(0, "random seed; the same seed gives the same events")
    trajectories: int = _setting(2000, "trajectories to simulate in one run", _positive)
    orgs: int = _setting(6, "simulated organisations", _positive)
    users_per_org: int = _setting(20, "simulated users in each organisation", _positive)
    rate: float = _setting(0.0, "events per second sent through the SDK; 0 = as fast as possible", _non_negative)
    start_ms: int = _setting(0, "event time of the first trajectory (ms since epoch); 0 = now", _non_negative)
    duplicate_rate: float = _setting(0.01, "fraction of events the client sends twice", _probability)
    reorder_rate: float = _setting(0.02, "fraction of events delivered after their successor", _probability)
    late_check_rate: float = _setting(0.05, "fraction of persistence checks that arrive hours late", _probability)


def _versions(v: str) -> str | None:
    names = [x.strip() for x in v.split(",") if x.strip()]
    return None if names else "must name at least one reward version, e.g. 'v2' or 'v2,v1-discard-broken'"


@dataclass
class FlowSettings:
    reward_versions: str = _setting("v2", "comma-separated reward versions the reward flow computes", _versions)
    deadline_s: float = _setting(3600.0, "event time from a trajectory's first event to a forced close", _positive)
    grace_s: float = _setting(10.0, "event time to wait after a trajectory ends for overtaken events", _non_negative)
    allowed_lateness_s: float = _setting(86400.0, "how long after its deadline a late event still revises a reward", _non_negative)
    max_future_s: float = _setting(86400.0, "events further ahead of the partition watermark are rejected", _positive)
    batch_rows: int = _setting(20_000, "rows buffered per ClickHouse table / archive before a write", _positive)
    batch_seconds: float = _setting(1.0, "longest a row waits in a sink buffer before a write", _positive)
    archive_dir: str = _setting("", "Parquet archive of raw events; empty = <data_dir>/archive")
    recovery_dir: str = _setting("", "Bytewax recovery folder; empty = <data_dir>/recovery/<flow>")
    snapshot_s: float = _setting(2.0, "Bytewax snapshot (epoch) interval: the most work replayed after a crash", _positive)
    tail: bool = _setting(True, "keep waiting for new events at the end of the topic (false = stop at the end)")

    @property
    def versions(self) -> list[str]:
        return [x.strip() for x in self.reward_versions.split(",") if x.strip()]


def _reward_version(v: str) -> str | None:
    from rewards import REWARD_VERSIONS

    return None if v in REWARD_VERSIONS else f"must be one of {', '.join(sorted(REWARD_VERSIONS))}"


@dataclass
class BatchSettings:
    reward_version: str = _setting("v2", "reward version the batch flow trains on (the reward flow must compute it)",
                                   _reward_version)
    join_wait_s: float = _setting(60.0, "how long a rollout waits for its reward, and a reward for its rollout", _non_negative)
    group_wait_s: float = _setting(10.0, "how long a group waits for all its samples before it is used as it is", _non_negative)
    seq_len: int = _setting(128, "tokens per packed row; longer samples are dropped and counted", _positive)
    rows: int = _setting(8, "rows per micro-batch (token budget = rows x seq_len)", _positive)
    flush_s: float = _setting(2.0, "longest a sample waits for a full micro-batch before a partial one is sent", _non_negative)
    idle_flush_s: float = _setting(2.0, "wall-clock quiet time after which a cohort's clock moves on by itself", _positive)
    baseline_alpha: float = _setting(0.2, "step of the per-cohort running reward mean used for groups of one",
                                     lambda v: None if 0 < v <= 1 else "must be in (0, 1]")
    recovery_dir: str = _setting("", "Bytewax recovery folder; empty = <data_dir>/recovery/batches")
    tail: bool = _setting(True, "keep waiting at the end of the topics (false = stop at the end)")


@dataclass
class LoopSettings:
    cycles: int = _setting(24, "training cycles the main job runs (candidate -> eval gate -> promote or reject)", _positive)
    rate: float = _setting(100.0, "tasks per second the policy server serves (each sampled group_size times)", _positive)
    samples_per_cycle: int = _setting(2048, "samples the trainer uses per cycle (the samples trigger)", _positive)
    group_size: int = _setting(4, "completions sampled per task (group-relative advantages need >= 2)", _positive)
    orgs: int = _setting(3, "simulated organisations (cohorts are org x task kind)", _positive)
    hard_share: float = _setting(0.5, "share of hard tasks", _probability)
    cycle_max_s: float = _setting(120.0, "wall-time trigger: a cycle ends after this long even with fewer samples "
                                  "(production: 5 hours)", _positive)
    warm_start_steps: int = _setting(300, "supervised steps that make the initial policy (version 0)", _non_negative)
    warm_right_easy: float = _setting(-1.0, "share of right edits on easy tasks in what the initial policy imitates "
                                      "(-1 = like hard ones, 0.35): near 1 makes a policy whose failures are "
                                      "predictable from the prompt, where the v1 reward hack shows fastest",
                                      lambda v: None if v == -1 or 0 <= v <= 1 else "must be -1 (off) or within 0..1")
    eval_tasks: int = _setting(200, "held-out tasks of the eval suite", _positive)
    solve_tolerance: float = _setting(0.03, "largest tolerated drop of the held-out solve rate before a rejection",
                                      _non_negative)
    ab_share: float = _setting(0.0, "A/B mode: share of traffic a candidate that passed the evals serves before the "
                               "decision; its live behaviour is compared with the serving version's in ClickHouse "
                               "and an alert rejects it (0 = off)", _probability)
    ab_trajectories: int = _setting(400, "A/B mode: candidate trajectories with rewards needed before the comparison",
                                    _positive)
    reset_on_reject: bool = _setting(True, "a rejected candidate's weights are dropped (false: the training run "
                                     "goes on from them and only serving stays on the last promotion)")
    seed: int = _setting(0, "seed of the tasks, sampling and the initial policy")
    checkpoint_every: int = _setting(8, "trainer steps between resumable checkpoints within a cycle (a restarted "
                                     "trainer continues from the last one; with loop.processes only)", _positive)
    processes: bool = _setting(False, "run each part (reward flow, batch flow, policy server, trainer) as its own "
                               "process under a supervisor that restarts any that dies; ClickHouse is then "
                               "served to them by devservices.chserver")


@dataclass
class TrainerSettings:
    run_id: str = _setting("", "training run id kept across resumes; empty = derived from the checkpoint folder")
    steps: int = _setting(20, "optimizer steps to take (a resumed run continues to this total)", _positive)
    micro_batches_per_step: int = _setting(2, "micro-batches accumulated into one optimizer step", _positive)
    lr: float = _setting(1e-3, "AdamW learning rate", _positive)
    max_policy_lag: int = _setting(1, "samples older than this many policy versions are dropped (counted)", _non_negative)
    kl_coef: float = _setting(0.01, "weight of the k3 KL term to the reference model", _non_negative)
    checkpoint_every: int = _setting(10, "steps between checkpoints (one is also written at the end)", _positive)
    checkpoint_dir: str = _setting("", "where checkpoints go; empty = <data_dir>/checkpoints")
    idle_timeout_s: float = _setting(30.0, "stop when no micro-batch arrives for this long", _positive)
    torch_threads: int = _setting(
        0, "CPU threads for torch; 0 = auto: all cores but one on a CPU-only machine (the broker needs one)",
        _non_negative)


@dataclass
class Settings:
    data_dir: str = _setting(".rtrl", "folder for local state: broker data, embedded ClickHouse, reports")
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = field(default_factory=ClickHouseSettings)
    sdk: SdkSettings = field(default_factory=SdkSettings)
    simulator: SimulatorSettings = field(default_factory=SimulatorSettings)
    flow: FlowSettings = field(default_factory=FlowSettings)
    batches: BatchSettings = field(default_factory=BatchSettings)
    loop: LoopSettings = field(default_factory=LoopSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser().resolve()

    @property
    def clickhouse_dsn(self) -> str:
        return self.clickhouse.dsn or f"chdb://{self.data_path / 'clickhouse'}"

    def topic(self, name: str) -> str:
        """Full topic name for a logical name such as ``events``."""
        return f"{self.kafka.topic_prefix}{name}"


def _section_classes() -> dict[str, type]:
    return {f.name: type(getattr(Settings(), f.name)) for f in dataclasses.fields(Settings) if f.name != "data_dir"}


def _coerce(name: str, raw: Any, typ: type, source: str) -> Any:
    """Convert ``raw`` (TOML value or environment string) to ``typ`` or raise a ConfigError."""
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return raw.lower() in ("1", "true", "yes", "on")
            raise ValueError
        if typ is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if typ is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if typ is str:
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError(f"unsupported setting type {typ}")
    raise ConfigError(
        f"setting {name} = {raw!r} (from {source}) is not a valid {typ.__name__}; "
        f"fix: give {name} a {typ.__name__} value"
    )


def _unknown(name: str, choices: list[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(
        f"unknown setting {name!r} (from {source}); {hint}known settings: {', '.join(sorted(choices))}"
    )


def _all_names() -> list[str]:
    names = ["data_dir"]
    for sec, cls in _section_classes().items():
        names += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
    return names


def _apply(settings: Settings, name: str, raw: Any, source: str) -> None:
    if name == "data_dir":
        settings.data_dir = _coerce(name, raw, str, source)
        return
    sec, _, key = name.partition(".")
    classes = _section_classes()
    if sec not in classes or key not in {f.name for f in dataclasses.fields(classes[sec])}:
        raise _unknown(name, _all_names(), source)
    target = getattr(settings, sec)
    f = next(f for f in dataclasses.fields(target) if f.name == key)
    typ = {"int": int, "float": float, "str": str, "bool": bool}[f.type] if isinstance(f.type, str) else f.type
    setattr(target, key, _coerce(name, raw, typ, source))


def _flatten(doc: Mapping[str, Any], source: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    classes = _section_classes()
    for key, value in doc.items():
        if isinstance(value, dict):
            if key not in classes:
                raise _unknown(key, list(classes), source)
            out += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            out.append((key, value))
    return out


def validate(settings: Settings) -> Settings:
    """Run every setting's check; raise ConfigError naming the first bad one."""
    for sec, cls in _section_classes().items():
        obj = getattr(settings, sec)
        for f in dataclasses.fields(cls):
            check = f.metadata.get("check")
            problem = check(getattr(obj, f.name)) if check else None
            if problem:
                env = f"{ENV_PREFIX}{sec.upper()}__{f.name.upper()}"
                raise ConfigError(
                    f"setting {sec}.{f.name} = {getattr(obj, f.name)!r} {problem}; "
                    f"fix it in the config file under [{sec}] or with {env} ({f.metadata['help']})"
                )
    return settings


def load_settings(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the TOML file, then ``RTRL_*`` environment variables; validated."""
    env = os.environ if env is None else env
    settings = Settings()
    path = path or env.get(ENV_CONFIG_FILE) or None
    if path is not None:
        p = Path(path)
        try:
            doc = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist; fix: pass an existing file or unset {ENV_CONFIG_FILE}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for name, value in _flatten(doc, f"file {p}"):
            _apply(settings, name, value, f"file {p}")
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_FILE:
            continue
        name = var[len(ENV_PREFIX):].lower().replace("__", ".")
        _apply(settings, name, value, f"environment variable {var}")
    return validate(settings)


def as_env(settings: Settings) -> dict[str, str]:
    """Every setting as an ``RTRL_*`` variable: how a parent hands its exact settings to child processes."""
    def text(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)

    out = {f"{ENV_PREFIX}DATA_DIR": settings.data_dir}
    for sec in _section_classes():
        obj = getattr(settings, sec)
        for f in dataclasses.fields(obj):
            out[f"{ENV_PREFIX}{sec.upper()}__{f.name.upper()}"] = text(getattr(obj, f.name))
    return out


def describe() -> list[tuple[str, Any, str]]:
    """(name, default, help) for every setting; used by ``rtrl config --help-settings`` and docs."""
    rows: list[tuple[str, Any, str]] = [("data_dir", Settings().data_dir, "folder for local state")]
    for sec, cls in _section_classes().items():
        for f in dataclasses.fields(cls):
            rows.append((f"{sec}.{f.name}", f.default, f.metadata["help"]))
    return rows


def example_toml() -> str:
    """Every setting at its default with its help, as TOML (what deploy/rtrl.example.toml holds)."""
    lines = [
        "# rtrl settings: every key with its default. Copy, edit, and pass with `rtrl --config FILE`",
        "# (or RTRL_CONFIG=FILE). Any key can also be set as RTRL_<SECTION>__<KEY>, e.g. RTRL_KAFKA__BOOTSTRAP.",
        "# Unknown keys are errors, so a typo never silently falls back to a default.",
        "",
    ]
    section = None
    for name, default, help_text in describe():
        sec, _, key = name.rpartition(".")
        if sec != section:
            if sec:
                lines.append(f"\n[{sec}]")
            section = sec
        value = ("true" if default else "false") if isinstance(default, bool) else (
            f'"{default}"' if isinstance(default, str) else repr(default))
        lines += [f"# {help_text}", f"{key} = {value}"]
    return "\n".join(lines) + "\n"
