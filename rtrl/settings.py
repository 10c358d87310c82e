"""One typed settings tree for every rtrl component (pydantic-settings).

Sources, later ones winning: built-in defaults, a TOML file (``--config`` or ``RTRL_CONFIG``), then
environment variables ``RTRL_<SECTION>__<KEY>`` (e.g. ``RTRL_KAFKA__BOOTSTRAP``). Every section is
one component's configuration, defined in :mod:`rtrl.sections` (``rtrl.sections.flows``,
``rtrl.sections.trainer`` ...) on :class:`rtrl.section.Section`. This module composes them into the tree and loads it.

Errors name the setting, where its value came from, and the fix. Unknown keys are errors (a typo
never silently falls back to a default). Secrets (``sdk.salt``, a DSN's password, its ``?password=`` or
``?token=`` ...) are redacted whenever settings are shown (:func:`describe`, ``repr``, errors: :func:`redact_dsn`).
A boolean is never a number: ``true`` for a count, port or duration is an error, not 1.

Why pydantic-settings: typed coercion of TOML and environment strings, nested ``__`` variables,
constraints, and source priority are what it does; this module only adds the wording of errors
(which setting, which source, which fix), the ``did you mean`` for misspelt keys, and redaction.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from rtrl.config import ClickHouseSettings, KafkaSettings, MetricsSettings
from rtrl.errors import ConfigError
from rtrl.section import redact_dsn
from rtrl.sections.app import LoopSettings, RetentionSettings
from rtrl.sections.client import DEFAULT_SALT, GovernanceSettings, SdkSettings
from rtrl.sections.flows import BackfillSettings, BatchingSettings, FlowSettings
from rtrl.sections.rewards import RewardSettings
from rtrl.sections.simulator import ServingSettings, SimulatorSettings
from rtrl.sections.trainer import (
    AdapterSettings,
    LossSettings,
    ModelSettings,
    ParallelSettings,
    PrecisionSettings,
    TrainSettings,
)

ENV_PREFIX = "RTRL_"
ENV_CONFIG_FILE = "RTRL_CONFIG"
#: settings whose values are secrets: shown as ``***`` by describe() and repr
SECRETS = (
    "sdk.salt",
    "kafka.sasl_password",
    "kafka.oauth_client_secret",
    "kafka.ssl_key_password",
    "clickhouse.password",
)


def _is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (brackets allowed); a name other than localhost is not."""
    host = host.strip("[]").lower()
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- the tree

_ENV: ContextVar[Mapping[str, str] | None] = ContextVar("rtrl_settings_env", default=None)


class _Env(EnvSettingsSource):
    """pydantic-settings' environment source over the mapping given to :func:`load_settings`."""

    def _load_env_vars(self):
        env = _ENV.get()
        if env is None:
            return super()._load_env_vars()
        return {k.lower(): v for k, v in env.items()}


class Settings(BaseSettings):
    """Every rtrl setting; a section per component."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        case_sensitive=False,
        allow_inf_nan=False,
        hide_input_in_errors=True,
    )

    data_dir: str = Field(
        default=".rtrl", description="folder for local state: broker data, embedded ClickHouse, reports"
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    sdk: SdkSettings = Field(default_factory=SdkSettings)
    flow: FlowSettings = Field(default_factory=FlowSettings)
    rewards: RewardSettings = Field(default_factory=RewardSettings)
    backfill: BackfillSettings = Field(default_factory=BackfillSettings)
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    loss: LossSettings = Field(default_factory=LossSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    parallel: ParallelSettings = Field(default_factory=ParallelSettings)
    precision: PrecisionSettings = Field(default_factory=PrecisionSettings)
    loop: LoopSettings = Field(default_factory=LoopSettings)
    simulator: SimulatorSettings = Field(default_factory=SimulatorSettings)
    serving: ServingSettings = Field(default_factory=ServingSettings)
    adapters: AdapterSettings = Field(default_factory=AdapterSettings)
    governance: GovernanceSettings = Field(default_factory=GovernanceSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ):
        # the environment wins over what load_settings passes in (the TOML file), which wins over defaults
        return (_Env(settings_cls), init_settings)

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a folder: an empty data_dir would be the current folder, which rtrl run cleans")
        try:
            p, home = Path(v).expanduser().resolve(), Path.home().resolve()
        except RuntimeError:  # no HOME to expand "~" against
            raise ValueError("starts with ~ but HOME is not set; give an absolute folder") from None
        if p == Path(p.anchor) or p == home:
            raise ValueError(f"resolves to {p}: rtrl keeps (and cleans) its state there; use a folder of its own")
        return v

    @model_validator(mode="after")
    def _salt(self) -> Settings:
        if self.sdk.salt == DEFAULT_SALT and not self.local:
            raise ValueError(
                "sdk.salt is the public default while the services are not local (kafka.bootstrap "
                f"{self.kafka.bootstrap!r}, clickhouse.dsn {redact_dsn(self.clickhouse.dsn)!r}): anyone could "
                "recompute the user hashes; fix: set sdk.salt to a secret of your own with RTRL_SDK__SALT"
            )
        return self

    @model_validator(mode="after")
    def _local_broker_plaintext(self) -> Settings:
        if not self.kafka.bootstrap and self.kafka.security_protocol != "PLAINTEXT":
            raise ValueError(
                f"kafka.security_protocol = {self.kafka.security_protocol!r} but kafka.bootstrap is empty: rtrl then "
                "starts the dev-only local broker, which speaks PLAINTEXT only; fix: set kafka.bootstrap "
                "(RTRL_KAFKA__BOOTSTRAP) to the secured cluster's brokers, or remove the kafka security settings"
            )
        return self

    @property
    def local(self) -> bool:
        """Local mode: every service is embedded or on loopback (where the public default salt is allowed)."""
        hosts = [p.strip().rpartition(":")[0] for p in self.kafka.bootstrap.split(",") if p.strip()]
        dsn = self.clickhouse.dsn
        if dsn.startswith(("http://", "https://")):
            hosts.append(urlsplit(dsn).hostname or "")
        return all(_is_loopback(h) for h in hosts)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser().resolve()

    @property
    def state_root(self) -> str:
        """Where the reward flow spills its windows (``flow.state_dir``, default ``<data_dir>/state/rewards``)."""
        return self.flow.state_dir or str(self.data_path / "state" / "rewards")

    @property
    def archive_root(self) -> str:
        """Where the reward flow writes the Parquet event archive and the backfill reads it."""
        return self.flow.archive_dir or str(self.data_path / "archive" / "events")

    @property
    def clickhouse_dsn(self) -> str:
        """The DSN every ClickHouse client of rtrl opens (:func:`rtrl.clickhouse.connect`): ``clickhouse.dsn``
        (or the embedded folder) with the ``clickhouse`` section's user and password in it and, for https, its
        TLS settings as parameters (``ca_cert``, ``verify``, ``client_cert``, ``client_cert_key``) that
        :func:`rtrl.clickhouse.connect` and :func:`rtrl.clickhouse.ping` take out and apply. The password, if
        any, is in the DSN's user part, which every message shows as ``***`` (:func:`redact_dsn`)."""
        ch = self.clickhouse
        dsn = ch.dsn or f"chdb://{self.data_path / 'clickhouse'}"
        if not dsn.startswith(("http://", "https://")):
            return dsn  # the embedded chdb: no login, no TLS
        u = urlsplit(dsn)  # what the DSN has already stays (a child's clickhouse.dsn is its parent's clickhouse_dsn)
        if (ch.user and not u.username) or (ch.password and u.password is None):
            user = u.username or quote(ch.user or "default", safe="")
            login = user + (":" + quote(ch.password, safe="") if ch.password else "")
            u = u._replace(netloc=f"{login}@{u.netloc.rpartition('@')[2]}")
        params: dict[str, str] = {}
        if ch.password_file:
            params["password_file"] = ch.password_file  # rtrl.clickhouse.connect reads the file
        params |= {k: getattr(ch, k) for k in ("ca_cert", "client_cert", "client_cert_key") if getattr(ch, k)}
        if not ch.verify:
            params["verify"] = "false"
        have = {k for k, _ in parse_qsl(u.query, keep_blank_values=True)}
        params = {k: v for k, v in params.items() if k not in have}
        if params:
            u = u._replace(path=u.path or "/", query="&".join(q for q in (u.query, urlencode(params)) if q))
        return urlunsplit(u)

    def topic(self, name: str) -> str:
        """Full topic name for a logical name such as ``events``."""
        return f"{self.kafka.topic_prefix}{name}"

    def value(self, name: str) -> Any:
        """The value of setting ``section.key``, e.g. ``flow.tail``."""
        sec, _, key = name.partition(".")
        return getattr(getattr(self, sec), key)

    def updated(self, changes: Mapping[str, Any]) -> Settings:
        """A validated copy with ``{"section.key": value}`` changed (how a job derives a child's settings)."""
        doc = self.model_dump()
        for name, value in changes.items():
            sec, _, key = name.rpartition(".")
            target = doc[sec] if sec else doc
            if key not in target:
                raise _unknown(name, _all_names(), "Settings.updated")
            target[key] = value
        token = _ENV.set({})  # the copy is exactly self + changes: the environment was read when self was loaded
        try:
            out = _validate(lambda: Settings.model_validate(doc), "Settings.updated", {})
        finally:
            _ENV.reset(token)
        for sec in SECTIONS:  # what the user set stays marked as set (the loop refuses to override it)
            getattr(out, sec).__pydantic_fields_set__ = set(getattr(self, sec).model_fields_set) | {
                k.partition(".")[2] for k in changes if k.startswith(sec + ".")
            }
        return out


SECTIONS: tuple[str, ...] = tuple(n for n, f in Settings.model_fields.items() if n != "data_dir")


def _fields(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    return dict(cls.model_fields)


def _all_names() -> list[str]:
    names = ["data_dir"]
    for sec in SECTIONS:
        names += [f"{sec}.{k}" for k in _fields(Settings.model_fields[sec].annotation)]  # type: ignore[arg-type]
    return names


def _unknown(name: str, choices: list[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(name, choices, n=1)
    sec = name.partition(".")[0]
    if "." in name and sec in SECTIONS:  # a known section: list its keys only
        choices = [c for c in choices if c.startswith(sec + ".")]
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown setting {name!r} (from {source}); {hint}known settings: {', '.join(sorted(choices))}")


def env_name(name: str) -> str:
    """``kafka.bootstrap`` -> ``RTRL_KAFKA__BOOTSTRAP``."""
    return ENV_PREFIX + name.upper().replace(".", "__")


_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "int_parsing": "is not a valid int",
    "int_from_float": "is not a valid int",
    "int_type": "is not a valid int",
    "float_parsing": "is not a valid float",
    "float_type": "is not a valid float",
    "bool_parsing": "is not a valid bool (true/false)",
    "bool_type": "is not a valid bool (true/false)",
    "string_type": "is not a valid str",
    "string_too_short": "must be at least {min_length} characters",
    "too_short": "must have at least {min_length} item(s)",
    "string_pattern_mismatch": "may only contain letters, digits, '.', '_' and '-'",
    "literal_error": "must be one of {expected}",
    "finite_number": "must be a finite number (not inf or nan)",
}


def _validate(build, source_of: Any, sources: Mapping[str, str]) -> Settings:
    """Run ``build()``; turn a pydantic ValidationError into a ConfigError naming setting, source and fix."""
    try:
        return build()
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        loc = [str(p) for p in e["loc"]]
        name = ".".join(loc[:2])
        if e["type"] == "extra_forbidden":
            raise _unknown(name, _all_names(), sources.get(name, str(source_of))) from None
        if e["type"] == "value_error":
            text = redact_dsn(str(e.get("ctx", {}).get("error", e["msg"])))  # a check's own words, secrets out
        else:
            text = _MESSAGES.get(e["type"], e["msg"]).format(**e.get("ctx", {}))
        if not loc:  # a check across sections: its message names the settings and the fix
            raise ConfigError(f"settings: {text}") from None
        if not loc[1:] and loc[0] in SECTIONS:  # a check across the section's settings: its message names them
            raise ConfigError(f"settings [{loc[0]}]: {text} (from {sources.get(loc[0], source_of)})") from None
        value = e.get("input")
        shown = "***" if name in SECRETS else redact_dsn(value) if isinstance(value, str) else value
        shown = _toml(shown) if isinstance(shown, bool) else repr(shown)  # TOML's true, not Python's True
        helps = (
            cast("type[BaseModel]", Settings.model_fields[loc[0]].annotation).model_fields.get(loc[1])  # a model
            if loc[0] in SECTIONS
            else Settings.model_fields.get(loc[0])
        )
        where = f"under [{loc[0]}]" if loc[1:] else "at its top"
        raise ConfigError(
            f"setting {'.'.join(loc)} = {shown} {text} (from {sources.get(name, source_of)}); fix: give {name} a valid "
            f"value in the config file {where} or with {env_name(name)}"
            + (f" ({helps.description})" if helps is not None and helps.description else "")
        ) from None


def load_settings(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the TOML file, then ``RTRL_*`` environment variables; validated."""
    env = os.environ if env is None else env
    path = path or env.get(ENV_CONFIG_FILE) or None
    doc: dict[str, Any] = {}
    sources: dict[str, str] = {}
    known = _all_names()
    if path is not None:
        p = Path(path)
        try:
            doc = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"config file {p} does not exist; fix: pass an existing file or unset {ENV_CONFIG_FILE}"
            ) from None
        except IsADirectoryError:
            raise ConfigError(f"config file {p} is a folder; fix: pass the TOML file itself") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {p} is not UTF-8 text (byte {e.start}); fix: save it as UTF-8 TOML"
            ) from None
        except OSError as e:
            raise ConfigError(
                f"config file {p} cannot be read ({e.strerror or e}); fix: check its permissions"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for key, value in doc.items():
            if isinstance(value, dict):
                if key not in SECTIONS:
                    raise _unknown(key, list(SECTIONS), f"file {p}")
                for k in value:
                    if f"{key}.{k}" not in known:
                        raise _unknown(f"{key}.{k}", known, f"file {p}")
                    sources[f"{key}.{k}"] = f"file {p}"
                sources[key] = f"file {p}"
            elif key not in known:
                raise _unknown(key, known, f"file {p}")
            else:
                sources[key] = f"file {p}"
        _refuse_file_secrets(doc, f"the config file {p}")
    ours: dict[str, str] = {}
    for var, value in env.items():
        if not var.upper().startswith(ENV_PREFIX) or var.upper() == ENV_CONFIG_FILE:
            continue
        name = var[len(ENV_PREFIX) :].lower().replace("__", ".")
        given = var
        if name not in known and name.endswith("_file") and name[: -len("_file")] in SECRETS:  # a mounted Secret
            name = name[: -len("_file")]
            if any(v.upper() == env_name(name) for v in env):
                raise ConfigError(f"both {env_name(name)} and {var} are set; fix: keep one")
            var, value = env_name(name), _secret_file(var, value)
        if name not in known:
            raise _unknown(name, known, f"environment variable {var}")
        sources[name] = f"environment variable {given}"
        sources.setdefault(name.partition(".")[0], f"environment variable {given}")
        ours[var] = value
    token = _ENV.set(ours)
    try:
        return _validate(lambda: Settings(**doc), "defaults", sources)
    finally:
        _ENV.reset(token)


def _refuse_file_secrets(doc: Mapping[str, Any], where: str) -> None:
    """Secrets come from the environment or a mounted Secret only, never a settings file (which is checked in,
    copied and shown): each one found in ``doc`` is a ConfigError naming the setting and the fix.
    A value holds a secret when :func:`redact_dsn` would hide part of it (a DSN's password or ``?token=``)."""
    for name in SECRETS:
        sec, _, key = name.partition(".")
        if key in (doc.get(sec) or {}):
            raise ConfigError(
                f"setting {name} is a secret but is written in {where}; fix: remove it from the file "
                f"and give it with {env_name(name)} (e.g. from a Kubernetes Secret via secretKeyRef) or as a mounted "
                f"file named by {env_name(name)}_FILE"
            )
    values = [(k, v) for k, v in doc.items() if not isinstance(v, dict)]
    values += [(f"{sec}.{k}", v) for sec, d in doc.items() if isinstance(d, dict) for k, v in d.items()]
    for name, value in values:
        if not isinstance(value, str) or redact_dsn(value) == value:
            continue
        fix = (
            "remove it from the DSN and give it with RTRL_CLICKHOUSE__PASSWORD or clickhouse.password_file (a "
            "mounted Secret)"
            if name == "clickhouse.dsn"
            else f"remove it from the file and give the whole value with {env_name(name)} (e.g. from a Kubernetes "
            "Secret)"
        )
        raise ConfigError(f"setting {name} = {redact_dsn(value)!r} in {where} carries a password; fix: {fix}")


def _secret_file(var: str, path: str) -> str:
    """The secret in the file ``path`` named by the environment variable ``var`` (``RTRL_..._FILE``), stripped."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{var} = {path!r} cannot be read ({getattr(e, 'strerror', None) or e}); fix: point it at the file "
            "holding the secret (e.g. a mounted Kubernetes Secret) or unset it"
        ) from None
    if not secret:  # an unfilled Secret (deploy/k8s ships its keys empty) must not pass for "no secret"
        raise ConfigError(
            f"{var} = {path!r} is empty; fix: put the secret in it (for deploy/k8s: fill in the rtrl-secrets "
            "Secret) or unset the variable"
        )
    return secret


def as_env(settings: Settings) -> dict[str, str]:
    """Every setting as an ``RTRL_*`` variable: how a parent hands its exact settings to child processes."""

    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return ",".join(map(str, v))
        if isinstance(v, dict):  # a table of sections or values: JSON, which the environment source parses
            return json.dumps(v)
        return repr(v) if isinstance(v, float) else str(v)

    out = {f"{ENV_PREFIX}DATA_DIR": settings.data_dir}
    for sec in SECTIONS:
        for key, value in getattr(settings, sec).model_dump().items():
            out[env_name(f"{sec}.{key}")] = text(value)
    return out


def _shown(name: str, value: Any) -> Any:
    if name in SECRETS:
        return "***"
    return redact_dsn(value) if isinstance(value, str) else value


def describe(settings: Settings | None = None) -> list[tuple[str, Any, str]]:
    """(name, value, help) for every setting, secrets redacted; defaults when ``settings`` is None."""
    settings = settings or Settings.model_construct()
    rows: list[tuple[str, Any, str]] = [
        ("data_dir", settings.data_dir, Settings.model_fields["data_dir"].description or "")
    ]
    for sec in SECTIONS:
        obj = getattr(settings, sec)
        for key, f in _fields(type(obj)).items():
            rows.append((f"{sec}.{key}", _shown(f"{sec}.{key}", getattr(obj, key)), f.description or ""))
    return rows


def example_toml() -> str:
    """Every setting at its default with its help, as TOML (what deploy/rtrl.example.toml holds)."""
    lines = [
        "# rtrl settings: every key, commented out at its default. Copy, uncomment what you change, and pass",
        "# with `rtrl --config FILE` (or RTRL_CONFIG=FILE). Any key can also be set as RTRL_<SECTION>__<KEY>,",
        "# e.g. RTRL_KAFKA__BOOTSTRAP. Unknown keys are errors, so a typo never silently falls back to a default.",
        "# (A key left set counts as yours: the main job refuses one it would have to change, app.loop_config.LOOP_FIXED.)",
        "",
    ]
    section = None
    defaults = Settings.model_construct()
    for name, _, help_text in describe(defaults):
        sec, _, key = name.rpartition(".")
        value = getattr(getattr(defaults, sec), key) if sec else getattr(defaults, key)
        if sec != section:
            if sec:
                lines.append(f"\n[{sec}]")
            section = sec
        lines += [f"# {help_text}", f"# {key} = {_toml(value)}"]
    return "\n".join(lines) + "\n"


def settings_toml(settings: Settings) -> str:
    """The settings that differ from their defaults, as a TOML file ``load_settings`` reads back to the same
    settings: what a deployment's ConfigMap holds. Secrets (:data:`SECRETS`) are left out: they come only
    from ``RTRL_*`` variables or ``RTRL_*_FILE`` (a mounted Secret). A value with a secret in it (a DSN's
    password or ``?token=``) is a ConfigError, as :func:`load_settings` would refuse the file."""
    defaults = Settings.model_construct()
    lines = [
        "# rtrl settings (generated): every setting that differs from its default; secrets come from the",
        "# environment or a mounted Secret (RTRL_<SECTION>__<KEY>_FILE), never from this file",
    ]
    if settings.data_dir != defaults.data_dir:
        lines.append(f"data_dir = {_toml(settings.data_dir)}")
    for sec in SECTIONS:
        obj, base = getattr(settings, sec), getattr(defaults, sec)
        changed = [
            (key, getattr(obj, key))
            for key in _fields(type(obj))
            if f"{sec}.{key}" not in SECRETS and getattr(obj, key) != getattr(base, key)
        ]
        _refuse_file_secrets({sec: dict(changed)}, "the generated settings file (settings_toml)")
        if changed:
            lines.append(f"\n[{sec}]")
            lines += [f"{key} = {_toml(value)}" for key, value in changed]
    return "\n".join(lines) + "\n"


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: quotes, backslashes and controls escaped
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, BaseModel):
        v = v.model_dump()
    if isinstance(v, dict):  # an inline table; unset (None) values are left out
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items() if x is not None) + " }"
    return repr(v)


def refuse_overrides(settings: Settings, fixed: Mapping[str, tuple[Any, str]], who: str) -> Settings:
    """``settings`` with each ``{"section.key": (value, why)}`` applied - unless the user set that key to
    something else, which is refused with a ConfigError saying why (never silently changed)."""
    for name, (value, why) in fixed.items():
        sec, _, key = name.partition(".")
        current = settings.value(name)
        if key in getattr(settings, sec).model_fields_set and current != value:
            raise ConfigError(
                f"setting {name} = {current!r} cannot be used by {who}: it needs {name} = {value!r} "
                f"({why}); fix: remove {name} from the config file and {env_name(name)} from the "
                "environment, or set it to that value"
            )
    return settings.updated({name: value for name, (value, _) in fixed.items()})


def refuse_user_set(settings: Settings, owned: Mapping[str, str], who: str) -> None:
    """Refuse, with the reason, each ``{"section.key": why}`` the user set to something other than its
    default: settings ``who`` decides itself and would otherwise ignore silently."""
    for name, why in owned.items():
        sec, _, key = name.partition(".")
        obj = getattr(settings, sec)
        default = type(obj).model_fields[key].get_default(call_default_factory=True)
        if key in obj.model_fields_set and getattr(obj, key) != default:
            raise ConfigError(
                f"setting {name} = {getattr(obj, key)!r} is not used by {who}: {why}; fix: remove "
                f"{name} from the config file and {env_name(name)} from the environment"
            )
