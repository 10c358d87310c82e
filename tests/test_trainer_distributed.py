"""Distributed training on CPU with torchrun and gloo: DP=2 and TP=2 runs of the same global batches match
the single-process run (losses and final parameters) within floating-point tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from devservices.broker import free_port

SCRIPT = str(Path(__file__).parent / "dist" / "train_run.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _parse(stdout: str) -> tuple[list[float], dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    losses = [x["loss"] for x in lines if "step" in x]
    params = next(x["params"] for x in lines if "params" in x)
    return losses, params


def _run(cmd: list[str]) -> tuple[list[float], dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _parse(proc.stdout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(
        [
            sys.executable,
            SCRIPT,
            str(tmp_path_factory.mktemp("single")),
            "--steps",
            "3",
            "--checkpoint-every",
            "100",
            "--params",
        ]
    )


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["dp2", "tp2"])
def test_two_process_run_matches_single_process(single, layout, tmp_path):
    """torchrun with 2 processes (data parallel: each rank trains half of every global batch and gradients
    are summed; or tensor parallel: each rank holds half of every matrix) gives the single-process losses and
    final parameters."""
    losses, params = _run(
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
        ]
    )
    want_losses, want_params = single
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-7)
    assert params.keys() == want_params.keys()
    for name in params:
        np.testing.assert_allclose(params[name], want_params[name], rtol=1e-4, atol=1e-4, err_msg=name)
