"""Nothing is deleted before the run is known to be able to start.

``rtrl run`` starts afresh by deleting the previous run's broker, ClickHouse and loop folders. The contract pinned
here: every refusal it can know up front comes first, as one error line with exit code 2, and the previous run's
data survives it. The refusal classes are the settings, the model folder (family, vocabulary, shape settings,
parallel layout, the tensors' shapes, missing weights) and the data folder. The same holds with ``--resume``,
and for the main job's other entry points (``run_loop``, processes mode, the local cluster), which all go
through :func:`app.job.preflight`. Model folders are real: a ``config.json`` as transformers writes one and a
``model.safetensors`` with every tensor the config names, written here (no download).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import app.job
import app.run
import app.services
from rtrl.errors import ConfigError
from rtrl.files import MARKER, data_folder
from rtrl.settings import load_settings
from simulator.tasks import VOCAB
from tests.test_operator_errors import _cli, _one_error_line
from trainer.hf.config import config_from_hf, new_hf_config
from trainer.hf.layout import hf_shapes

PARTS = ("broker", "clickhouse", "archive", "loop", "recovery", "logs")


def _previous_run(root: Path) -> Path:
    """A data folder as a previous run leaves it: marked as rtrl's, each part holding a file."""
    data = data_folder(root / "data")
    for part in PARTS:
        (data / part).mkdir()
        (data / part / "kept.txt").write_text(part)
    return data


def _survived(data: Path) -> bool:
    return all((data / part / "kept.txt").read_text() == part for part in PARTS)


def _checkpoint(folder: Path, vocab: int = VOCAB, family: str = "llama", weights_of: dict | None = None) -> Path:
    """A Hugging Face checkpoint folder: its config.json and a model.safetensors holding every tensor of
    ``weights_of`` (default: of that config) at its shape."""
    folder.mkdir(parents=True)
    hf = new_hf_config(
        "llama",
        vocab_size=vocab,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    shapes = hf_shapes(config_from_hf(weights_of or hf))
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf | {"model_type": family}))
    return folder


@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting a service fails the test: a refusal must come before the broker and ClickHouse start."""
    started: list[str] = []

    def refuse(*args, **kwargs):
        started.append("services")
        raise AssertionError("a service was started before the run was known to be able to start")

    monkeypatch.setattr(app.services.Services, "__init__", refuse)
    return started


def _bad_model_folders(root: Path) -> dict[str, tuple[dict[str, str], str]]:
    """Each refusal of a model folder: (its RTRL_* settings, what the error line says)."""
    good = _checkpoint(root / "good")
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    other = json.loads((good / "config.json").read_text()) | {"hidden_size": 64, "head_dim": 16}
    return {
        "family": ({"RTRL_MODEL__HF_PATH": str(_checkpoint(root / "mistral", family="mistral"))}, "model_type"),
        "vocabulary": ({"RTRL_MODEL__HF_PATH": str(_checkpoint(root / "big-vocab", vocab=32_000))}, "vocabulary"),
        "shape setting": ({"RTRL_MODEL__HF_PATH": str(good), "RTRL_MODEL__HIDDEN_SIZE": "48"}, "model.hidden_size"),
        "tensor shapes": (
            {"RTRL_MODEL__HF_PATH": str(_checkpoint(root / "other-weights", weights_of=other))},
            "do not fit its config.json",
        ),
        "no weights": ({"RTRL_MODEL__HF_PATH": str(no_weights)}, "model.safetensors"),
        "parallel layout": ({"RTRL_MODEL__HF_PATH": str(good), "RTRL_PARALLEL__TP": "2"}, "parallel.tp"),
    }


REFUSALS = ("family", "vocabulary", "shape setting", "tensor shapes", "no weights", "parallel layout")


@pytest.mark.parametrize("flag", [[], ["--resume"]], ids=["afresh", "resume"])
@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_model_the_run_cannot_use_deletes_and_starts_nothing(
    refusal, flag, tmp_path, nothing_starts, capsys, monkeypatch
):
    """Each model refusal is one error line, exit code 2, before any deletion or service start."""
    data = _previous_run(tmp_path)
    env, says = _bad_model_folders(tmp_path)[refusal]
    rc, lines = _cli(["run", *flag], {"RTRL_DATA_DIR": str(data)} | env, capsys, monkeypatch)
    assert rc == 2, lines
    assert says in _one_error_line(lines)
    assert not any("fresh start" in line or "keeping" in line for line in lines), lines
    assert _survived(data) and nothing_starts == []


def test_settings_the_loop_refuses_delete_nothing(tmp_path, nothing_starts, capsys, monkeypatch):
    """A setting the closed loop owns (train.steps) is refused before the fresh start."""
    data = _previous_run(tmp_path)
    rc, lines = _cli(["run"], {"RTRL_DATA_DIR": str(data), "RTRL_TRAIN__STEPS": "5"}, capsys, monkeypatch)
    assert rc == 2 and "train.steps" in _one_error_line(lines)
    assert _survived(data) and nothing_starts == []


def test_a_data_folder_rtrl_did_not_make_is_refused_untouched(tmp_path, nothing_starts, capsys, monkeypatch):
    """A folder holding run parts without rtrl's marker is refused, and so is a data_dir that is a file."""
    data = _previous_run(tmp_path)
    (data / MARKER).unlink()
    rc, lines = _cli(["run"], {"RTRL_DATA_DIR": str(data)}, capsys, monkeypatch)
    assert rc == 2 and "not created by rtrl" in _one_error_line(lines)
    assert _survived(data) and not (data / MARKER).exists()
    afile = tmp_path / "a-file"
    afile.write_text("mine")
    rc, lines = _cli(["run"], {"RTRL_DATA_DIR": str(afile)}, capsys, monkeypatch)
    assert rc == 2 and "is a file" in _one_error_line(lines)
    assert afile.read_text() == "mine" and nothing_starts == []


def test_every_entry_point_of_the_main_job_checks_before_it_deletes(tmp_path, nothing_starts, monkeypatch):
    """``run_loop`` (in one process and with loop.processes) and the local cluster's fresh start refuse the same
    model before they delete; a usable model passes the same check."""
    data = _previous_run(tmp_path)
    mistral = _checkpoint(tmp_path / "mistral", family="mistral")
    env = {"RTRL_DATA_DIR": str(data), "RTRL_MODEL__HF_PATH": str(mistral)}
    for processes in ("false", "true"):
        settings = load_settings(env=env | {"RTRL_LOOP__PROCESSES": processes})
        with pytest.raises(ConfigError, match="model_type"):
            app.run.run_loop(settings)
    with pytest.raises(ConfigError, match="model_type"):
        app.job.fresh_start(load_settings(env=env), trains=False)
    assert _survived(data) and nothing_starts == []
    good = load_settings(env={"RTRL_DATA_DIR": str(data), "RTRL_MODEL__HF_PATH": str(_checkpoint(tmp_path / "ok"))})
    app.job.preflight(good)  # no error: the refusals above are the model's
