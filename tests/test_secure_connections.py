"""Secure connections to real clusters (issue 18, part 5).

- Kafka TLS and SASL (PLAIN, SCRAM, OAUTHBEARER) settings become librdkafka's security properties in one
  place (:func:`rtrl.kafka.security_config`), travel with the broker address (:class:`rtrl.kafka.KafkaConnection`)
  and reach every Producer, Consumer and AdminClient the project builds: checked on the real client-building
  functions (each client librdkafka is asked to build is recorded, then built for real), and by a guard over
  the code that no client is built any other way.
- Secrets: from the environment or a mounted file only, refused in a settings file, never shown.
- The local broker runs without security.
- TLS end to end: the embedded ClickHouse front over https with a certificate made here, reached through
  :func:`rtrl.clickhouse.connect` with that CA; a wrong CA fails with an error naming the fix.

Not tested end to end here (no broker with TLS or SASL listeners runs on this machine: noida-db speaks
PLAINTEXT only and advertises its own address, so no TLS proxy can sit in front of it): a Kafka TLS
handshake and SASL PLAIN / SCRAM / OAUTHBEARER logins. What is tested is that librdkafka accepts each
configuration (the clients are really built) and that every client carries it.
"""

from __future__ import annotations

import ast
import datetime as dt
import ipaddress
import sys
import uuid
from pathlib import Path

import confluent_kafka
import confluent_kafka.admin
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# the client-building modules, imported before any test records their clients (each binds the real classes)
from app.services import bootstrap_for
from client.fleet import FleetFollower, ReloadClient
from client.sdk import RtrlClient
from flows.kafka_io import kafka_source
from flows.sinks import KafkaSink
from flows.wiring import require_bootstrap
from rtrl import clickhouse
from rtrl.errors import ConfigError, ServiceUnavailable
from rtrl.kafka import (
    KafkaConnection,
    base_config,
    check_broker,
    connection,
    describe_topic,
    ensure_topics,
    ensure_topics_for,
    producer_config,
    read_topic,
    security_config,
)
from rtrl.settings import SECRETS, describe, load_settings
from trainer.data import BatchStream

ROOT = Path(__file__).resolve().parent.parent
SALT = {"RTRL_SDK__SALT": "a-secret-salt-for-tests"}
DEAD = "127.0.0.1:9"  # nothing listens there: clients are built, never connected


# ---------------------------------------------------------------- certificates made here


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def make_pki(folder: Path, name: str = "test") -> dict[str, str]:
    """A CA and a server certificate it signed for 127.0.0.1 and localhost: PEM files under ``folder``."""
    now = dt.datetime.now(dt.UTC)
    ca_key, key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rtrl {name} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    no_pw = serialization.NoEncryption()
    return {
        "ca": _pem(folder / f"{name}-ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
        "cert": _pem(folder / f"{name}-server.pem", cert.public_bytes(serialization.Encoding.PEM)),
        "key": _pem(
            folder / f"{name}-server.key",
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, no_pw),
        ),
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---------------------------------------------------------------- settings -> librdkafka


def kafka_env(pki: dict[str, str], mechanism: str | None, **extra: str) -> dict[str, str]:
    env = SALT | {"RTRL_KAFKA__BOOTSTRAP": DEAD, "RTRL_KAFKA__TIMEOUT_S": "1"}
    if mechanism is None:  # TLS alone, mutual
        return env | {
            "RTRL_KAFKA__SECURITY_PROTOCOL": "SSL",
            "RTRL_KAFKA__SSL_CA_LOCATION": pki["ca"],
            "RTRL_KAFKA__SSL_CERTIFICATE_LOCATION": pki["cert"],
            "RTRL_KAFKA__SSL_KEY_LOCATION": pki["key"],
        }
    env |= {
        "RTRL_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "RTRL_KAFKA__SASL_MECHANISM": mechanism,
        "RTRL_KAFKA__SSL_CA_LOCATION": pki["ca"],
    }
    if mechanism == "OAUTHBEARER":
        return (
            env
            | {
                "RTRL_KAFKA__OAUTH_TOKEN_ENDPOINT_URL": "https://127.0.0.1:9/oauth2/token",
                "RTRL_KAFKA__OAUTH_CLIENT_ID": "rtrl",
                "RTRL_KAFKA__OAUTH_CLIENT_SECRET": "oidc-secret-value",
                "RTRL_KAFKA__OAUTH_SCOPE": "kafka",
            }
            | extra
        )
    return env | {"RTRL_KAFKA__SASL_USERNAME": "rtrl", "RTRL_KAFKA__SASL_PASSWORD": "sasl-secret-value"} | extra


EXPECTED = {
    None: {
        "security.protocol": "SSL",
        "ssl.ca.location": "ca",
        "ssl.certificate.location": "cert",
        "ssl.key.location": "key",
        "ssl.endpoint.identification.algorithm": "https",
    },
    "PLAIN": {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "rtrl",
        "sasl.password": "sasl-secret-value",
        "ssl.ca.location": "ca",
        "ssl.endpoint.identification.algorithm": "https",
    },
    "OAUTHBEARER": {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "OAUTHBEARER",
        "sasl.oauthbearer.method": "oidc",
        "sasl.oauthbearer.token.endpoint.url": "https://127.0.0.1:9/oauth2/token",
        "sasl.oauthbearer.client.id": "rtrl",
        "sasl.oauthbearer.client.secret": "oidc-secret-value",
        "sasl.oauthbearer.scope": "kafka",
        "ssl.ca.location": "ca",
        "ssl.endpoint.identification.algorithm": "https",
    },
}
EXPECTED["SCRAM-SHA-256"] = EXPECTED["PLAIN"] | {"sasl.mechanism": "SCRAM-SHA-256"}
EXPECTED["SCRAM-SHA-512"] = EXPECTED["PLAIN"] | {"sasl.mechanism": "SCRAM-SHA-512"}


def expected(pki: dict[str, str], mechanism: str | None) -> dict[str, str]:
    return {k: pki.get(v, v) if k.endswith("location") else v for k, v in EXPECTED[mechanism].items()}


@pytest.fixture
def built(monkeypatch) -> list[tuple[str, dict]]:
    """Every Kafka client the code under test builds, as (kind, config): each is recorded, then built for
    real by confluent-kafka (librdkafka refuses an unknown or inconsistent property right there)."""
    seen: list[tuple[str, dict]] = []

    def recording(real: type) -> type:
        def __init__(self, *args, **kwargs):
            seen.append((real.__name__, dict(args[0]) if args else dict(kwargs)))
            real.__init__(self, *args, **kwargs)

        return type(f"Recorded{real.__name__}", (real,), {"__init__": __init__})

    reals = {
        c: recording(c) for c in (confluent_kafka.Producer, confluent_kafka.Consumer, confluent_kafka.admin.AdminClient)
    }
    for mod in list(sys.modules.values()):  # every module that imported a client class under any name
        if mod is confluent_kafka.admin:  # AdminClient's own module: its super(AdminClient, ...) must stay real
            continue
        for attr, value in list(getattr(mod, "__dict__", {}).items()):
            if isinstance(value, type) and value in reals:
                monkeypatch.setattr(mod, attr, reals[value])
    return seen


def carries(cfg: dict, security: dict) -> bool:
    return all(cfg.get(k) == v for k, v in security.items())


@pytest.mark.parametrize("mechanism", [None, "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"])
@pytest.mark.slow
def test_settings_become_the_security_of_every_client_built_from_them(pki, built, mechanism):
    """Each mechanism's settings map to librdkafka's properties, which librdkafka accepts for a producer,
    consumer and admin client; the entry points (SDK, flows, topics, the services' broker check) carry them."""
    settings = load_settings(env=kafka_env(pki, mechanism))
    want = expected(pki, mechanism)
    assert security_config(settings.kafka) == want
    conn = connection(settings.kafka)
    assert conn == DEAD and conn.security == want and "secret-value" not in repr(conn) + str(conn)

    with RtrlClient.from_settings(settings):  # the SDK: its producer
        pass
    KafkaSink(require_bootstrap(settings, None)).build_part("s", "p", None).close()  # the flows' sink
    consumer = confluent_kafka.Consumer(base_config(conn) | {"group.id": "g"})  # accepted by a consumer too
    consumer.close()
    with pytest.raises(ServiceUnavailable, match="check kafka.security_protocol"):  # the services' broker check
        bootstrap_for(settings)
    with pytest.raises(ServiceUnavailable):  # a plain address handed in still gets the settings' security
        ensure_topics_for(settings, DEAD)
    kinds = {kind for kind, _ in built}
    assert kinds == {"Producer", "Consumer", "AdminClient"} and len(built) >= 5
    assert all(carries(cfg, want) for _, cfg in built), [cfg for _, cfg in built if not carries(cfg, want)]


def test_sdk_takes_security_without_settings(pki, built):
    """A product backend that does not use rtrl's settings passes librdkafka's properties itself."""
    sec = {"security.protocol": "SSL", "ssl.ca.location": pki["ca"]}
    with RtrlClient(DEAD, salt="a-secret-salt", security=sec):
        pass
    assert [kind for kind, _ in built] == ["Producer"] and carries(built[0][1], sec)


def test_every_client_on_a_real_broker_carries_the_connections_security(broker, topic_prefix, built):
    """Against the real (PLAINTEXT) broker: every client-building function of the project, given a
    KafkaConnection, builds every client with its security properties. The marker properties here are ones
    librdkafka accepts and ignores under PLAINTEXT, so each function really runs its course."""
    marker = {"sasl.mechanism": "PLAIN", "sasl.username": f"marker-{uuid.uuid4().hex[:6]}", "sasl.password": "x"}
    conn = KafkaConnection(broker.bootstrap, {"security.protocol": "PLAINTEXT"} | marker)
    check_broker(conn)
    ensure_topics(conn, topic_prefix, 2)
    topic = topic_prefix + "batches"
    describe_topic(conn, topic)
    list(read_topic(conn, topic, timeout_s=10))
    stream = BatchStream(conn, topic, topic_prefix + "dead_letters", timeout_s=10)  # the trainer's input
    stream.consumer.close()
    source = kafka_source(conn, [topic], timeout_s=10)  # the flows' source: its partition lister and consumers
    part = source.build_part("s", source.list_parts()[0], None)
    part.close()
    KafkaSink(conn).build_part("s", "p", None).close()
    with RtrlClient(conn, salt="a-secret-salt", topic=topic):
        pass
    follower = FleetFollower(conn, topic_prefix + "deployments", ReloadClient("http://127.0.0.1:9"))
    follower.consumer.close()
    assert {kind for kind, _ in built} == {"Producer", "Consumer", "AdminClient"} and len(built) >= 10
    assert all(carries(cfg, marker) for _, cfg in built), [cfg for _, cfg in built if not carries(cfg, marker)]


# ---------------------------------------------------------------- the guard: no client built another way

CODE = (
    "rtrl",
    "flows",
    "trainer",
    "client",
    "app",
    "simulator",
    "bench",
    "examples",
    "monitors",
    "evalgate",
    "rewards",
)
CLIENTS = {"Producer", "Consumer", "AdminClient"}
BUILDERS = {"base_config", "producer_config"}


def _sources():
    for top in CODE:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _calls_builder(node: ast.AST, derived: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in BUILDERS:
                return True
        if isinstance(n, ast.Name) and n.id in derived:
            return True
    return False


def _violations(rel: str, tree: ast.Module) -> list[str]:
    """Where the code at ``rel`` builds a Kafka client or reads the broker address around the one builder."""
    bad: list[str] = []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module)]:
        derived: set[str] = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and _calls_builder(n.value, derived):
                derived |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
            if name in CLIENTS and not (n.args and _calls_builder(n.args[0], derived)):
                bad.append(f"{rel}:{n.lineno}: {name}(...) not built from base_config/producer_config")
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and n.value == "bootstrap.servers" and rel != "rtrl/kafka.py":
            up: ast.AST = n
            while up in parents and not isinstance(up, ast.FunctionDef):
                up = parents[up]
            if not (rel == "flows/kafka_io.py" and getattr(up, "name", "") == "build_part"):  # + _add_config
                bad.append(f"{rel}:{n.lineno}: names the brokers itself ('bootstrap.servers')")
        if (
            isinstance(n, ast.Attribute)
            and n.attr == "bootstrap"
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "kafka"
            and rel not in ("rtrl/kafka.py", "rtrl/settings.py")
        ):
            parent = parents.get(n)
            truth = isinstance(parent, ast.UnaryOp | ast.BoolOp) or (
                isinstance(parent, ast.If | ast.IfExp | ast.While) and parent.test is n
            )
            if not truth:
                bad.append(f"{rel}:{n.lineno}: reads kafka.bootstrap as an address; use rtrl.kafka.connection")
        if isinstance(n, ast.ImportFrom) and n.module == "bytewax.connectors.kafka" and rel != "flows/kafka_io.py":
            bad.append(f"{rel}:{n.lineno}: Bytewax's Kafka connectors outside flows/kafka_io.py")
    return sorted(set(bad))  # a call inside a function is seen from the module too


@pytest.mark.slow
def test_no_kafka_client_is_built_without_the_one_config_builder():
    """Every Producer/Consumer/AdminClient call in the project's code gets a config made by base_config or
    producer_config (directly or through a variable assigned from one in the same function); no config
    names the brokers itself; nothing reads kafka.bootstrap as an address except through rtrl.kafka.connection;
    Bytewax's own Kafka connectors are used only through flows.kafka_io (which passes the security on)."""
    bad = [line for rel, tree in _sources() for line in _violations(rel, tree)]
    assert not bad, "\n".join(bad)


def test_the_guard_catches_each_way_around_the_builder():
    code = """
from confluent_kafka import Producer
from bytewax.connectors.kafka import KafkaSink
def ok(b):
    cfg = producer_config(b) | {"linger.ms": 1}
    return Producer(cfg), Consumer(base_config(b) | {"group.id": "g"})
def bypass(settings):
    a = Producer({"bootstrap.servers": settings.kafka.bootstrap})
    cfg = {"acks": "all"}
    return a, AdminClient(cfg), Consumer(**{"group.id": "g"}), (settings.kafka.bootstrap if settings.kafka.bootstrap else 0)
"""
    found = _violations("app/x.py", ast.parse(code))
    lines = sorted({int(line.split(":")[1]) for line in found})
    assert lines == [3, 8, 10], found
    assert sum("kafka.bootstrap" in line for line in found) == 2 and sum("(...)" in line for line in found) == 3


def test_base_config_adds_a_connections_security_and_nothing_to_a_plain_address():
    sec = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "pw-4"}
    conn = KafkaConnection("k1:9093,k2:9093", sec)
    assert base_config(conn)["bootstrap.servers"] == "k1:9093,k2:9093" and carries(base_config(conn), sec)
    assert carries(producer_config(conn, "zstd", **{"linger.ms": 1}), sec)
    assert "security.protocol" not in base_config("127.0.0.1:9092")
    assert f"at {conn}:" == "at k1:9093,k2:9093:" and "pw-4" not in repr(conn) and "SASL_SSL" in repr(conn)
    import pickle

    again = pickle.loads(pickle.dumps(conn))
    assert isinstance(again, KafkaConnection) and again == conn and again.security == sec


# ---------------------------------------------------------------- validation, secrets


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RTRL_KAFKA__SECURITY_PROTOCOL": "SASL_SSL"}, "needs kafka.sasl_mechanism; fix: set it"),
        (
            {"RTRL_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "RTRL_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512"},
            "needs kafka.sasl_username, kafka.sasl_password; fix: set RTRL_KAFKA__SASL_USERNAME",
        ),
        (
            {"RTRL_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "RTRL_KAFKA__SASL_MECHANISM": "OAUTHBEARER"},
            "needs kafka.oauth_token_endpoint_url, kafka.oauth_client_id, kafka.oauth_client_secret",
        ),
        ({"RTRL_KAFKA__SASL_USERNAME": "u"}, "kafka.sasl_username set but not used with kafka.security_protocol"),
        ({"RTRL_KAFKA__SSL_CA_LOCATION": "/ca.pem"}, "kafka.ssl_ca_location set but not used"),
        (
            {"RTRL_KAFKA__SECURITY_PROTOCOL": "SSL", "RTRL_KAFKA__SSL_KEY_LOCATION": "/k.pem"},
            "ssl_certificate_location and kafka.ssl_key_location go together",
        ),
        ({"RTRL_CLICKHOUSE__CA_CERT": "/ca.pem"}, "clickhouse.ca_cert set but clickhouse.dsn is not https://"),
        (
            {"RTRL_CLICKHOUSE__DSN": "https://u:pw@ch:8443", "RTRL_CLICKHOUSE__PASSWORD": "other"},
            "clickhouse.dsn carries a password and clickhouse.password",
        ),
        (
            {"RTRL_CLICKHOUSE__PASSWORD": "a", "RTRL_CLICKHOUSE__PASSWORD_FILE": "/f"},
            "clickhouse.password and clickhouse.password_file are both set",
        ),
    ],
)
def test_inconsistent_security_settings_are_refused_naming_the_fix(env, message):
    with pytest.raises(ConfigError, match="fix: " if "fix" not in message else None) as e:
        load_settings(env=SALT | {"RTRL_KAFKA__BOOTSTRAP": "k:9093"} | env)
    assert message in str(e.value)


def test_a_missing_tls_file_is_named_when_the_clients_are_built(tmp_path):
    s = load_settings(
        env=SALT
        | {
            "RTRL_KAFKA__BOOTSTRAP": "k:9093",
            "RTRL_KAFKA__SECURITY_PROTOCOL": "SSL",
            "RTRL_KAFKA__SSL_CA_LOCATION": str(tmp_path / "nope.pem"),
        }
    )
    with pytest.raises(ConfigError, match=r"kafka.ssl_ca_location = .*nope.pem' is not a readable file; fix: point"):
        connection(s.kafka)


def test_the_local_broker_runs_without_security(broker):
    """With kafka.bootstrap empty rtrl starts the local PLAINTEXT broker: security settings are refused then,
    and the default settings' clients reach the local broker with no security property at all."""
    with pytest.raises(ConfigError, match="kafka.bootstrap is empty: rtrl then starts the dev-only local broker"):
        load_settings(env={"RTRL_KAFKA__SECURITY_PROTOCOL": "SSL"})
    conn = connection(load_settings(env={}).kafka, broker.bootstrap)
    assert conn.security == {} and not any(k.startswith(("security", "sasl", "ssl")) for k in base_config(conn))
    assert check_broker(conn, 10).brokers


SECRET_ENV = {
    "kafka.sasl_password": "RTRL_KAFKA__SASL_PASSWORD",
    "kafka.oauth_client_secret": "RTRL_KAFKA__OAUTH_CLIENT_SECRET",
    "kafka.ssl_key_password": "RTRL_KAFKA__SSL_KEY_PASSWORD",
    "clickhouse.password": "RTRL_CLICKHOUSE__PASSWORD",
    "sdk.salt": "RTRL_SDK__SALT",
}


def test_every_secret_is_listed():
    assert set(SECRETS) == set(SECRET_ENV)


@pytest.mark.parametrize("name", list(SECRET_ENV))
def test_a_secret_in_a_settings_file_is_refused(tmp_path, name):
    sec, _, key = name.partition(".")
    f = tmp_path / "rtrl.toml"
    f.write_text(f'[{sec}]\n{key} = "hunter2-hunter2"\n')
    with pytest.raises(ConfigError) as e:
        load_settings(f, env={})
    text = str(e.value)
    assert f"setting {name} is a secret but is written in the config file" in text and "hunter2" not in text
    assert f"fix: remove it from the file and give it with {SECRET_ENV[name]}" in text and "_FILE" in text


def test_a_dsn_password_in_a_settings_file_is_refused(tmp_path):
    f = tmp_path / "rtrl.toml"
    f.write_text('[clickhouse]\ndsn = "https://rtrl:hunter2@ch:8443"\n')
    with pytest.raises(ConfigError, match=r"carries a password; fix: remove it from the DSN") as e:
        load_settings(f, env=SALT)
    assert "hunter2" not in str(e.value)


def test_secrets_come_from_the_environment_or_a_mounted_file_and_are_never_shown(pki, tmp_path, capsys):
    secret_file = tmp_path / "sasl-password"  # what a Kubernetes Secret mounted as a volume looks like
    secret_file.write_text("from-a-file-secret\n")
    env = kafka_env(pki, "SCRAM-SHA-256")
    del env["RTRL_KAFKA__SASL_PASSWORD"]
    s = load_settings(env=env | {"RTRL_KAFKA__SASL_PASSWORD_FILE": str(secret_file)})
    assert s.kafka.sasl_password == "from-a-file-secret"
    assert security_config(s.kafka)["sasl.password"] == "from-a-file-secret"
    with pytest.raises(ConfigError, match="both RTRL_KAFKA__SASL_PASSWORD and RTRL_KAFKA__SASL_PASSWORD_FILE"):
        load_settings(env=env | {"RTRL_KAFKA__SASL_PASSWORD": "x", "RTRL_KAFKA__SASL_PASSWORD_FILE": str(secret_file)})
    with pytest.raises(ConfigError, match="RTRL_KAFKA__SASL_PASSWORD_FILE = .* cannot be read"):
        load_settings(env=env | {"RTRL_KAFKA__SASL_PASSWORD_FILE": str(tmp_path / "missing")})

    oauth = load_settings(env=kafka_env(pki, "OAUTHBEARER"))
    ch = load_settings(
        env=SALT | {"RTRL_CLICKHOUSE__DSN": "https://ch.internal:8443", "RTRL_CLICKHOUSE__PASSWORD": "ch-secret-value"}
    )
    shown = (
        {n: v for n, v, _ in describe(s)} | {n: v for n, v, _ in describe(oauth)} | {n: v for n, v, _ in describe(ch)}
    )
    assert all(shown[name] == "***" for name in SECRETS)
    for settings in (s, oauth, ch):
        text = repr(settings).replace("secret_scanner='detect-secrets'", "")  # the scanner's name is no secret
        assert "secret" not in text.replace("client_secret", "").replace("_secret", "")
    assert "ch-secret-value" not in clickhouse.redact(ch.clickhouse_dsn)

    from app.cli import main

    monkey_env = env | {"RTRL_KAFKA__SASL_PASSWORD_FILE": str(secret_file)}
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in __import__("os").environ if k.startswith("RTRL_")]:
            mp.delenv(k)
        for k, v in monkey_env.items():
            mp.setenv(k, v)
        assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "from-a-file-secret" not in out and "a-secret-salt" not in out and "SCRAM-SHA-256" in out


# ---------------------------------------------------------------- ClickHouse over TLS, end to end


@pytest.fixture(scope="module")
def tls_front(pki, tmp_path_factory):
    """The embedded ClickHouse front serving https with the certificate made here (its own process)."""
    from devservices.chserver import spawn

    proc, dsn = spawn(
        tmp_path_factory.mktemp("ch-tls") / "ch", extra_args=["--certfile", pki["cert"], "--keyfile", pki["key"]]
    )
    yield dsn
    proc.terminate()
    proc.wait(30)


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")  # verify=false, on purpose
@pytest.mark.slow
def test_clickhouse_over_tls_with_a_certificate_made_here(tls_front, pki, tmp_path):
    assert tls_front.startswith("https://rtrl_writer@127.0.0.1:")
    settings = load_settings(env={"RTRL_CLICKHOUSE__DSN": tls_front, "RTRL_CLICKHOUSE__CA_CERT": pki["ca"]})
    client = clickhouse.connect(settings.clickhouse_dsn, timeout_s=10)  # the route every rtrl client takes
    assert client.command("SELECT 40 + 2") == 42
    assert client.query("SELECT number * 2 FROM system.numbers LIMIT 3").result_rows == [(0,), (2,), (4,)]

    wrong = make_pki(tmp_path, "other")  # a CA that did not sign the server's certificate
    bad = load_settings(env={"RTRL_CLICKHOUSE__DSN": tls_front, "RTRL_CLICKHOUSE__CA_CERT": wrong["ca"]})
    with pytest.raises(ConfigError, match="presented a certificate that does not verify .*fix: set clickhouse.ca_cert"):
        clickhouse.connect(bad.clickhouse_dsn, timeout_s=10)
    system_cas = load_settings(env={"RTRL_CLICKHOUSE__DSN": tls_front})  # no ca_cert: the system's CAs refuse it
    with pytest.raises(ConfigError, match="does not verify"):
        clickhouse.connect(system_cas.clickhouse_dsn, timeout_s=10)

    unchecked = load_settings(env={"RTRL_CLICKHOUSE__DSN": tls_front, "RTRL_CLICKHOUSE__VERIFY": "false"})
    assert clickhouse.connect(unchecked.clickhouse_dsn, timeout_s=10).command("SELECT 1") == 1

    plain = tls_front.replace("https://", "http://", 1)  # plain http to a TLS port: not answered
    with pytest.raises(ServiceUnavailable, match="did not answer"):
        clickhouse.connect(plain, timeout_s=3)
    with pytest.raises(ConfigError, match="is not a readable file; fix: point clickhouse.ca_cert"):
        clickhouse.connect(
            load_settings(
                env={"RTRL_CLICKHOUSE__DSN": tls_front, "RTRL_CLICKHOUSE__CA_CERT": str(tmp_path / "x.pem")}
            ).clickhouse_dsn
        )


def test_clickhouse_user_and_password_reach_the_client(tls_front, pki):
    """clickhouse.user and clickhouse.password (from the environment) log in; a wrong password is refused
    naming the settings; neither is ever shown."""
    plain_dsn, token = clickhouse.split_password_file(tls_front)
    bare = plain_dsn.replace("rtrl_writer@", "").split("?")[0]
    env = {"RTRL_CLICKHOUSE__DSN": bare, "RTRL_CLICKHOUSE__CA_CERT": pki["ca"], "RTRL_CLICKHOUSE__USER": "rtrl_writer"}
    s = load_settings(env=env | {"RTRL_CLICKHOUSE__PASSWORD": token or ""})
    assert clickhouse.connect(s.clickhouse_dsn, timeout_s=10).command("SELECT 7") == 7
    assert (token or "") not in clickhouse.redact(s.clickhouse_dsn) and (token or "x") not in repr(s)
    wrong = load_settings(env=env | {"RTRL_CLICKHOUSE__PASSWORD": "not-the-token"})
    with pytest.raises(ConfigError, match="refused the credentials"):
        clickhouse.connect(wrong.clickhouse_dsn, timeout_s=10)


@pytest.mark.slow
def test_rtrl_clickhouse_serve_over_tls(pki, tmp_path):
    """`rtrl clickhouse serve --certfile --keyfile` serves the embedded folder over https, which rtrl's own
    /ping reaches with the test CA (and plain http does not)."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "app.cli", "clickhouse", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--certfile", pki["cert"], "--keyfile", pki["key"]],
        env={**__import__("os").environ, "RTRL_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        dsn = f"https://127.0.0.1:{port}/?ca_cert={pki['ca']}"
        deadline = time.monotonic() + 60
        while True:
            try:
                clickhouse.ping(dsn, 2)
                break
            except ServiceUnavailable:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
        with pytest.raises(ServiceUnavailable):
            clickhouse.ping(f"http://127.0.0.1:{port}/", 2)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"https://rtrl_writer@127.0.0.1:{port}/" in out
