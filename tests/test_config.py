"""Settings: defaults, file + environment overrides, and errors that name the setting and the fix."""

from __future__ import annotations

import pytest

from rtrl.settings import ConfigError, describe, load_settings


def test_defaults_are_valid_and_embedded():
    """With no file and no environment the settings use the local broker and embedded chdb."""
    s = load_settings(env={})
    assert s.kafka.bootstrap == ""
    assert s.clickhouse_dsn.startswith("chdb://")
    assert s.topic("events") == "rtrl.events"


def test_file_then_environment_override(tmp_path):
    """The environment wins over the file, which wins over the defaults; values are typed."""
    f = tmp_path / "rtrl.toml"
    f.write_text('data_dir = "/tmp/x"\n[kafka]\nbootstrap = "h:1"\npartitions = 8\n[sdk]\nqueue_size = 10\n')
    s = load_settings(f, env={"RTRL_KAFKA__PARTITIONS": "3", "RTRL_SIMULATOR__DUPLICATE_RATE": "0.5"})
    assert (s.data_dir, s.kafka.bootstrap, s.kafka.partitions, s.sdk.queue_size) == ("/tmp/x", "h:1", 3, 10)
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
        ("[kafka]\npartitions = 'many'\n", "kafka.partitions = 'many'.*not a valid int"),
        ("[kafka]\npartitions = 0\n", "kafka.partitions = 0 must be > 0.*RTRL_KAFKA__PARTITIONS"),
        ("[kafka]\nbootstrap = 'nohostport'\n", "kafka.bootstrap.*host:port"),
        ("[clickhouse]\ndsn = 'mysql://db'\n", "clickhouse.dsn.*chdb://"),
        ("[simulator]\nduplicate_rate = 2.0\n", "simulator.duplicate_rate.*probability"),
        ("[sdk]\nsalt = 'short'\n", "sdk.salt.*at least 8"),
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
    assert len(rows) > 15
    assert all(help_text for _, _, help_text in rows)


def test_shipped_example_configs_load(tmp_path):
    """deploy/rtrl.example.toml lists every setting at its default; the production example is valid."""
    from pathlib import Path

    from rtrl.settings import Settings

    from rtrl.settings import example_toml

    deploy = Path(__file__).resolve().parent.parent / "deploy"
    assert (deploy / "rtrl.example.toml").read_text() == example_toml(), "regenerate: rtrl config --example"
    assert load_settings(deploy / "rtrl.example.toml", env={}) == Settings()
    prod = load_settings(deploy / "production.example.toml", env={})
    assert prod.kafka.bootstrap.count(",") == 2 and prod.clickhouse.dsn.startswith("https://")
