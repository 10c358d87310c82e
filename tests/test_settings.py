"""One settings tree: defaults, file + environment overrides, errors that name the setting and the fix,
redacted secrets, and settings the loop must fix refused rather than changed."""

from __future__ import annotations

import pytest

from rtrl.settings import ConfigError, Settings, as_env, describe, load_settings


def test_defaults_are_valid_and_embedded():
    """With no file and no environment the settings use the local broker and embedded chdb."""
    s = load_settings(env={})
    assert s.kafka.bootstrap == ""
    assert s.clickhouse_dsn.startswith("chdb://")
    assert s.topic("events") == "rtrl.events"


def test_file_then_environment_override(tmp_path):
    """The environment wins over the file, which wins over the defaults; values are typed."""
    f = tmp_path / "rtrl.toml"
    f.write_text('data_dir = "/tmp/x"\n[kafka]\nbootstrap = "localhost:1"\npartitions = 8\n[sdk]\nqueue_size = 10\n')
    s = load_settings(f, env={"RTRL_KAFKA__PARTITIONS": "3", "RTRL_SIMULATOR__DUPLICATE_RATE": "0.5"})
    assert (s.data_dir, s.kafka.bootstrap, s.kafka.partitions, s.sdk.queue_size) == ("/tmp/x", "localhost:1", 3, 10)
    assert s.simulator.duplicate_rate == 0.5


def test_config_file_from_environment(tmp_path):
    """RTRL_CONFIG points at the file when no path is given."""
    f = tmp_path / "c.toml"
    f.write_text("[simulator]\nseed = 42\n")
    assert load_settings(env={"RTRL_CONFIG": str(f)}).simulator.seed == 42


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[kafka]\nbootstrapp = 'x:1'\n", "unknown setting 'kafka.bootstrapp'.*did you mean 'kafka.bootstrap'"),
        ("[kafkaa]\nbootstrap = 'x:1'\n", "unknown setting 'kafkaa'.*did you mean 'kafka'"),
        ("[kafka]\npartitions = 'many'\n", "kafka.partitions = 'many' is not a valid int"),
        ("[kafka]\npartitions = 0\n", "kafka.partitions = 0 must be > 0.*RTRL_KAFKA__PARTITIONS"),
        ("[kafka]\nbootstrap = 'nohostport'\n", "kafka.bootstrap.*host:port"),
        ("[kafka]\ncompression = 'zip'\n", "kafka.compression = 'zip' must be one of 'none', 'gzip'"),
        ("[kafka]\nreplication_factor = 1\nmin_insync_replicas = 2\n", "kafka.min_insync_replicas = 2 exceeds"),
        ("[precision]\nfp8 = 'hybrid'\n", "precision.fp8 = 'hybrid' needs precision.bf16 = true"),
        ("[precision]\nfp8 = 'e5m2'\n", "precision.fp8 = 'e5m2' must be one of '', 'hybrid' or 'e4m3'"),
        ("[model]\nnormalization = 'BatchNorm'\n", "model.normalization.*'LayerNorm' or 'RMSNorm'"),
        ("[rewards]\nversions = ['v2']\ntrain_version = 'v1-discard-broken'\n", "rewards.train_version.*not among"),
        ("[train]\ngrad_clip = -1\n", "train.grad_clip = -1 must be >= 0.*RTRL_TRAIN__GRAD_CLIP"),
        ("[batches]\nrows = 2\n", "unknown setting 'batches'.*did you mean 'batching'"),
        ("[clickhouse]\ndsn = 'mysql://db'\n", "clickhouse.dsn.*chdb://"),
        ("[simulator]\nduplicate_rate = 2.0\n", "simulator.duplicate_rate = 2.0 must be <= 1"),
        ("[sdk]\nsalt = 'short'\n", "sdk.salt is a secret but is written in the config file.*RTRL_SDK__SALT"),
        ("[kafka\n", "not valid TOML"),
    ],
)
def test_bad_file_settings_name_the_setting(tmp_path, text, expected):
    """Unknown keys, wrong types and out-of-range values raise ConfigError naming the setting."""
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_settings(f, env={})


def test_bad_environment_variables_name_the_variable():
    """A misspelt or mistyped RTRL_* variable is reported with the variable's name."""
    with pytest.raises(ConfigError, match="RTRL_KAFKA__TIMEOUT.*did you mean 'kafka.timeout_s'"):
        load_settings(env={"RTRL_KAFKA__TIMEOUT": "3"})
    with pytest.raises(ConfigError, match="from environment variable RTRL_SDK__QUEUE_SIZE"):
        load_settings(env={"RTRL_SDK__QUEUE_SIZE": "lots"})


def test_missing_config_file_is_reported(tmp_path):
    """A config path that does not exist is an error, not silently ignored."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", env={})


def test_every_setting_is_described():
    """Each setting has help text (shown by `rtrl config`)."""
    rows = describe()
    assert len(rows) > 100
    assert all(help_text for _, _, help_text in rows)


def test_one_section_per_component():
    """The tree has a section for every component the issue names, and nothing configures a component
    outside it."""
    from rtrl.settings import SECTIONS

    assert set(SECTIONS) == {
        "kafka",
        "clickhouse",
        "sdk",
        "flow",
        "rewards",
        "backfill",
        "batching",
        "loss",
        "train",
        "model",
        "parallel",
        "precision",
        "loop",
        "simulator",
        "serving",
        "adapters",
        "metrics",
        "governance",
        "retention",
    }


def test_secrets_are_redacted_when_shown():
    """The salt and a DSN's password never appear in `rtrl config`, in repr, or in an error message."""
    s = load_settings(env={"RTRL_SDK__SALT": "top-secret-salt", "RTRL_CLICKHOUSE__DSN": "https://rtrl:hunter2@ch:8443"})
    shown = {name: value for name, value, _ in describe(s)}
    assert shown["sdk.salt"] == "***" and shown["clickhouse.dsn"] == "https://rtrl:***@ch:8443"
    assert "top-secret-salt" not in repr(s) and "hunter2" not in repr(s)
    assert s.sdk.salt == "top-secret-salt" and s.clickhouse.dsn.endswith("hunter2@ch:8443")  # usable, just not shown
    with pytest.raises(ConfigError) as e:
        load_settings(env={"RTRL_SDK__SALT": "short"})
    assert "short" not in str(e.value) and "sdk.salt = '***'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_settings(env={"RTRL_CLICKHOUSE__DSN": "mysql://u:hunter2@db"})
    assert "hunter2" not in str(e.value)


def test_settings_travel_to_child_processes_unchanged():
    """as_env (how the supervisor hands settings to its parts) round-trips every value, lists included."""
    s = load_settings(
        env={
            "RTRL_REWARDS__VERSIONS": "v2, v1-discard-broken",
            "RTRL_TRAIN__LR": "3e-4",
            "RTRL_MODEL__ACTIVATION": "swiglu",
            "RTRL_LOOP__PROCESSES": "true",
        }
    )
    assert s.rewards.versions == ["v2", "v1-discard-broken"]
    assert load_settings(env=as_env(s)) == s


def test_updated_copies_are_validated(monkeypatch):
    """A copy is the settings plus the changes - the environment (read when they were loaded) does not
    override the changes: a supervised part's --to-end must win over the RTRL_FLOW__TAIL it inherited."""
    monkeypatch.setenv("RTRL_FLOW__TAIL", "true")
    assert load_settings().updated({"flow.tail": False}).flow.tail is False
    s = load_settings(env={})
    assert s.updated({"kafka.bootstrap": "localhost:1"}).kafka.bootstrap == "localhost:1" and s.kafka.bootstrap == ""
    with pytest.raises(ConfigError, match="kafka.partitions = 0 must be > 0"):
        s.updated({"kafka.partitions": 0})
    with pytest.raises(ConfigError, match="unknown setting 'kafka.partition'"):
        s.updated({"kafka.partition": 2})


def test_the_loop_refuses_settings_it_would_have_to_change():
    """The loop fits flows and trainer to its tiny tasks; a user value that differs is an error that says
    why, never silently replaced. Unset (or equal) values are applied."""
    from app.loop_config import LOOP_FIXED, loop_settings

    fitted = loop_settings(load_settings(env={}))
    for name, (value, _why) in LOOP_FIXED.items():
        sec, _, key = name.partition(".")
        assert getattr(getattr(fitted, sec), key) == value
    with pytest.raises(
        ConfigError,
        match="batching.rows = 4 cannot be used by the closed loop.*micro-batches of the "
        "loop's tiny tasks.*RTRL_BATCHING__ROWS",
    ):
        loop_settings(load_settings(env={"RTRL_BATCHING__ROWS": "4"}))
    with pytest.raises(ConfigError, match="train.micro_batches_per_step = 2 cannot be used"):
        loop_settings(load_settings(env={"RTRL_TRAIN__MICRO_BATCHES_PER_STEP": "2"}))
    with pytest.raises(ConfigError, match="train.steps = 7 is not used by the closed loop.*samples trigger"):
        loop_settings(load_settings(env={"RTRL_TRAIN__STEPS": "7"}))
    with pytest.raises(ConfigError, match="parallel.tp = 2 cannot be used by the closed loop"):
        loop_settings(load_settings(env={"RTRL_PARALLEL__TP": "2"}))
    same = loop_settings(load_settings(env={"RTRL_BATCHING__ROWS": str(LOOP_FIXED["batching.rows"][0])}))
    assert loop_settings(same) == same  # idempotent: the loop's own values are accepted again


def test_shipped_example_configs_load(tmp_path):
    """deploy/rtrl.example.toml lists every setting at its default; the production example is valid."""
    from pathlib import Path

    from rtrl.settings import Settings, example_toml

    deploy = Path(__file__).resolve().parent.parent / "deploy"
    assert (deploy / "rtrl.example.toml").read_text() == example_toml(), "regenerate: rtrl config --example"
    assert load_settings(deploy / "rtrl.example.toml", env={}) == Settings()
    from app.loop_config import loop_settings

    loop_settings(load_settings(deploy / "rtrl.example.toml", env={}))  # a copy of the example runs the main job
    with pytest.raises(ConfigError, match="sdk.salt is the public default"):  # its secret comes from the environment
        load_settings(deploy / "production.example.toml", env={})
    prod = load_settings(deploy / "production.example.toml", env={"RTRL_SDK__SALT": "the-production-secret"})
    assert prod.kafka.bootstrap.count(",") == 2 and prod.clickhouse.dsn.startswith("https://")


def test_settings_toml_reads_back_to_the_same_settings_without_its_secrets(tmp_path):
    """What a deployment's ConfigMap holds: the changed settings, read back equal; the secrets left out."""
    from rtrl.settings import settings_toml

    s = Settings().updated(
        {
            "kafka.bootstrap": "kafka-0.kafka:9092",
            "clickhouse.dsn": "https://ch.example:8443",
            "clickhouse.password": "s3cret",
            "flow.grace_s": 123.5,
            "sdk.salt": 'a "quoted" \\ salt',
            "rewards.versions": ["v1", "v2"],
            "rewards.train_schedule": {3: "v1"},
            "data_dir": "/var/lib/rtrl",
        }
    )
    text = settings_toml(s)
    assert "s3cret" not in text and "quoted" not in text
    f = tmp_path / "rtrl.toml"
    f.write_text(text)
    # the secrets arrive as a Secret would bring them: in the environment
    back = load_settings(f, env={"RTRL_SDK__SALT": s.sdk.salt, "RTRL_CLICKHOUSE__PASSWORD": "s3cret"})
    assert back == s
    assert back.kafka.bootstrap == "kafka-0.kafka:9092" and back.flow.grace_s == 123.5
    assert settings_toml(Settings()).count("=") == 0  # the defaults: nothing to say


# ---------------------------------------------------------------- secrets in DSN parameters; booleans for numbers

#: a DSN's query parameters that carry a credential: each value must show as *** (issue 40)
SECRET_PARAMS = [
    "password",
    "PASSWORD",
    "passwd",
    "pwd",
    "token",
    "access_token",
    "Access-Token",
    "secret",
    "client_secret",
    "key",
    "api_key",
    "apiKey",
    "sasl.password",
    "sasl_password",
    "x-amz-security-token",
    "pass%77ord",  # percent-encoded: the server decodes it to password
]


def _cli(args, env_extra, tmp_path):
    """``rtrl ARGS`` in a subprocess with only ``env_extra`` as its RTRL_* settings."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | env_extra
    env["RTRL_DATA_DIR"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("name", SECRET_PARAMS)
def test_dsn_query_secrets_are_redacted_when_shown(tmp_path, name):
    """A credential in a DSN's query never shows: not in describe (what `rtrl config` prints), repr, a settings
    file's refusal, or a generated settings file; the rest of the DSN stays readable."""
    from rtrl.section import redact_dsn
    from rtrl.settings import settings_toml

    dsn = f"http://rtrl@ch.example:8123/?database=rtrl&{name}=hunter2&compress=1"
    shown = f"http://rtrl@ch.example:8123/?database=rtrl&{name}=***&compress=1"
    assert redact_dsn(dsn) == shown
    assert redact_dsn(f"at {dsn!r}: refused") == f"at {shown!r}: refused"  # inside a message, quotes kept
    s = load_settings(env={"RTRL_CLICKHOUSE__DSN": dsn, "RTRL_SDK__SALT": "a-salt-of-ours"})
    assert s.clickhouse.dsn == dsn  # usable, just not shown
    assert dict((n, v) for n, v, _ in describe(s))["clickhouse.dsn"] == shown
    assert "hunter2" not in repr(s) and "hunter2" not in repr(s.clickhouse)
    f = tmp_path / "rtrl.toml"
    f.write_text(f'[clickhouse]\ndsn = "{dsn}"\n')
    with pytest.raises(ConfigError) as e:  # a settings file never holds a secret
        load_settings(f, env={})
    assert "hunter2" not in str(e.value) and shown in str(e.value) and "RTRL_CLICKHOUSE__PASSWORD" in str(e.value)
    with pytest.raises(ConfigError) as e:  # nor does the ConfigMap made from the settings
        settings_toml(s)
    assert "hunter2" not in str(e.value) and shown in str(e.value)


def test_redaction_keeps_what_is_not_a_secret():
    """Paths to secrets, switches and ordinary parameters stay; a password in the user part goes, however
    it is written (an unescaped / ? or @ in it, no scheme, a broker list)."""
    from rtrl.section import redact_dsn

    plain = "https://rtrl@ch:8443/?password_file=/run/secrets/p&client_cert_key=/k.pem&verify=false&user=bob"
    assert redact_dsn(plain) == plain
    assert redact_dsn("http://ch:8123/?q=a@b") == "http://ch:8123/?q=a@b"
    assert redact_dsn("http://[::1]:8123/?q=a@b") == "http://[::1]:8123/?q=a@b"
    assert redact_dsn("chdb:///var/lib/rtrl/clickhouse") == "chdb:///var/lib/rtrl/clickhouse"
    for dsn in ("http://u:hun/ter2@ch:1/", "http://u:hun?ter2@ch:1/", "http://u:hun@ter2@ch:1/"):
        assert redact_dsn(dsn) == "http://u:***@ch:1/", dsn
    assert redact_dsn("u:hunter2@b1:9092,b2:9092") == "u:***@b1:9092,b2:9092"
    assert redact_dsn("https://u:p@h/?a=1#access_token=hunter2") == "https://u:***@h/?a=1#access_token=***"


def test_rtrl_config_never_prints_a_dsn_secret(tmp_path):
    """`rtrl config` shows the DSN with its token as ***; a settings file with one is refused, redacted."""
    env = {"RTRL_CLICKHOUSE__DSN": "http://rtrl@ch:8123/?token=hunter2", "RTRL_SDK__SALT": "a-salt-of-ours"}
    proc = _cli(["config"], env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "http://rtrl@ch:8123/?token=***" in proc.stdout and "hunter2" not in proc.stdout + proc.stderr
    f = tmp_path / "rtrl.toml"
    f.write_text(
        '[clickhouse]\ndsn = "http://rtrl@ch.example:8123/?database=rtrl&password=hunter2&access_token=tok2"\n'
    )
    proc = _cli(["--config", str(f), "config"], {}, tmp_path)
    out = proc.stdout.replace("\n", "")
    assert proc.returncode == 2 and "Traceback" not in out + proc.stderr
    assert "hunter2" not in out + proc.stderr and "tok2" not in out + proc.stderr
    assert "http://rtrl@ch.example:8123/?database=rtrl&password=***&access_token=***" in out


def test_settings_errors_never_show_a_dsn_secret():
    """A refused DSN, serving URL or broker list is quoted in the error with its secret as ***."""
    cases = {
        "RTRL_CLICKHOUSE__DSN": "ch:8123/?password=hunter2",  # no scheme
        "RTRL_SERVING__URL": "ftp://h/v1?api_key=hunter2",
        "RTRL_SERVING__RELOAD_URL": "http://u:hunter2@h:99999",  # a bad port
        "RTRL_KAFKA__BOOTSTRAP": "user:hunter2@b:9092",  # a login in a broker address is refused
    }
    for var, value in cases.items():
        with pytest.raises(ConfigError) as e:
            load_settings(env={var: value})
        assert "hunter2" not in str(e.value) and "***" in str(e.value) and var in str(e.value), str(e.value)
    s = Settings()
    with pytest.raises(ValueError) as v:  # pydantic's own rendering (an assignment) leaves the input out
        s.clickhouse.dsn = "mysql://u@h/?token=hunter2"
    assert "hunter2" not in str(v.value)


def test_clickhouse_connection_error_never_shows_a_dsn_secret(tmp_path):
    """An unreachable server is named with its DSN's secrets as ***, by connect and by the CLI."""
    import socket

    from rtrl import clickhouse
    from rtrl.errors import ServiceUnavailable

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dsn = f"http://rtrl:hunter1@127.0.0.1:{port}/?password=hunter2&access_token=hunter3&database=rtrl"
    with pytest.raises(ServiceUnavailable) as e:
        clickhouse.connect(dsn, timeout_s=1)
    assert "hunter" not in str(e.value)
    assert f"http://rtrl:***@127.0.0.1:{port}/?password=***&access_token=***&database=rtrl" in str(e.value)
    env = {"RTRL_CLICKHOUSE__DSN": dsn, "RTRL_CLICKHOUSE__TIMEOUT_S": "1", "RTRL_SDK__SALT": "a-salt-of-ours"}
    proc = _cli(["migrate"], env, tmp_path)
    assert proc.returncode == 2 and "127.0.0.1" in proc.stdout, proc.stdout + proc.stderr
    assert "hunter" not in proc.stdout + proc.stderr


def _numbers() -> list[str]:
    """Every setting that holds a number (a count, size, port, seed, rate or duration)."""
    from rtrl.section import _numeric
    from rtrl.settings import SECTIONS

    return [
        f"{sec}.{key}"
        for sec in SECTIONS
        for key, f in type(getattr(Settings(), sec)).model_fields.items()
        if _numeric(f.annotation)
    ]


def test_booleans_are_refused_where_numbers_are_expected(tmp_path):
    """`true` / `false` is never read as 1 / 0: from a file, the environment or updated(), for every number,
    naming the setting and the fix; numbers from the environment still read as numbers."""
    names = _numbers()
    assert {"kafka.partitions", "kafka.replication_factor", "metrics.port", "train.steps", "kafka.timeout_s"} <= set(
        names
    )
    f = tmp_path / "rtrl.toml"
    for name in names:
        sec, _, key = name.partition(".")
        f.write_text(f"[{sec}]\n{key} = true\n")
        with pytest.raises(ConfigError, match=rf"setting {name} = true is a boolean, not a number.*{f}") as e:
            load_settings(f, env={})
        assert f"fix: give {name} a valid value" in str(e.value)
        with pytest.raises(ConfigError, match=rf"setting {name} = \[?'false'\]? is a boolean.*RTRL_{sec.upper()}__"):
            load_settings(env={f"RTRL_{sec.upper()}__{key.upper()}": "false"})
        with pytest.raises(ConfigError, match=rf"{name} = true is a boolean"):
            Settings().updated({name: True})
    f.write_text("[kafka]\npartitions = true\n")
    with pytest.raises(ConfigError, match="kafka.partitions = true is a boolean.*RTRL_KAFKA__PARTITIONS"):
        load_settings(f, env={})
    with pytest.raises(ConfigError, match="kafka.partitions = 'true' is a boolean.*environment variable"):
        load_settings(env={"RTRL_KAFKA__PARTITIONS": "true"})
    f.write_text("[flow.task_kinds.long]\ndeadline_s = true\n[adapters]\nrevalidate_scales = [1.0, true]\n")
    with pytest.raises(ConfigError, match="flow.task_kinds.long.deadline_s = true is a boolean"):
        load_settings(f, env={})
    with pytest.raises(ConfigError, match="adapters.revalidate_scales = .* is a boolean"):
        load_settings(env={"RTRL_ADAPTERS__REVALIDATE_SCALES": "0.5,true"})
    s = load_settings(env={"RTRL_KAFKA__PARTITIONS": "3", "RTRL_KAFKA__TIMEOUT_S": "2.5", "RTRL_MODEL__QKV_BIAS": "1"})
    assert s.kafka.partitions == 3 and s.kafka.timeout_s == 2.5 and s.model.qkv_bias is True  # bools stay bools


def test_cli_refuses_a_boolean_count(tmp_path):
    """`RTRL_KAFKA__PARTITIONS=true rtrl config` stops with one line naming kafka.partitions."""
    proc = _cli(["config"], {"RTRL_KAFKA__PARTITIONS": "true"}, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "kafka.partitions = 'true' is a boolean, not a number" in proc.stdout.replace("\n", "")
