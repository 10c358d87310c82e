"""Distributed training on CPU with torchrun and gloo: DP=2, TP=2 and PP=2 (also with tied embeddings) runs of
the same global batches match the single-process run (losses, the pre-clip gradient norm and the
training-inference mismatch of each step, final parameters) within floating-point tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from devservices.broker import free_port

pytestmark = pytest.mark.slow  # torchrun process groups

SCRIPT = str(Path(__file__).parent / "dist" / "train_run.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


#: per-step metrics reduced over the ranks besides the loss: the pre-clip gradient norm (sum of squares over
#: shards and stages), the mismatch's token-weighted mean (SUM) and its maximum (MAX over the replicas)
REDUCED = ("grad_norm", "mismatch_k3", "mismatch_max_abs_log_ratio")


def _parse(stdout: str) -> tuple[list[float], dict, list[list[float]]]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    losses = [x["loss"] for x in lines if "step" in x]
    metrics = [[x[k] for k in REDUCED] for x in lines if "step" in x]
    params = next(x["params"] for x in lines if "params" in x)
    return losses, params, metrics


def _run(cmd: list[str]) -> tuple[list[float], dict, list[list[float]]]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _parse(proc.stdout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process runs (untied and tied embeddings), each with the checkpoint of its initial weights."""
    runs: dict[tuple[bool, str, str], tuple[list[float], dict, list[list[float]], Path]] = {}

    def run(tie: bool, kl: str, updates: str = "1") -> tuple[list[float], dict, list[list[float]], Path]:
        if (tie, kl, updates) not in runs:
            out = tmp_path_factory.mktemp("single-tied" if tie else "single")
            cmd = [sys.executable, SCRIPT, str(out / "run"), "--steps", "3", "--checkpoint-every", "100", "--params"]
            extra = ["--init", str(out / "init"), "--kl-estimator", kl, "--updates", updates] + (
                ["--tie"] if tie else []
            )
            losses, params, metrics = _run(cmd + extra)
            runs[tie, kl, updates] = losses, params, metrics, out / "init"
        return runs[tie, kl, updates]

    return run


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["--tp", "2"],
        ["--pp", "2"],
        ["--pp", "2", "--tie"],
        ["--tp", "2", "--kl-estimator", "full"],
        ["--pp", "2", "--kl-estimator", "full"],
        ["--tp", "2", "--updates", "2"],
    ],
    ids=["dp2", "tp2", "pp2", "pp2-tied", "tp2-full-kl", "pp2-full-kl", "tp2-updates2"],
)
def test_two_process_run_matches_single_process(single, layout, tmp_path):
    """torchrun with 2 processes (data parallel: each rank trains half of every global batch and gradients
    are summed; tensor parallel: each rank holds half of every matrix; pipeline parallel: each rank holds one
    stage (half of the layers) and the step runs megatron's 1F1B schedule, with the tied embedding's two
    copies kept equal) gives the single-process losses and final parameters.

    A pipeline stage draws other initial weights than the whole model, so the pipeline runs start from the
    single-process run's initial weights (its checkpoint, resharded to two stages); each stage reports its
    own layers under their global names.

    With ``--kl-estimator full`` (loss.kl_estimator, weight 0.5) the exact KL over the vocabulary is computed from
    vocab-parallel log-softmaxes (tp) and on the last stage from the reference's log-softmax the pipeline schedule
    carries (pp): the same losses and parameters as the single process with it. With ``--updates 2``
    (train.updates_per_step) each step's micro-batches take two optimizer updates (the later one without the
    metrics' collectives): the same figures (the first update's) and final parameters."""
    tie = "--tie" in layout
    kl = layout[layout.index("--kl-estimator") + 1] if "--kl-estimator" in layout else "k3"
    updates = layout[layout.index("--updates") + 1] if "--updates" in layout else "1"
    want_losses, want_params, want_metrics, init = single(tie, kl, updates)
    init_args = ["--init", str(init)] if "--pp" in layout else []
    losses, params, metrics = _run(
        [
            TORCHRUN,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            SCRIPT,
            str(tmp_path),
            "--steps",
            "3",
            "--checkpoint-every",
            "100",
            "--params",
            *layout,
            *init_args,
        ]
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(metrics, want_metrics, rtol=1e-4, atol=1e-7, err_msg=str(REDUCED))
    assert params.keys() == want_params.keys()
    for name in params:
        np.testing.assert_allclose(params[name], want_params[name], rtol=1e-4, atol=1e-4, err_msg=name)
