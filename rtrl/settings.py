"""One typed settings tree for every rtrl component (pydantic-settings).

Sources, later ones winning: built-in defaults, a TOML file (``--config`` or ``RTRL_CONFIG``), then
environment variables ``RTRL_<SECTION>__<KEY>`` (e.g. ``RTRL_KAFKA__BOOTSTRAP``). Every section is
one component's configuration; the component's factory sits next to the component and reads its
section (``trainer.factory.model_config``, ``trainer.config.TrainConfig.from_settings``,
``flows.batch_flow.batch_config`` ...), so no mapping from settings to a component is written twice.

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
import re
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from rtrl.errors import ConfigError
from schemas.data_use import DataUse, stricter

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
#: the SDK's salt when none is set: public (it is in this file), so refused outside local mode
DEFAULT_SALT = "rtrl-local-dev-salt"


def _is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (brackets allowed); a name other than localhost is not."""
    host = host.strip("[]").lower()
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _s(default: Any, help: str, **constraints: Any) -> Any:
    """A setting: its default, its help text (shown by ``rtrl config``) and pydantic constraints."""
    return Field(default, description=help, **constraints)


#: words of a query parameter's name that make its value a secret (``password``, ``access_token``, ``api-key`` ...)
_SECRET_WORDS = frozenset(
    "password passwd pwd pass passphrase token secret key apikey auth authorization credential credentials "
    "signature sig jwt".split()
)
#: parts of a run-together name that make its value a secret (``sasl.password`` and ``ApiKey`` as well)
_SECRET_PARTS = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "apikey",
    "accesskey",
    "privatekey",
    "credential",
)
#: rtrl's own DSN parameters: each names a file or a switch, never a secret (``client_cert_key`` is a path)
_PLAIN_PARAMS = frozenset(("password_file", "ca_cert", "verify", "client_cert", "client_cert_key"))
_PARAM = re.compile(r"(?<=[?&;#])([^=&;#?\s'\"]+)=([^&;#\s]*)")


def _secret_param(name: str) -> bool:
    """Whether a query parameter called ``name`` carries a credential (case and percent-encoding ignored)."""
    n = unquote(name.replace("+", " ")).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", n) if w]
    if n in _PLAIN_PARAMS or not words or words[-1] in ("file", "path", "location", "dir"):
        return False  # a path to a secret is not one
    compact = "".join(words)
    return any(w in _SECRET_WORDS or w.endswith("key") for w in words) or any(p in compact for p in _SECRET_PARTS)


def _redact_userinfo(token: str) -> str:
    """``token`` with the password of its ``user:password@`` part (with or without a scheme) as ``***``."""
    if "://" not in token and "," in token:  # a broker list: each host on its own
        return ",".join(_redact_userinfo(t) for t in token.split(","))
    start = token.find("://")
    start = start + 3 if start >= 0 else len(token) - len(token.lstrip("'\"([{<="))
    rest = token[start:]
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    colon = rest.find(":", rest.find("]") + 1 if rest.startswith("[") else 0, end)  # past an IPv6 address
    if at < 0 and colon >= 0 and not rest[colon + 1 : end].isdigit():
        at = rest.find("@", colon)  # a password with an unescaped / ? or # in it: never half shown
    user, sep, password = rest[: max(at, 0)].partition(":")
    if at < 0 or not sep or not password:
        return token
    return f"{token[:start]}{user}:***{rest[at:]}"


def redact_dsn(dsn: str) -> str:
    """``dsn`` (or any text holding DSNs) with every secret in it replaced by ``***``.

    The password of a ``user:password@`` part goes, with or without a scheme.
    So do the values of credential-like query parameters (``password``, ``token``, ``access_token``, ``key``,
    ``secret``, ``api_key``, ``sasl.password`` ...), matched case-insensitively, also after a ``#``.
    The rest stays readable: ``https://user:***@host:8443/?token=***&database=rtrl``.
    """

    def param(m: re.Match[str]) -> str:
        value = m[2].rstrip("'\")]}>,.:")  # the quote or bracket around a DSN in a message stays
        return f"{m[1]}=***{m[2][len(value) :]}" if value and _secret_param(m[1]) else m[0]

    text = _PARAM.sub(param, dsn)
    return re.sub(r"\S+", lambda m: _redact_userinfo(m[0]) if "@" in m[0] else m[0], text)


def _numeric(annotation: Any) -> bool:
    """Whether a setting of type ``annotation`` holds numbers (``int``, ``float | None``, ``list[float]`` ...)."""
    if annotation in (int, float):
        return True
    args = [a for a in get_args(annotation) if a is not type(None)]
    return get_origin(annotation) in (list, tuple, set, Union, UnionType) and any(map(_numeric, args))


def _boolean(value: Any) -> bool:
    """Whether ``value`` is a boolean: TOML's ``true`` / ``false``, or the same word from the environment."""
    if isinstance(value, list | tuple):
        return any(map(_boolean, value))
    return isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false"))


class Section(BaseModel):
    """One component's settings: unknown keys are errors; assignments are validated too; numbers are finite
    (an infinite timeout or a NaN rate is a typo, never a wish); a boolean is never a number; errors and
    ``repr`` never show a secret in a value (:func:`redact_dsn`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, hide_input_in_errors=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse ``true`` / ``false`` for a count, size, port or duration (pydantic would read them as 1 / 0)."""
        if info.field_name is not None and _boolean(v) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError("is a boolean, not a number (true is never read as 1, nor false as 0)")
        return v

    def __repr_args__(self):  # a password in a DSN or URL never reaches a log
        for k, v in super().__repr_args__():
            yield k, redact_dsn(v) if isinstance(v, str) else v


# ---------------------------------------------------------------- foundation: services


#: Kafka settings used only with SASL, only with OAUTHBEARER (required then), only with TLS
_SASL_FIELDS = (
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "oauth_token_endpoint_url",
    "oauth_client_id",
    "oauth_client_secret",
    "oauth_scope",
)
_OAUTH_REQUIRED = ("oauth_token_endpoint_url", "oauth_client_id", "oauth_client_secret")
_SSL_FIELDS = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password")


class KafkaSettings(Section):
    bootstrap: str = _s("", "host:port list of the Kafka brokers; empty = start a local noida-db broker")
    topic_prefix: str = _s("rtrl.", "prefix of every topic name (rtrl.events, ...)", pattern=r"^[A-Za-z0-9._-]+$")
    partitions: int = _s(4, "partitions of the keyed data topics when rtrl creates them", gt=0)
    replication_factor: int = _s(
        1, "replicas of every topic rtrl creates (production: 3); existing topics are checked against it", gt=0
    )
    min_insync_replicas: int = _s(
        1,
        "min.insync.replicas of every topic rtrl creates (production: 2): with "
        "acks=all a write needs this many replicas",
        gt=0,
    )
    timeout_s: float = _s(10.0, "seconds to wait for the broker before reporting it unreachable", gt=0)
    idle_backoff_s: float = _s(
        0.1,
        "how long a flow's reader of an empty partition pauses before fetching again "
        "(extra latency after a quiet spell)",
        gt=0,
    )
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = _s(
        "zstd", "codec of every rtrl producer (none, gzip, snappy, lz4, zstd); JSON batches shrink several-fold"
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = _s(
        "PLAINTEXT",
        "how every Kafka client reaches the brokers: PLAINTEXT (the local broker), SSL (TLS), SASL_PLAINTEXT "
        "or SASL_SSL (SASL login, over TLS with SASL_SSL); librdkafka's security.protocol",
    )
    sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] = _s(
        "",
        "SASL mechanism with a SASL_* security_protocol: PLAIN or SCRAM-SHA-256/512 (sasl_username, "
        "sasl_password) or OAUTHBEARER (an OIDC client-credentials token: oauth_* settings)",
    )
    sasl_username: str = _s("", "SASL user of PLAIN / SCRAM-SHA-*")
    sasl_password: str = _s(
        "", "SASL password of PLAIN / SCRAM-SHA-*: a secret, from RTRL_KAFKA__SASL_PASSWORD(_FILE) only", repr=False
    )
    oauth_token_endpoint_url: str = _s(
        "", "OAUTHBEARER: the OIDC token endpoint (https://...) the client-credentials token is fetched from"
    )
    oauth_client_id: str = _s("", "OAUTHBEARER: the OIDC client id")
    oauth_client_secret: str = _s(
        "",
        "OAUTHBEARER: the OIDC client secret: a secret, from RTRL_KAFKA__OAUTH_CLIENT_SECRET(_FILE) only",
        repr=False,
    )
    oauth_scope: str = _s("", "OAUTHBEARER: the scope asked for (space-separated); empty = the provider's default")
    ssl_ca_location: str = _s(
        "", "SSL / SASL_SSL: PEM file of the CA(s) that signed the brokers' certificates; empty = the system's CAs"
    )
    ssl_certificate_location: str = _s(
        "", "SSL / SASL_SSL: PEM file of this client's certificate (mutual TLS; with ssl_key_location)"
    )
    ssl_key_location: str = _s("", "SSL / SASL_SSL: PEM file of this client's private key (mutual TLS)")
    ssl_key_password: str = _s(
        "",
        "password of an encrypted ssl_key_location: a secret, from RTRL_KAFKA__SSL_KEY_PASSWORD(_FILE) only",
        repr=False,
    )
    ssl_endpoint_identification: Literal["https", "none"] = _s(
        "https",
        "SSL / SASL_SSL: https = the broker's certificate must name the host connected to; none = any name "
        "(only for brokers whose certificates do not name them)",
    )

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, v: str) -> str:
        for part in v.split(",") if v else []:
            host, _, port = part.strip().rpartition(":")
            if "@" in host:  # a login in the address would be printed wherever the broker is named
                raise ValueError(
                    f"names a login in {redact_dsn(part.strip())!r}: only host:port goes here, the user in "
                    "kafka.sasl_username and the password in RTRL_KAFKA__SASL_PASSWORD(_FILE)"
                )
            if not host or not port.isdigit():
                raise ValueError(f"must be host:port[,host:port...]; {part.strip()!r} is not")
            if not 0 < int(port) < 65536:
                raise ValueError(f"has port {port} in {part.strip()!r}: a port is 1..65535")
        return v

    @model_validator(mode="after")
    def _isr(self) -> KafkaSettings:
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"kafka.min_insync_replicas = {self.min_insync_replicas} exceeds kafka.replication_factor "
                f"= {self.replication_factor}: no write could ever be acknowledged"
            )
        return self

    @model_validator(mode="after")
    def _security(self) -> KafkaSettings:
        """Every combination librdkafka would refuse or silently ignore, refused here naming the fix."""
        proto, mech = self.security_protocol, self.sasl_mechanism
        sasl, tls = proto.startswith("SASL_"), proto.endswith("SSL")
        if sasl and not mech:
            raise ValueError(
                f"kafka.security_protocol = {proto!r} needs kafka.sasl_mechanism; fix: set it to PLAIN, "
                "SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (RTRL_KAFKA__SASL_MECHANISM)"
            )
        unused = [f for f in _SASL_FIELDS if getattr(self, f)] if not sasl else []
        if sasl and mech != "OAUTHBEARER":
            unused = [f for f in _SASL_FIELDS if f.startswith("oauth_") and getattr(self, f)]
            missing = [f for f in ("sasl_username", "sasl_password") if not getattr(self, f)]
        elif sasl:
            unused = [f for f in ("sasl_username", "sasl_password") if getattr(self, f)]
            missing = [f for f in _OAUTH_REQUIRED if not getattr(self, f)]
        else:
            missing = []
        if not tls:
            unused += [f for f in _SSL_FIELDS if getattr(self, f)]
            if self.ssl_endpoint_identification != "https":
                unused.append("ssl_endpoint_identification")
        if missing:
            raise ValueError(
                f"kafka.sasl_mechanism = {mech!r} needs "
                + ", ".join(f"kafka.{f}" for f in missing)
                + "; fix: set "
                + ", ".join(f"RTRL_KAFKA__{f.upper()}" for f in missing)
                + " (secrets only in the environment or a mounted Secret file, RTRL_..._FILE)"
            )
        if unused:
            raise ValueError(
                ", ".join(f"kafka.{f}" for f in unused) + f" set but not used with kafka.security_protocol = "
                f"{proto!r}"
                + (f" and kafka.sasl_mechanism = {mech!r}" if sasl else "")
                + "; fix: remove "
                + ("it" if len(unused) == 1 else "them")
                + " or choose the protocol/mechanism that uses "
                + ("it" if len(unused) == 1 else "them")
            )
        if bool(self.ssl_certificate_location) != bool(self.ssl_key_location):
            raise ValueError(
                "kafka.ssl_certificate_location and kafka.ssl_key_location go together (mutual TLS); fix: set both "
                "or neither"
            )
        if self.ssl_key_password and not self.ssl_key_location:
            raise ValueError("kafka.ssl_key_password set without kafka.ssl_key_location; fix: set both or neither")
        if self.oauth_token_endpoint_url and not self.oauth_token_endpoint_url.startswith(("https://", "http://")):
            raise ValueError(
                f"kafka.oauth_token_endpoint_url = {redact_dsn(self.oauth_token_endpoint_url)!r} must be an "
                "http(s):// URL"
            )
        return self


class ClickHouseSettings(Section):
    dsn: str = _s("", "ClickHouse DSN; empty = embedded chdb:///<data_dir>/clickhouse")
    database: str = _s("rtrl", "database holding rtrl's tables", pattern=r"^[A-Za-z0-9_]+$")
    timeout_s: float = _s(10.0, "seconds to wait for a ClickHouse server before reporting it unreachable", gt=0)
    password_file: str = _s(
        "",
        "file holding the password of the DSN's user, read when connecting (the DSN and environment then carry "
        "no secret; same as a password_file=PATH parameter in the DSN); empty = the DSN's own",
    )
    user: str = _s("", "user rtrl logs in as on an http(s) server; empty = the DSN's own (else `default`)")
    password: str = _s(
        "",
        "that user's password: a secret, from RTRL_CLICKHOUSE__PASSWORD only (or, as a file, "
        "clickhouse.password_file); empty = password_file's, else the DSN's own",
        repr=False,
    )
    ca_cert: str = _s(
        "",
        "https DSN: PEM file of the CA(s) that signed the server's certificate, or 'certifi' (Mozilla's "
        "bundle); empty = the system's CAs",
    )
    verify: bool = _s(
        True, "https DSN: check the server's certificate and host name (false only for a throwaway test server)"
    )
    client_cert: str = _s("", "https DSN: PEM file of this client's certificate (mutual TLS)")
    client_cert_key: str = _s("", "https DSN: PEM file of client_cert's private key, if not in client_cert")
    cluster: str = _s(
        "",
        "name of the ClickHouse cluster (the servers' <remote_servers>) to lay rtrl's tables out on: `rtrl migrate` "
        "then runs every DDL ON CLUSTER, makes each table a Replicated*MergeTree <table>_local on every node and a "
        "Distributed table <table> over it (what rtrl reads and writes); `rtrl migrate --print` shows the DDL; "
        "empty = a single node",
    )
    replica_path: str = _s(
        "/clickhouse/tables/{shard}/{database}/{table}",
        "with clickhouse.cluster: Keeper path of each replicated table; {shard} is each server's macro, "
        "{database} and {table} ClickHouse fills in",
    )
    replica_name: str = _s(
        "{replica}", "with clickhouse.cluster: replica name of each replicated table ({replica}: each server's macro)"
    )

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, v: str) -> str:
        if v.startswith(("http://", "https://")):
            try:
                urlsplit(v).port  # noqa: B018 - raises on a port outside 1..65535 or not a number
            except ValueError:
                raise ValueError(f"has a bad port in {redact_dsn(v)!r}: a port is 1..65535") from None
            return v
        if v == "" or v.startswith("chdb://"):
            return v
        raise ValueError(
            "must be empty (embedded chdb under data_dir), chdb:///abs/path, chdb://memory or http(s)://host:port"
        )

    @model_validator(mode="after")
    def _cluster(self) -> ClickHouseSettings:
        """The cluster's name and replica settings, by the check that makes its DDL (rtrl.clickhouse_cluster)."""
        if self.cluster:
            from rtrl.clickhouse_cluster import check

            try:
                check(self.cluster, self.replica_path, self.replica_name)
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return self

    @model_validator(mode="after")
    def _credentials(self) -> ClickHouseSettings:
        u = urlsplit(self.dsn) if self.dsn.startswith(("http://", "https://")) else None
        if self.password and self.password_file:
            raise ValueError(
                "clickhouse.password and clickhouse.password_file are both set; fix: keep one (the file is how "
                "a mounted Secret gives it)"
            )
        same = u is not None and self.password != "" and unquote(u.password or "") == self.password  # a child's
        if (self.password or self.password_file) and u is not None and u.password is not None and not same:
            raise ValueError(
                "clickhouse.dsn carries a password and clickhouse.password(_file) another; fix: remove it from the DSN"
            )
        if self.user and u is not None and u.username and u.username != self.user:
            raise ValueError(
                f"clickhouse.user = {self.user!r} but clickhouse.dsn names user {u.username!r}; fix: keep one"
            )
        tls = [f for f in ("ca_cert", "client_cert", "client_cert_key") if getattr(self, f)]
        tls += [] if self.verify else ["verify"]
        if tls and not self.dsn.startswith("https://"):
            raise ValueError(
                ", ".join(f"clickhouse.{f}" for f in tls) + " set but clickhouse.dsn is not https:// (TLS settings "
                "apply to an https server only; the embedded chdb and http:// use none); fix: remove them or set "
                "clickhouse.dsn to the server's https:// address"
            )
        if self.client_cert_key and not self.client_cert:
            raise ValueError("clickhouse.client_cert_key set without clickhouse.client_cert; fix: set both")
        return self


class SdkSettings(Section):
    salt: str = _s(
        DEFAULT_SALT,
        "secret salt for hashing user ids; the default is public and refused outside local mode (services "
        "not on loopback): set your own, e.g. with RTRL_SDK__SALT",
        min_length=8,
        repr=False,
    )
    queue_size: int = _s(100_000, "events the SDK buffers before it drops (and counts) new ones", gt=0)
    linger_ms: int = _s(5, "producer linger: how long to wait to fill a batch", ge=0)
    delivery_timeout_s: float = _s(300.0, "how long the producer retries an event before reporting it failed", gt=0)
    max_event_bytes: int = _s(64 * 1024, "largest encoded event accepted anywhere in rtrl", gt=0)
    max_future_s: float = _s(
        600.0, "the SDK refuses an event stamped further ahead of its clock (clock skew allowed)", gt=0
    )
    max_past_s: float = _s(
        7 * 86400.0,
        "the SDK refuses an event stamped further behind its clock (older than the events topic keeps)",
        gt=0,
    )


class GovernanceSettings(Section):
    """What rtrl may do with each organisation's data (issue 38, docs/governance.md).

    A trajectory's data-use class is the stricter of the product's choice (``start_trajectory(..., data_use=...)``)
    and its org's policy here. The SDK, the batch flow and the trainer each apply it again. A change of policy
    applies to what is handled after it; erasure handles the past.
    """

    default: DataUse = _s(
        "train",
        "data-use class of every org not in governance.orgs: train (the shared policy and the org's adapter), "
        "adapter_only (only the org's own adapter), monitor_only (events and rewards for monitoring; no token "
        "stored or trained) or none (nothing leaves the SDK)",
    )
    orgs: dict[str, DataUse] = Field(
        default_factory=dict,
        description="data-use class per organisation [governance.orgs] (org = class); the stricter of it and the "
        "product's choice wins",
    )
    secret_scanner: str = _s(
        "detect-secrets",
        "what screens each rollout's decoded text for secrets before the SDK sends it: detect-secrets, "
        "'package.module:Class' (a scan(text) method), or '' for none; a rollout with a secret is kept back and its "
        "trajectory is monitor_only (client/screening.py)",
    )
    deny_refresh_s: float = _s(
        10.0,
        "seconds between each consumer's reads of the erased subjects (the deny list of `rtrl erase`); "
        "`rtrl erase` waits this long after listing a subject before it deletes, so no consumer writes it back",
        gt=0,
    )

    def policy(self, org: str) -> DataUse:
        """The org's data-use class under these settings."""
        return self.orgs.get(org, self.default)

    def effective(self, org: str, *requested: DataUse) -> DataUse:
        """The class a trajectory of ``org`` gets: the strictest of its org's policy and ``requested``."""
        return stricter(self.policy(org), *requested)


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
    archive_days: float = _s(
        90.0, "days the Parquet archive keeps a day's events (`rtrl retention apply`); 0 = forever", ge=0
    )
    checkpoints_keep: int = _s(
        10,
        "newest checkpoint versions `rtrl retention apply` keeps, their Megatron checkpoints and registry exports; "
        "the serving version and its rollback targets are kept too; 0 = keep every version",
        ge=0,
    )
    rollback_versions: int = _s(
        5,
        "promoted ancestors of the serving version kept as rollback targets (`rtrl rollback` re-promotes a parent), "
        "however old",
        ge=0,
    )
    state_days: float = _s(
        7.0,
        "days the flows keep state nothing uses: a recovery folder no running flow holds, a spill file no running "
        "flow holds and no kept snapshot refers to, counted from its last write (`rtrl retention apply`; a "
        "running reward flow prunes its own spill files); 0 = forever",
        ge=0,
    )
    schedule: str = _s(
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


# ---------------------------------------------------------------- data plane: streams


class TaskKindSettings(Section):
    """Window rules of one task kind (``flow.task_kinds.NAME``); unset times fall back to the flow's."""

    deadline_s: float | None = _s(
        None, "event time from the first event to a forced close; unset = flow.deadline_s", gt=0
    )
    allowed_lateness_s: float | None = _s(
        None, "how long after its deadline a late event still revises the reward; unset = flow.allowed_lateness_s", ge=0
    )
    awaits_verdict: bool = _s(
        False,
        "the kind ends with the user's verdict (task_verdict): its reward stays provisional until the verdict "
        "arrives, and the revision carrying it is final",
    )


def _default_task_kinds() -> dict[str, TaskKindSettings]:
    # background tasks run for hours and are judged as a whole, hours or days after they end
    return {"background": TaskKindSettings(deadline_s=86_400.0, allowed_lateness_s=7 * 86_400.0, awaits_verdict=True)}


class FlowSettings(Section):
    """The reward flow's windows; the sinks and snapshots of both flows."""

    deadline_s: float = _s(3600.0, "event time from a trajectory's first event to a forced close", gt=0)
    grace_s: float = _s(10.0, "event time to wait after a trajectory ends for overtaken events", ge=0)
    allowed_lateness_s: float = _s(86400.0, "how long after its deadline a late event still revises a reward", ge=0)
    max_clock_skew_s: float = _s(
        600.0,
        "events further ahead of their Kafka record's timestamp (the broker's or producer's clock) are rejected; "
        "one within it cannot move the partition's clock past that timestamp",
        gt=0,
    )
    max_future_s: float = _s(
        86400.0,
        "for input without record timestamps: events further ahead of the partition watermark are rejected",
        gt=0,
    )
    task_kinds: dict[str, TaskKindSettings] = Field(
        default_factory=_default_task_kinds,
        description="window rules per task kind [flow.task_kinds.NAME] (deadline, allowed lateness, whether a "
        "verdict ends it), from minutes to days; kinds not listed use the flow's",
    )
    batch_rows: int = _s(20_000, "rows buffered per ClickHouse table / archive before a write (both flows)", gt=0)
    batch_seconds: float = _s(1.0, "longest a row waits in a sink buffer before a write (both flows)", gt=0)
    archive_dir: str = _s("", "Parquet archive of raw events; empty = <data_dir>/archive/events")
    recovery_dir: str = _s("", "Bytewax recovery folder; empty = <data_dir>/recovery/rewards")
    state_memory_mb: float = _s(
        0.0,
        "memory (MB, estimated) the reward flow's windows may use per Kafka partition; beyond it the least recently "
        "touched open, closed and expired windows move to a SQLite file per partition in state_dir and come back "
        "when an event needs them (same results); 0 = no limit, all in memory (the default: set it, e.g. 512, for "
        "hours-long tasks with many open windows)",
        ge=0,
    )
    state_dir: str = _s(
        "",
        "folder of the reward flow's spilled window state (state_memory_mb); empty = <data_dir>/state/rewards. "
        "Recovery snapshots refer to it: keep it on the recovery folder's volume and move, back up or delete both "
        "together",
    )
    snapshot_s: float = _s(
        2.0, "Bytewax snapshot (epoch) interval of both flows: the most work replayed after a crash", gt=0
    )
    tail: bool = _s(True, "keep waiting for new events at the end of the topic (false = stop at the end)")


class RewardDefinition(Section):
    """A reward version defined as data: a parent version and the weights it changes (rewards.versions)."""

    parent: str = _s("v2", "version whose weights this one starts from (built in, or defined before it)", min_length=1)
    reason: str = _s(..., "why this version exists, e.g. 'broken tool calls are negative'", min_length=1)
    author: str = _s(..., "who defined it (a name or an address)", min_length=1)
    weights: dict[str, float | bool | None] = _s(
        {}, "weights that differ from the parent's (names: rewards.RewardConfig's fields, e.g. w_broken = 0.5)"
    )


def read_reward_file(path: str) -> dict[str, RewardDefinition]:
    """The ``[versions.NAME]`` tables of ``rewards.file``, checked (ValueError naming the file, the table and the
    fix). Read once, when the settings load, so every part of a process sees the same definitions."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"setting rewards.file = {str(path)!r} cannot be read ({e}); fix: point it at a UTF-8 TOML file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"rewards.file {p} is not valid TOML: {e}; fix: correct the file") from None
    extra = set(data) - {"versions"}
    if extra or not isinstance(data.get("versions", {}), dict):
        raise ValueError(
            f"rewards.file {p} may hold only [versions.NAME] tables, found {sorted(extra) or 'versions'}; "
            "fix: put each version in a [versions.NAME] table"
        )
    out = {}
    for name, table in data.get("versions", {}).items():
        try:
            out[name] = RewardDefinition.model_validate(table)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{p} [versions.{name}]: {problems}; fix: correct that table") from None
    return out


class RewardSettings(Section):
    """Which reward versions exist in the stream, and which one trains: the built-in ones (v2, v1-discard-broken),
    those of ``rewards.file`` and those of ``rewards.define`` (rewards.versions)."""

    versions: Annotated[list[str], NoDecode] = _s(
        ["v2"], "reward versions the reward flow computes (comma-separated in the environment)", min_length=1
    )
    train_version: str = _s("v2", "reward version the batch flow trains on; the reward flow must compute it")
    file: str = _s(
        "",
        "TOML file of reward versions, one [versions.NAME] table each (parent, reason, author, weights); empty = none",
    )
    define: dict[str, RewardDefinition] = _s(
        {}, "reward versions defined in the settings tree: [rewards.define.NAME] with parent, reason, author, weights"
    )
    train_schedule: dict[int, str] = _s(
        {},
        "switch the trained reward version at cycle boundaries: {cycle = version}, e.g. {3 = 'v2'} trains cycles "
        "3 and later on v2 (before the first entry: train_version); `rtrl rewards train V` switches at the next "
        "cycle instead and overrides this schedule until another request",
    )
    batch_versions: Annotated[list[str], NoDecode] = _s(
        [],
        "reward versions the batch flow makes micro-batches for besides train_version and the train_schedule's "
        "(each batch names its version; a trainer trains only its cycle's): the versions `rtrl rewards train` "
        "may switch to (comma-separated in the environment)",
    )

    def trainable(self) -> list[str]:
        """The versions the batch flow makes micro-batches for: train_version, the schedule's, batch_versions."""
        out = [self.train_version]
        for v in [self.train_schedule[c] for c in sorted(self.train_schedule)] + list(self.batch_versions):
            if v not in out:
                out.append(v)
        return out

    def scheduled(self, cycle: int) -> str:
        """The reward version the schedule gives cycle ``cycle`` (1 = the first trained cycle)."""
        due = [c for c in sorted(self.train_schedule) if c <= cycle]
        return self.train_schedule[due[-1]] if due else self.train_version

    _file_versions: dict[str, RewardDefinition] = PrivateAttr(default_factory=dict)

    @property
    def file_versions(self) -> dict[str, RewardDefinition]:
        """The versions of ``rewards.file``, as read when the settings loaded."""
        return self._file_versions

    @model_validator(mode="after")
    def _read_file(self) -> RewardSettings:
        self._file_versions = read_reward_file(self.file) if self.file else {}
        return self

    @field_validator("versions", "batch_versions", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x.strip() for x in v.split(",") if x.strip()]
        return v

    @model_validator(mode="after")
    def _trained_is_computed(self) -> RewardSettings:
        if self.train_version not in self.versions:
            raise ValueError(
                f"rewards.train_version = {self.train_version!r} is not among rewards.versions = "
                f"{self.versions}: the batch flow would wait for rewards nobody computes; fix: add it "
                "to rewards.versions"
            )
        for v in self.trainable():
            if v not in self.versions:
                where = "rewards.batch_versions" if v in self.batch_versions else "rewards.train_schedule"
                raise ValueError(
                    f"{where} names {v!r}, which is not among rewards.versions = {self.versions}: no reward "
                    "flow computes it, so no micro-batch would carry it; fix: add it to rewards.versions"
                )
        if any(c < 1 for c in self.train_schedule):
            raise ValueError("rewards.train_schedule: cycles count from 1; fix: use cycle numbers >= 1")
        return self


class BackfillSettings(Section):
    """``rtrl backfill``: a reward version over the Parquet archive with Apache Beam (flows.backfill)."""

    workers: int = _s(2, "worker processes of the local FnApiRunner (1 = in the calling process)", ge=1, le=64)
    out_dir: str = _s("", "where the backfill writes its Parquet rewards and dead letters; empty = <data_dir>/backfill")
    pipeline_options: str = _s(
        "",
        "file of Beam pipeline options (--runner=FlinkRunner ..., one or more per line, # comments): another "
        "runner than the local FnApiRunner; examples in deploy/beam/",
    )


class BatchingSettings(Section):
    """The batch flow: join, staleness, advantages, packing."""

    join_wait_s: float = _s(60.0, "how long a rollout waits for its reward, and a reward for its rollout", ge=0)
    group_wait_s: float = _s(10.0, "how long a group waits for all its samples before it is used as it is", ge=0)
    seq_len: int = _s(128, "tokens per packed row; longer samples are dropped and counted", gt=0)
    rows: int = _s(8, "rows per micro-batch (token budget = rows x seq_len)", gt=0)
    flush_s: float = _s(2.0, "longest a sample waits for a full micro-batch before a partial one is sent", ge=0)
    idle_flush_s: float = _s(2.0, "wall-clock quiet time after which a cohort's clock moves on by itself", gt=0)
    baseline_alpha: float = _s(0.2, "step of the per-cohort running reward mean used for groups of one", gt=0, le=1)
    recovery_dir: str = _s("", "Bytewax recovery folder; empty = <data_dir>/recovery/batches")
    tail: bool = _s(True, "keep waiting at the end of the topics (false = stop at the end)")


# ---------------------------------------------------------------- data plane: trainer


class LossSettings(Section):
    """Dr. GRPO clipped ratio, truncated importance weights, k3 KL."""

    eps_low: float = _s(0.2, "clip range below a ratio of 1", gt=0, lt=1)
    eps_high: float = _s(0.28, "clip range above a ratio of 1 (clip-higher)", gt=0)
    is_cap: float = _s(2.0, "cap of an off-policy token's importance weight", ge=1)
    kl_coef: float = _s(0.01, "weight of the k3 KL term to the reference model (0 = off)", ge=0)
    norm_tokens: int = _s(0, "constant loss normaliser (Dr. GRPO); 0 = micro-batches x rows x seq_len of a step", ge=0)
    log_ratio_clamp: float = _s(
        20.0, "clamp log-ratios (trainer vs behaviour, reference vs trainer) to +-this before exp (0 = off)", ge=0
    )
    dual_clip: float = _s(
        3.0, "dual-clip: a negative-advantage token's loss is at most this x |advantage| (> 1; 0 = off)", ge=0
    )
    k3_clamp: float = _s(10.0, "clamp each token's KL term (k3 or full) to at most this (0 = off)", ge=0)
    kl_estimator: Literal["k3", "full"] = _s(
        "k3",
        "the KL term per trained token: k3 (on the sampled token; cheap, but blind to mass moved onto tokens the "
        "policy rarely samples) or full (the exact KL over the whole vocabulary; costs the reference's [B, S, V] "
        "log-softmax per micro-batch)",
    )
    seq_ratio_guard: Literal["off", "mask", "truncate"] = _s(
        "off",
        "per-sequence importance-ratio guard on the geometric-mean ratio to the behaviour policy: "
        "mask (drop sequences outside [seq_ratio_low, seq_ratio_high]), truncate (cap a sequence's "
        "weight at seq_ratio_high) or off",
    )
    seq_ratio_low: float = _s(0.5, "lower end of the sequence guard's band of geometric-mean ratios", gt=0, le=1)
    seq_ratio_high: float = _s(2.0, "upper end of the sequence guard's band of geometric-mean ratios", ge=1)
    delayed_correction: Literal["truncated_is", "none"] = _s(
        "truncated_is",
        "how a delayed sample (policy lag over train.max_policy_lag, within train.max_delayed_lag) is corrected: "
        "truncated_is (each token's gradient weighted by min(ratio to its behaviour policy, delayed_is_cap)) or "
        "none (no correction: plain advantage x grad log-prob, an experiment's control arm)",
    )
    delayed_is_cap: float = _s(
        1.0,
        "cap of a delayed token's importance weight (>= 1: a cap below 1 would shrink even a token whose "
        "probability did not change; 1 = delayed tokens are only ever down-weighted)",
        ge=1,
    )

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip(cls, v: float) -> float:
        if v != 0 and not v > 1:
            raise ValueError("must be > 1 (a bound below the ratio 1 would clip on-policy tokens), or 0 = off")
        return v


class TrainSettings(Section):
    """The optimizer and the training run."""

    run_id: str = _s("", "training run id kept across resumes; empty = derived from the checkpoint folder")
    steps: int = _s(20, "optimizer steps to take (a resumed run continues to this total)", gt=0)
    micro_batches_per_step: int = _s(2, "micro-batches accumulated into one optimizer step", gt=0)
    updates_per_step: int = _s(
        1,
        "optimizer updates on each step's micro-batches (PPO's epochs): the first is what one update does, the "
        "later ones reuse the samples' behaviour log-probs, the clip bounding how far they move; 1 = each "
        "micro-batch trains once",
        gt=0,
        le=64,
    )
    lr: float = _s(1e-3, "AdamW peak learning rate", gt=0)
    beta1: float = _s(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = _s(0.999, "AdamW beta2", ge=0, lt=1)
    weight_decay: float = _s(0.0, "AdamW decoupled weight decay", ge=0)
    warmup_steps: int = _s(0, "steps of linear learning-rate warm-up from 0 to lr", ge=0)
    grad_clip: float = _s(1.0, "clip the global gradient norm to this (0 = off); on by default", ge=0)
    max_policy_lag: int = _s(
        1,
        "samples older than this many policy versions are dropped (counted) or, within max_delayed_lag, delayed",
        ge=0,
    )
    max_delayed_lag: int = _s(
        4,
        "samples with a policy lag over max_policy_lag but at most this train on the delayed path (their own "
        "baseline, a truncated importance weight: loss.delayed_correction); older ones are dropped (counted); "
        "0 = no delayed path (every sample over max_policy_lag is dropped)",
        ge=0,
    )
    checkpoint_every: int = _s(10, "steps between checkpoints (one is also written at the end)", gt=0)
    checkpoint_dir: str = _s("", "where checkpoints go; empty = <data_dir>/checkpoints")
    idle_timeout_s: float = _s(30.0, "stop when no micro-batch arrives for this long", gt=0)
    torch_threads: int = _s(
        0, "CPU threads for torch; 0 = auto: all cores but one on a CPU-only machine (the broker needs one)", ge=0
    )

    @model_validator(mode="after")
    def _delayed_beyond_near(self) -> TrainSettings:
        if 0 < self.max_delayed_lag <= self.max_policy_lag:
            raise ValueError(
                f"train.max_delayed_lag = {self.max_delayed_lag} is not above train.max_policy_lag = "
                f"{self.max_policy_lag}, so no sample would take the delayed path; fix: set train.max_delayed_lag "
                "above train.max_policy_lag, or to 0 to drop every sample over train.max_policy_lag"
            )
        return self


class ModelSettings(Section):
    """The policy's architecture (a megatron-core GPTModel). Defaults: the tiny CPU model."""

    hf_path: str = _s(
        "",
        "a Hugging Face checkpoint folder (config.json + safetensors; dense Llama, Qwen2 or Qwen3): the "
        "architecture comes from its config.json (a shape setting below that disagrees is refused) and the "
        "weights of the policy and its KL reference from its tensors; empty = the shape settings, random init",
    )

    @field_validator("hf_path")
    @classmethod
    def _absolute_hf_path(cls, v: str) -> str:
        """Absolute, so every part of the loop (started in the repository's folder) finds the same checkpoint."""
        return os.path.abspath(os.path.expanduser(v)) if v else v

    num_layers: int = _s(2, "transformer layers", gt=0)
    hidden_size: int = _s(64, "model width", gt=0)
    num_attention_heads: int = _s(4, "attention heads", gt=0)
    num_query_groups: int = _s(0, "key/value heads for grouped-query attention; 0 = one per attention head", ge=0)
    ffn_hidden_size: int = _s(0, "MLP width; 0 = 4 x hidden_size", ge=0)
    vocab_size: int = _s(256, "vocabulary size", gt=0)
    seq_length: int = _s(64, "longest sequence (packed micro-batch row) the model is built for", gt=0)
    normalization: Literal["LayerNorm", "RMSNorm"] = _s("LayerNorm", "LayerNorm or RMSNorm")
    activation: Literal["gelu", "swiglu"] = _s("gelu", "MLP activation: gelu, or swiglu (gated SiLU)")
    position_embedding_type: Literal["rope", "learned_absolute"] = _s("rope", "rope or learned_absolute")
    rope_base: float = _s(10000.0, "RoPE base frequency (theta)", gt=0)
    tie_embeddings: bool = _s(False, "share the input embedding and output layer weights")
    qkv_bias: bool = _s(False, "bias on the query/key/value projections (Qwen2 style)")
    linear_bias: bool = _s(True, "biases on the other linear layers (GPT-2 style; Llama and Qwen: false)")
    hidden_dropout: float = _s(0.0, "dropout after attention and MLP (RL compares log-probs: keep 0)", ge=0, lt=1)
    attention_dropout: float = _s(0.0, "dropout of attention probabilities", ge=0, lt=1)
    init_method_std: float = _s(0.02, "standard deviation of the weight init", gt=0)
    seed: int = _s(1234, "seed of the weight init and megatron's RNG tracker")


class ParallelSettings(Section):
    """How one model replica is split over ranks: world size = tp x pp x dp."""

    tp: int = _s(1, "tensor-parallel size: each matmul and the vocabulary split over this many ranks", gt=0)
    pp: int = _s(1, "pipeline-parallel size: the layers split into this many stages", gt=0)
    dp: int = _s(0, "data-parallel size; 0 = derived as world_size / (tp x pp)", ge=0)
    sequence_parallel: bool = _s(
        False,
        "split layer-norm and dropout activations along the sequence over the tensor-parallel ranks (needs tp > 1)",
    )

    @model_validator(mode="after")
    def _sp(self) -> ParallelSettings:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1; fix: raise parallel.tp or turn it off")
        return self


class PrecisionSettings(Section):
    """Number formats. FP8 needs Transformer Engine and a GPU (the trainer refuses it otherwise)."""

    bf16: bool = _s(False, "parameters and activations in bfloat16 (on CPU ~10x slower than fp32)")
    fp8: Literal["", "hybrid", "e4m3"] = _s(
        "", "FP8 GEMMs through Transformer Engine: hybrid (e4m3 forward, e5m2 backward) or e4m3; empty = off"
    )
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = _s(
        "delayed", "FP8 scaling recipe (mxfp8 needs Blackwell); read only when fp8 is set"
    )

    @model_validator(mode="after")
    def _fp8_needs_bf16(self) -> PrecisionSettings:
        if self.fp8 and not self.bf16:
            raise ValueError(
                f"precision.fp8 = {self.fp8!r} needs precision.bf16 = true (FP8 training keeps bf16 "
                "parameters); fix: set precision.bf16 = true"
            )
        return self


# ---------------------------------------------------------------- application


class LoopSettings(Section):
    cycles: int = _s(24, "training cycles the main job runs (candidate -> eval gate -> promote or reject)", gt=0)
    rate: float = _s(100.0, "tasks per second the policy server serves (each sampled group_size times)", gt=0)
    samples_per_cycle: int = _s(2048, "samples the trainer uses per cycle (the samples trigger)", gt=0)
    group_size: int = _s(4, "completions sampled per task (group-relative advantages need >= 2)", gt=0)
    orgs: int = _s(3, "simulated organisations (cohorts are org x task kind)", gt=0)
    specialised_orgs: int = _s(
        0,
        "of the simulated orgs, how many follow a convention of their own on two task kinds (their reviewers "
        "accept an edit there only after a given tool ran, which the prompt does not show: "
        "simulator.tasks.conventions_for): the last ones "
        "(with 3 orgs and 2 specialised, org-1 and org-2; org-0 keeps the global convention); 0 = none; at most "
        "loop.orgs",
        ge=0,
    )
    users_per_org: int = _s(200, "simulated users per organisation (an A/B randomises and analyses by user)", gt=0)
    hard_share: float = _s(0.5, "share of hard tasks", ge=0, le=1)
    cycle_max_s: float = _s(
        120.0, "wall-time trigger: a cycle ends after this long even with fewer samples (production: 5 hours)", gt=0
    )
    warm_start_steps: int = _s(300, "supervised steps that make the initial policy (version 0)", ge=0)
    warm_right_easy: float = _s(
        -1.0,
        "share of right edits on easy tasks in what the initial policy imitates "
        "(-1 = like hard ones, 0.35): near 1 makes a policy whose failures are "
        "predictable from the prompt, where the v1 reward hack shows fastest",
    )
    eval_tasks: int = _s(200, "held-out tasks of the eval suite", gt=0)
    solve_tolerance: float = _s(
        0.03, "smallest drop of the held-out solve rate worth a rejection (it must also be significant)", ge=0
    )
    gate_alpha: float = _s(
        0.05,
        "the eval gate's false-refusal rate: a rate's move refuses a candidate only when Fisher's exact test finds "
        "it at this level, Holm-corrected over the gate's comparisons; 0 = the thresholds alone",
        ge=0,
        lt=1,
    )
    mismatch_log_ratio_max: float = _s(
        15.0,
        "training-inference mismatch alert: a candidate trained by a step whose largest |trainer - behaviour "
        "log-prob| on on-policy tokens exceeded this is refused (it includes the policy's drift within a cycle: "
        "up to ~7 seen on the defaults); 0 = off",
        ge=0,
    )
    mismatch_k3_max: float = _s(
        0.0,
        "training-inference mismatch alert on a step's mean k3 KL between behaviour and trainer log-probs on "
        "on-policy tokens; 0 = off (the default: within the loop's many-step cycles one drifted token, e^5.6, "
        "gave a step 2.4 where the median is 0.03; set it where a version trains few steps)",
        ge=0,
    )
    ab_share: float = _s(
        0.0,
        "A/B mode: share of users (by hash) a candidate that passed the evals serves before the "
        "decision; an always-valid sequential test on their behaviour in ClickHouse against the serving "
        "version's rolls it back or promotes it (0 = off)",
        ge=0,
        le=1,
    )
    ab_trajectories: int = _s(
        400,
        "A/B mode: candidate trajectories after which a candidate no always-valid test found worse is promoted "
        "(one found worse is rolled back at once, at any look)",
        gt=0,
    )
    ab_alpha: float = _s(
        0.05,
        "A/B mode: false-alarm rate of the sequential tests, valid however often they look: half for mSPRT per "
        "guarded metric over all users, half for the same per org (a hack confined to one org's users)",
        gt=0,
        lt=1,
    )
    ab_cuped: bool = _s(
        True,
        "A/B mode: CUPED - each user's behaviour on the serving version before the candidate came is the covariate "
        "of the sequential test (less variance where users differ lastingly, earlier decisions; unbiased either "
        "way; the loop's simulated users differ lastingly in strictness only, simulator.world)",
    )
    ab_tau: float = _s(
        0.1, "A/B mode: the relative effect the sequential test is tuned to (0.1 = 10%; any value keeps alpha)", gt=0
    )
    final_ab_trajectories: int = _s(
        4000,
        "the main job ends with a live A/B of its final version against v0, users split 50/50 by hashed user id, "
        "until each arm has this many trajectories in ClickHouse (0 = no final A/B)",
        ge=0,
    )
    final_ab_max_s: float = _s(
        300.0, "the most wall time the final A/B serves (its table says when an arm fell short)", gt=0
    )
    reset_on_reject: bool = _s(
        True,
        "a rejected candidate's weights are dropped (false: the training run goes on "
        "from them and only serving stays on the last promotion)",
    )
    seed: int = _s(0, "seed of the tasks, sampling and the initial policy")
    checkpoint_every: int = _s(
        8,
        "trainer steps between resumable checkpoints within a cycle (a restarted trainer "
        "continues from the last one; with loop.processes only)",
        gt=0,
    )
    processes: bool = _s(
        False,
        "run each part (reward flow, batch flow, policy server, trainer) as its own process "
        "under a supervisor that restarts any that dies; ClickHouse is then served to them "
        "by devservices.chserver",
    )
    max_restarts: int = _s(
        5,
        "with loop.processes: restarts of one part (or the embedded ClickHouse front) allowed within "
        "loop.restart_window_s; one more death in that window ends the run (systemd's StartLimitBurst)",
        ge=0,
    )
    restart_window_s: float = _s(
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


class SimulatorSettings(Section):
    seed: int = _s(0, "random seed; the same seed gives the same events")
    trajectories: int = _s(2000, "trajectories to simulate in one run", gt=0)
    orgs: int = _s(6, "simulated organisations", gt=0)
    users_per_org: int = _s(20, "simulated users in each organisation", gt=0)
    rate: float = _s(0.0, "events per second sent through the SDK; 0 = as fast as possible", ge=0)
    start_ms: int = _s(0, "event time of the first trajectory (ms since epoch); 0 = now", ge=0)
    duplicate_rate: float = _s(0.01, "fraction of events the client sends twice", ge=0, le=1)
    reorder_rate: float = _s(0.02, "fraction of events delivered after their successor", ge=0, le=1)
    late_check_rate: float = _s(0.05, "fraction of persistence checks that arrive hours late", ge=0, le=1)
    long_task_share: float = _s(
        0.0,
        "share of trajectories that are hours-long background tasks (kind 'background') judged by a verdict",
        ge=0,
        le=1,
    )
    long_task_hours: float = _s(3.0, "median event-time length of a background task, hours", gt=0)
    verdict_min_h: float = _s(1.0, "least event-time hours between a background task's end and its verdict", ge=0)
    verdict_max_h: float = _s(48.0, "most event-time hours between a background task's end and its verdict", ge=0)
    verdict_rate: float = _s(0.9, "share of background tasks whose user ever gives a verdict", ge=0, le=1)

    @model_validator(mode="after")
    def _verdict_range(self) -> SimulatorSettings:
        if self.verdict_min_h > self.verdict_max_h:
            raise ValueError(
                f"simulator.verdict_min_h = {self.verdict_min_h} is above simulator.verdict_max_h = "
                f"{self.verdict_max_h}; fix: make the range [verdict_min_h, verdict_max_h] non-empty"
            )
        return self


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
"""The megatron linears a LoRA adapter may target (in every layer attention's fused QKV and output projections and
the MLP's two; and the model's output layer)."""


class AdapterSettings(Section):
    """Per-organisation LoRA adapters on the shared policy (issue 17): which orgs get one, their shape, and what the
    shared policy trains on. An org's adapter trains only on that org's samples; it is gated and promoted on its own."""

    orgs: Annotated[list[str], NoDecode] = _s(
        [],
        "organisations that get their own adapter once they pass adapters.min_samples; '*' = every org that does; "
        "empty = no adapters (comma-separated in the environment)",
    )
    min_samples: int = _s(
        256,
        "samples an org must have sent through the batch flow before its adapter stream starts (the "
        "minimum-traffic threshold); until then its samples train only the shared policy",
        ge=0,
    )
    shared_traffic: Literal["all", "unadapted", "served"] = _s(
        "served",
        "what the shared policy trains on: all traffic with each adapted org's samples trained through the "
        "adapter version that served them, frozen (served: the importance ratio compares with the real behaviour "
        "policy, and the base is not pulled towards an org's own habit where its adapter follows it); all traffic "
        "on the base alone (all: the global orgs lost about 0.03 of P(solve), bench/RESULTS.md); or only the orgs "
        "without an adapter (unadapted)",
    )
    revalidate_scales: Annotated[list[float], NoDecode] = _s(
        [0.5],
        "when a serving adapter's re-validation on a new base is refused, the adapter is judged again with its "
        "effect scaled by each of these in turn (its lora_B times the factor: the base may have learnt part of "
        "what the adapter does) and the first that passes serves, as a new version; empty = retire it at once "
        "(comma-separated in the environment)",
    )
    rank: int = _s(8, "LoRA rank r of every adapter", gt=0, le=1024)
    alpha: float = _s(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank", gt=0)
    targets: Annotated[list[str], NoDecode] = _s(
        list(LORA_TARGETS),
        "megatron linears that carry the adapter: linear_qkv, linear_proj, linear_fc1, linear_fc2 of every layer "
        "and the output layer (output_layer, Hugging Face's lm_head: with it an adapter can raise one token without "
        "those whose output rows lie near it; leave it out for an engine that serves no lm_head LoRA); "
        "comma-separated in the environment",
        min_length=1,
    )
    dropout: float = _s(0.0, "dropout on the adapter's input (RL compares log-probs: keep 0)", ge=0, lt=1)
    lr: float = _s(0.0, "AdamW learning rate of an adapter; 0 = train.lr", ge=0)
    updates_per_step: int = _s(
        4,
        "optimizer updates on each step's micro-batches of an adapter run (train.updates_per_step for adapters: an "
        "org's adapter sees a fraction of the traffic, so it reuses each batch); 0 = train.updates_per_step",
        ge=0,
        le=64,
    )
    kl_coef: float = _s(
        0.3,
        "weight of an adapter run's KL term to the base alone (it keeps what the org does not ask for, such as "
        "the broken-call rate, at the base's); 0 = loss.kl_coef",
        ge=0,
    )
    kl_estimator: Literal["", "k3", "full"] = _s(
        "full",
        "an adapter run's KL estimator (loss.kl_estimator's choices): full by default, as k3 on the sampled token "
        "does not see the broken tool calls an adapter's updates make likelier; '' = loss.kl_estimator",
    )
    max_loaded: int = _s(64, "adapters the policy server holds in memory at once (least recently used leave)", gt=0)

    @field_validator("orgs", "targets", "revalidate_scales", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("revalidate_scales")
    @classmethod
    def _scales(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not 0 < x < 1]
        if bad:
            raise ValueError(
                f"holds {bad}: each factor must lie between 0 and 1 (exclusive); fix: e.g. 0.5 or 0.75,0.5"
            )
        return v

    @field_validator("targets")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"names unknown modules {bad}; fix: choose among {list(LORA_TARGETS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"names a module twice: {v}")
        return v

    def wants(self, org: str) -> bool:
        """Whether ``org`` may get an adapter (traffic threshold apart)."""
        return "*" in self.orgs or org in self.orgs


class MetricsSettings(Section):
    port: int = _s(
        0,
        "port of each part's Prometheus endpoint (/metrics, /healthz, /readyz; rtrl.metrics); 0 = none. A "
        "torchrun trainer's rank r serves on port + local rank r",
        ge=0,
        le=65535,
    )
    host: str = _s(
        "127.0.0.1", "address the metrics endpoint listens on; 0.0.0.0 in a container Prometheus scrapes", min_length=1
    )


class ServingSettings(Section):
    url: str = _s(
        "",
        "base URL of the OpenAI-compatible completions server the policy server samples from (vLLM, SGLang), "
        "e.g. http://127.0.0.1:8000/v1; it must serve the promoted version itself; empty = the project's own "
        "server over the policy, in-process on a free loopback port",
    )
    model: str = _s("rtrl-policy", "model name sent with each request (vLLM: --served-model-name)")
    candidate_model: str = _s(
        "rtrl-candidate", "A/B mode (loop.ab_share > 0): the model name under which the server serves the candidate"
    )
    timeout_s: float = _s(30.0, "seconds a completions request may take to connect, and to answer, per try", gt=0)
    retries: int = _s(
        3, "retries of a failed completions request (connection error, timeout, 429, 5xx), with backoff", ge=0
    )
    api_key_file: str = _s(
        "", "file holding the server's API key, sent as a bearer token (vLLM: --api-key); empty = none"
    )
    registry_dir: str = _s(
        "",
        "model registry: each promotion of a Hugging Face model is exported to <registry_dir>/v<N> (safetensors, "
        "config.json, rtrl.json with its content hash), what a fleet loads; empty = <data_dir>/registry",
    )
    reload_api: Literal["sglang", "vllm"] = _s(
        "sglang",
        "weight-reload API of the inference server `rtrl fleet follow` drives: sglang (POST "
        "/update_weights_from_disk; the project's own server too) or vllm (POST /collective_rpc reload_weights, "
        "needs VLLM_SERVER_DEV_MODE=1)",
    )
    reload_url: str = _s(
        "",
        "base URL of that server's reload endpoint, e.g. http://127.0.0.1:30000; empty = serving.url without /v1",
    )
    reload_timeout_s: float = _s(
        600.0, "seconds one weight reload may take, per try (a large model loads for minutes)", gt=0
    )

    @field_validator("url", "reload_url")
    @classmethod
    def _url(cls, v: str, info: ValidationInfo) -> str:
        if not v:
            return v
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 - raises on a port outside 1..65535 or not a number
        except ValueError:
            raise ValueError(f"has a bad port in {redact_dsn(v)!r}: a port is 1..65535") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            form = "http(s)://host:port/v1" if info.field_name == "url" else "http(s)://host:port"
            raise ValueError(f"must be {form}, not {redact_dsn(v)!r}")
        return v


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

    data_dir: str = _s(".rtrl", "folder for local state: broker data, embedded ClickHouse, reports")
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
        current = getattr(getattr(settings, sec), key)
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
