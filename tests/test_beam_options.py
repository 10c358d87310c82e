"""The example pipeline-options files in deploy/beam/ select their runner through ``backfill.pipeline_options``
alone: each parses through :func:`flows.backfill.pipeline_options` into the runner and the options its README
documents, every flag (commented-out alternatives included) is a real Beam option, and the local FnApiRunner
settings stay out of the way. Nothing is run: no cluster, no cloud, no network."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from apache_beam.options.pipeline_options import (
    FlinkRunnerOptions,
    GoogleCloudOptions,
    PipelineOptions,
    PortableOptions,
    SparkRunnerOptions,
    StandardOptions,
    WorkerOptions,
)
from apache_beam.runners.runner import create_runner

from flows import backfill as bf
from rtrl.settings import load_settings

BEAM = Path(__file__).resolve().parent.parent / "deploy" / "beam"
FILES = sorted(BEAM.glob("*.options"))


def _options(path: Path, tmp_path: Path) -> PipelineOptions:
    settings = load_settings(
        env={"RTRL_SDK__SALT": "x" * 24, "RTRL_BACKFILL__PIPELINE_OPTIONS": str(path), "RTRL_DATA_DIR": str(tmp_path)}
    )
    return bf.pipeline_options(settings)


def _flags(text: str) -> list[str]:
    """The option names of every ``--flag`` in ``text``, in active lines and in commented-out examples."""
    names = []
    for line in text.splitlines():
        body = line.lstrip("# ").strip()
        for word in shlex.split(body, comments=True) if body.startswith("--") else []:
            if word.startswith("--"):
                names.append(word[2:].split("=", 1)[0])
    return names


def test_the_three_runners_are_there():
    assert [p.name for p in FILES] == ["dataflow.options", "flink.options", "spark.options"]
    assert (BEAM / "README.md").is_file()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_flag_is_a_beam_option(path):
    known = set(PipelineOptions([]).get_all_options()) | {"no_use_public_ips"}  # the flag whose dest differs
    flags = _flags(path.read_text())
    assert "runner" in flags
    assert [f for f in flags if f not in known] == []


def test_flink(tmp_path):
    options = _options(BEAM / "flink.options", tmp_path)
    assert options.view_as(StandardOptions).runner == "FlinkRunner"
    flink = options.view_as(FlinkRunnerOptions)
    assert flink.flink_master == "flink-jobmanager:8081"
    assert flink.flink_version == "1.20" and flink.parallelism == 4
    portable = options.view_as(PortableOptions)
    assert portable.environment_type == "DOCKER" and portable.environment_config.endswith("rtrl-beam:0.1.0")


def test_spark(tmp_path):
    options = _options(BEAM / "spark.options", tmp_path)
    assert options.view_as(StandardOptions).runner == "SparkRunner"
    spark = options.view_as(SparkRunnerOptions)
    assert spark.spark_master_url == "spark://spark-master:7077" and spark.spark_version == "3"
    portable = options.view_as(PortableOptions)
    assert portable.environment_type == "DOCKER" and portable.environment_config.endswith("rtrl-beam:0.1.0")


def test_dataflow(tmp_path):
    options = _options(BEAM / "dataflow.options", tmp_path)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcp = options.view_as(GoogleCloudOptions)
    assert gcp.project and gcp.region
    assert gcp.temp_location.startswith("gs://") and gcp.staging_location.startswith("gs://")
    workers = options.view_as(WorkerOptions)
    assert workers.sdk_container_image.endswith("rtrl-beam:0.1.0")
    assert workers.num_workers == 2 and workers.max_num_workers == 4 and workers.machine_type


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_the_file_names_the_runner_and_the_local_runner_steps_aside(path, tmp_path):
    """A runner named in the file: backfill() passes no runner object (Beam resolves the name, which it knows),
    the plan says which runner, and ``--workers`` (local worker processes) is not applied to it."""
    options = _options(path, tmp_path)
    name = options.view_as(StandardOptions).runner
    assert bf._runner(options) is None
    assert type(create_runner(name)).__name__ == name  # instantiating a runner contacts nothing
    settings = load_settings(
        env={"RTRL_SDK__SALT": "x" * 24, "RTRL_BACKFILL__PIPELINE_OPTIONS": str(path), "RTRL_DATA_DIR": str(tmp_path)}
    )
    assert f"runner {name}" in bf.describe_plan(settings, "v2", None, None, workers=3)
    assert "direct_num_workers" not in bf.pipeline_options(settings, 3).get_all_options(drop_default=True)
