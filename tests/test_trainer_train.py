"""The training loop on CPU: input preparation (pure), a golden loss curve for a fixed seed, and kill -9
mid-run + resume reproducing the uninterrupted run's batch sequence and losses from Kafka."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer

from rtrl.kafka import producer_config
from schemas.codec import encode_batch
from schemas.records import MicroBatch
from tests.dist.train_run import synthetic_batches
from trainer.batch import Batch
from trainer.train import prepare

RUN = [sys.executable, str(Path(__file__).parent / "dist" / "train_run.py")]
GOLDEN = Path(__file__).parent / "golden" / "tiny_loss_curve.json"


def test_prepare_shifts_packs_and_drops_stale_samples():
    """Targets are the next token of the same sample; positions restart per packed sample; the mask lets a
    token attend only to earlier tokens of its own sample; tokens of samples over the lag limit are
    masked out and counted; off-policy marks lag >= 1."""
    seg = np.array([[0, 0, 0, 1, 1, -1]])
    b = Batch(
        "b",
        np.array([[5, 6, 7, 8, 9, 0]]),
        np.array([[0, 1, 1, 0, 1, 0]], np.float32),
        np.ones((1, 6), np.float32),
        np.zeros((1, 6), np.float32),
        seg,
        ["x", "y"],
        np.array([3, 1]),
        0,
        0,
    )
    p = prepare(b, policy_version=3, max_policy_lag=1)
    assert p.tokens.tolist() == [[5, 6, 7, 8, 9]] and p.targets.tolist() == [[6, 7, 8, 9, 0]]
    assert p.positions.tolist() == [[0, 1, 2, 0, 1]]
    # sample y (version 1) has lag 2 > 1: its trained token is dropped; 7->8 crosses samples: never trained
    assert p.loss_mask.tolist() == [[1, 1, 0, 0, 0]] and p.stale_tokens == 1
    assert p.lags.tolist() == [0, 2]
    allowed = ~p.attention_mask[0, 0]
    assert allowed[3].tolist() == [False, False, False, True, False]  # first token of y sees only itself
    assert allowed[2].tolist() == [True, True, True, False, False]
    q = prepare(b, policy_version=3, max_policy_lag=2)
    assert q.loss_mask.tolist() == [[1, 1, 0, 1, 0]] and q.off_policy.tolist() == [[False, False, True, True, False]]


def _run(args, **kw):
    return subprocess.run(RUN + args, capture_output=True, text=True, timeout=600, **kw)


def _steps(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{") and '"step"' in line]


@pytest.mark.slow
def test_golden_loss_curve(tmp_path):
    """A fixed seed and fixed micro-batches give the recorded loss curve (catches numeric drift).
    Regenerate deliberately with RTRL_UPDATE_GOLDEN=1."""
    proc = _run([str(tmp_path / "ckpt"), "--steps", "6", "--checkpoint-every", "100"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = [[s["step"], s["loss"], s["kl"], s["clip_fraction"]] for s in _steps(proc.stdout)]
    if os.environ.get("RTRL_UPDATE_GOLDEN"):
        GOLDEN.write_text(
            json.dumps({"note": "tests/dist/train_run.py, tiny ModelSettings, 6 steps", "curve": curve}, indent=1)
        )
    golden = json.loads(GOLDEN.read_text())["curve"]
    assert len(curve) == len(golden) == 6
    for got, want in zip(curve, golden):
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1:], want[1:], rtol=1e-4, atol=1e-7)


def _to_micro(b: Batch) -> MicroBatch:
    return MicroBatch(
        batch_id=b.batch_id,
        created_at=1,
        seq_len=b.tokens.shape[1],
        token_ids=b.tokens.tolist(),
        loss_mask=b.loss_mask.astype(int).tolist(),
        advantages=b.advantages.tolist(),
        behaviour_logprobs=b.behaviour_logprobs.tolist(),
        segment_ids=b.segment_ids.tolist(),
        sample_ids=b.sample_ids,
        policy_versions=b.policy_versions.tolist(),
    )


@pytest.mark.slow
def test_kill_9_and_resume_trains_the_same_batches_once(broker, topic_prefix, tmp_path):
    """Micro-batches from Kafka; the trainer is killed with SIGKILL after step 3 (checkpoints every 2 steps)
    and restarted: the resumed run's steps carry exactly the uninterrupted run's batch ids and losses —
    nothing skipped, nothing trained twice in the final weights."""
    topic = topic_prefix + "batches"
    p = Producer(producer_config(broker.bootstrap))
    for b in synthetic_batches(12):
        p.produce(topic, value=encode_batch(_to_micro(b)), key=b.batch_id.encode(), partition=0)
    assert p.flush(10) == 0
    kafka = ["--bootstrap", broker.bootstrap, "--topic", topic, "--steps", "6", "--checkpoint-every", "2"]

    reference = _run([str(tmp_path / "a")] + kafka)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = [(s["step"], s["batch_ids"], s["loss"]) for s in _steps(reference.stdout)]
    assert [e[1] for e in expected] == [[f"b{2 * i:03d}", f"b{2 * i + 1:03d}"] for i in range(6)]

    first = subprocess.Popen(
        RUN + [str(tmp_path / "b")] + kafka, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    seen = []
    for line in first.stdout:
        if '"step"' in line:
            seen.append(json.loads(line))
            if seen[-1]["step"] == 3:
                os.kill(first.pid, signal.SIGKILL)
                break
    first.wait(30)
    assert [s["step"] for s in seen] == [1, 2, 3]
    resumed = _run([str(tmp_path / "b")] + kafka)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _steps(resumed.stdout)
    assert [s["step"] for s in after] == [3, 4, 5, 6]  # resumed from the step-2 checkpoint
    lineage = {s["step"]: s for s in seen[:2] + after}
    got = [(k, lineage[k]["batch_ids"], lineage[k]["loss"]) for k in sorted(lineage)]
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    np.testing.assert_allclose([g[2] for g in got], [e[2] for e in expected], rtol=1e-5)


@pytest.mark.slow
def test_rtrl_train_records_metrics_in_clickhouse(broker, topic_prefix, tmp_path):
    """`rtrl train` reads rtrl.batches, shows progress, checkpoints at the end, and writes one train_metrics
    row per step (loss, KL, clip fraction, on-policy fraction, lag histogram, batch ids) to ClickHouse."""
    topic = topic_prefix + "batches"
    p = Producer(producer_config(broker.bootstrap))
    for b in synthetic_batches(6):
        p.produce(topic, value=encode_batch(_to_micro(b)), key=b.batch_id.encode(), partition=0)
    assert p.flush(10) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_DATA_DIR": str(tmp_path),
        "RTRL_TRAIN__STEPS": "3",
        "RTRL_TRAIN__IDLE_TIMEOUT_S": "5",
        "RTRL_TRAIN__RUN_ID": "cli-run",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "train"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "trained 3 steps" in proc.stdout
    dump = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import json; from rtrl import clickhouse\n"
                f"ch = clickhouse.connect('chdb://{tmp_path}/clickhouse')\n"
                "print(json.dumps(ch.query('SELECT step, batch_ids, on_policy_fraction, lag_histogram, tokens FROM "
                "rtrl.train_metrics FINAL ORDER BY step').result_rows, default=str))"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = json.loads(dump.stdout.strip().splitlines()[-1])
    assert [r[0] for r in rows] == [1, 2, 3]
    assert [r[1] for r in rows] == [["b000", "b001"], ["b002", "b003"], ["b004", "b005"]]
    assert all(0 < r[2] <= 1 and r[4] > 0 for r in rows)
    assert (tmp_path / "checkpoints" / "step_000000003" / "COMPLETE").exists()


def test_torch_threads_leave_a_core_for_the_broker_on_cpu():
    """0 = auto keeps one core free on a CPU-only machine; an explicit setting wins."""
    import torch

    from trainer.run import torch_threads

    assert torch_threads(3) == 3
    if not torch.cuda.is_available():
        assert torch_threads(0) == max(1, (os.cpu_count() or 2) - 1)
