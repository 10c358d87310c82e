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
    from app.loop import LOOP_FIXED, loop_settings

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
    from app.loop import loop_settings

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
