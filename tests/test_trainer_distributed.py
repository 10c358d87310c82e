"""Distributed training on CPU with torchrun and gloo: DP=2, TP=2 and PP=2 (also with tied embeddings) runs of
the same global batches match the single-process run (losses, the pre-clip gradient norm and the
training-inference mismatch of each step, final parameters) within floating-point tolerance.

Two launches serve the whole module: one process trains the 4 single-process references one after another,
and one torchrun (2 processes) trains the 7 layouts one after another (tests/dist/train_run.py ``--job``).
Each run starts from new parallel groups and seeds, as a new process would.
Each layout is still its own test, so a failure names it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from devservices.broker import free_port

#: the most one launch may take; the first test's setup makes both (pytest-timeout counts setup)
LAUNCH_TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)]  # torchrun process groups

SCRIPT = str(Path(__file__).parent / "dist" / "train_run.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

#: per-step metrics reduced over the ranks besides the loss: the pre-clip gradient norm (sum of squares over
#: shards and stages), the mismatch's token-weighted mean (SUM) and its maximum (MAX over the replicas)
REDUCED = ("grad_norm", "mismatch_k3", "mismatch_max_abs_log_ratio")

#: the two-process layouts (test id -> train_run.py arguments)
LAYOUTS = {
    "dp2": [],
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2"],
    "pp2-tied": ["--pp", "2", "--tie"],
    "tp2-full-kl": ["--tp", "2", "--kl-estimator", "full"],
    "pp2-full-kl": ["--pp", "2", "--kl-estimator", "full"],
    "tp2-updates2": ["--tp", "2", "--updates", "2"],
}
COMMON = ["--steps", "3", "--checkpoint-every", "100", "--params"]

Result = tuple[list[float], dict, list[list[float]]]


def _reference(layout: list[str]) -> tuple[str, list[str]]:
    """The single-process run a layout is compared with: its name and its arguments (embeddings, KL, updates)."""
    tie = "--tie" in layout
    kl = layout[layout.index("--kl-estimator") + 1] if "--kl-estimator" in layout else "k3"
    updates = layout[layout.index("--updates") + 1] if "--updates" in layout else "1"
    name = f"single{'-tied' if tie else ''}-{kl}-updates{updates}"
    return name, ["--kl-estimator", kl, "--updates", updates] + (["--tie"] if tie else [])


def _parse(stdout: str) -> dict[str, Result]:
    """Each finished run's losses, final parameters and reduced metrics, by run name."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    done = {x["run"] for x in lines if "done" in x}
    out = {}
    for name in done:
        mine = [x for x in lines if x.get("run") == name]
        losses = [x["loss"] for x in mine if "step" in x]
        metrics = [[x[k] for k in REDUCED] for x in mine if "step" in x]
        params = next(x["params"] for x in mine if "params" in x)
        out[name] = losses, params, metrics
    return out


def _launch(cmd: list[str], runs: dict[str, list[str]]) -> tuple[dict[str, Result], str]:
    """Run ``runs`` (name -> arguments) one after another in one launch of ``cmd``.

    Returns the finished runs and, if the launch failed, its exit status and stderr.
    A launch that fails after its last run finished counts against every run in it.
    """
    groups = [a for name, args in runs.items() for a in ("--job", name, shlex.join(args))]
    try:
        proc = subprocess.run([*cmd, SCRIPT, *groups], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        stdout, stderr, failure = proc.stdout, proc.stderr, f"exit status {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired as e:  # its output comes as bytes
        stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        failure = f"no end within {LAUNCH_TIMEOUT_S} s"
    finished = _parse(stdout)
    if not failure:
        return finished, ""
    if finished.keys() == runs.keys():
        finished = {}
    return finished, f"{failure}: {stderr[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict[str, Result], str]]:
    """Every run, by name: the single-process references (untied and tied embeddings) and the 7 layouts.

    Each reference saves its initial weights; a pipeline stage draws other initial weights than the whole model,
    so the pipeline layouts start from them (resharded to two stages).
    """
    out = tmp_path_factory.mktemp("dist")
    singles = {}
    for name, args in dict(_reference(layout) for layout in LAYOUTS.values()).items():
        singles[name] = [str(out / name / "run"), *COMMON, "--init", str(out / name / "init"), *args]
    single = _launch([sys.executable], singles)
    two = {}
    for name, layout in LAYOUTS.items():
        init = ["--init", str(out / _reference(layout)[0] / "init")] if "--pp" in layout else []
        two[name] = [str(out / name), *COMMON, *layout, *init]
    pair = _launch([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port())], two)
    return {name: single for name in singles} | {name: pair for name in LAYOUTS}


def _result(runs: dict[str, tuple[dict[str, Result], str]], name: str) -> Result:
    results, failure = runs[name]
    assert name in results, f"run {name} did not finish: {failure or 'no output'}"
    return results[name]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_process_run_matches_single_process(runs, layout):
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
    want_losses, want_params, want_metrics = _result(runs, _reference(LAYOUTS[layout])[0])
    losses, params, metrics = _result(runs, layout)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(metrics, want_metrics, rtol=1e-4, atol=1e-7, err_msg=str(REDUCED))
    assert params.keys() == want_params.keys()
    for name in params:
        np.testing.assert_allclose(params[name], want_params[name], rtol=1e-4, atol=1e-4, err_msg=name)
