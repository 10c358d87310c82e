"""The foundation's sections: Kafka, ClickHouse and the metrics endpoint (:mod:`rtrl.kafka`,
:mod:`rtrl.clickhouse`, :mod:`rtrl.metrics`)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import field_validator, model_validator

from rtrl.errors import ConfigError
from rtrl.section import Section, redact_dsn, setting

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
    bootstrap: str = setting("", "host:port list of the Kafka brokers; empty = start a local noida-db broker")
    topic_prefix: str = setting("rtrl.", "prefix of every topic name (rtrl.events, ...)", pattern=r"^[A-Za-z0-9._-]+$")
    partitions: int = setting(4, "partitions of the keyed data topics when rtrl creates them", gt=0)
    replication_factor: int = setting(
        1, "replicas of every topic rtrl creates (production: 3); existing topics are checked against it", gt=0
    )
    min_insync_replicas: int = setting(
        1,
        "min.insync.replicas of every topic rtrl creates (production: 2): with "
        "acks=all a write needs this many replicas",
        gt=0,
    )
    timeout_s: float = setting(10.0, "seconds to wait for the broker before reporting it unreachable", gt=0)
    idle_backoff_s: float = setting(
        0.1,
        "how long a flow's reader of an empty partition pauses before fetching again "
        "(extra latency after a quiet spell)",
        gt=0,
    )
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = setting(
        "zstd", "codec of every rtrl producer (none, gzip, snappy, lz4, zstd); JSON batches shrink several-fold"
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = setting(
        "PLAINTEXT",
        "how every Kafka client reaches the brokers: PLAINTEXT (the local broker), SSL (TLS), SASL_PLAINTEXT "
        "or SASL_SSL (SASL login, over TLS with SASL_SSL); librdkafka's security.protocol",
    )
    sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] = setting(
        "",
        "SASL mechanism with a SASL_* security_protocol: PLAIN or SCRAM-SHA-256/512 (sasl_username, "
        "sasl_password) or OAUTHBEARER (an OIDC client-credentials token: oauth_* settings)",
    )
    sasl_username: str = setting("", "SASL user of PLAIN / SCRAM-SHA-*")
    sasl_password: str = setting(
        "", "SASL password of PLAIN / SCRAM-SHA-*: a secret, from RTRL_KAFKA__SASL_PASSWORD(_FILE) only", repr=False
    )
    oauth_token_endpoint_url: str = setting(
        "", "OAUTHBEARER: the OIDC token endpoint (https://...) the client-credentials token is fetched from"
    )
    oauth_client_id: str = setting("", "OAUTHBEARER: the OIDC client id")
    oauth_client_secret: str = setting(
        "",
        "OAUTHBEARER: the OIDC client secret: a secret, from RTRL_KAFKA__OAUTH_CLIENT_SECRET(_FILE) only",
        repr=False,
    )
    oauth_scope: str = setting("", "OAUTHBEARER: the scope asked for (space-separated); empty = the provider's default")
    ssl_ca_location: str = setting(
        "", "SSL / SASL_SSL: PEM file of the CA(s) that signed the brokers' certificates; empty = the system's CAs"
    )
    ssl_certificate_location: str = setting(
        "", "SSL / SASL_SSL: PEM file of this client's certificate (mutual TLS; with ssl_key_location)"
    )
    ssl_key_location: str = setting("", "SSL / SASL_SSL: PEM file of this client's private key (mutual TLS)")
    ssl_key_password: str = setting(
        "",
        "password of an encrypted ssl_key_location: a secret, from RTRL_KAFKA__SSL_KEY_PASSWORD(_FILE) only",
        repr=False,
    )
    ssl_endpoint_identification: Literal["https", "none"] = setting(
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
    dsn: str = setting("", "ClickHouse DSN; empty = embedded chdb:///<data_dir>/clickhouse")
    database: str = setting("rtrl", "database holding rtrl's tables", pattern=r"^[A-Za-z0-9_]+$")
    timeout_s: float = setting(10.0, "seconds to wait for a ClickHouse server before reporting it unreachable", gt=0)
    password_file: str = setting(
        "",
        "file holding the password of the DSN's user, read when connecting (the DSN and environment then carry "
        "no secret; same as a password_file=PATH parameter in the DSN); empty = the DSN's own",
    )
    user: str = setting("", "user rtrl logs in as on an http(s) server; empty = the DSN's own (else `default`)")
    password: str = setting(
        "",
        "that user's password: a secret, from RTRL_CLICKHOUSE__PASSWORD only (or, as a file, "
        "clickhouse.password_file); empty = password_file's, else the DSN's own",
        repr=False,
    )
    ca_cert: str = setting(
        "",
        "https DSN: PEM file of the CA(s) that signed the server's certificate, or 'certifi' (Mozilla's "
        "bundle); empty = the system's CAs",
    )
    verify: bool = setting(
        True, "https DSN: check the server's certificate and host name (false only for a throwaway test server)"
    )
    client_cert: str = setting("", "https DSN: PEM file of this client's certificate (mutual TLS)")
    client_cert_key: str = setting("", "https DSN: PEM file of client_cert's private key, if not in client_cert")
    cluster: str = setting(
        "",
        "name of the ClickHouse cluster (the servers' <remote_servers>) to lay rtrl's tables out on: `rtrl migrate` "
        "then runs every DDL ON CLUSTER, makes each table a Replicated*MergeTree <table>_local on every node and a "
        "Distributed table <table> over it (what rtrl reads and writes); `rtrl migrate --print` shows the DDL; "
        "empty = a single node",
    )
    replica_path: str = setting(
        "/clickhouse/tables/{shard}/{database}/{table}",
        "with clickhouse.cluster: Keeper path of each replicated table; {shard} is each server's macro, "
        "{database} and {table} ClickHouse fills in",
    )
    replica_name: str = setting(
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


class MetricsSettings(Section):
    port: int = setting(
        0,
        "port of each part's Prometheus endpoint (/metrics, /healthz, /readyz; rtrl.metrics); 0 = none. A "
        "torchrun trainer's rank r serves on port + local rank r",
        ge=0,
        le=65535,
    )
    host: str = setting(
        "127.0.0.1", "address the metrics endpoint listens on; 0.0.0.0 in a container Prometheus scrapes", min_length=1
    )
