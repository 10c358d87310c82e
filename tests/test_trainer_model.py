"""Megatron-Core trainer model and checkpoints on CPU: build, forward, FP8 guard, CPU shims, save/load, TP resharding.

In-process tests share one single-process gloo group (``init_parallel`` with ``file://``). Anything that
saves a checkpoint runs in a subprocess or under torchrun (tests/dist/trainer_worker.py): saving starts a
spawn-mode multiprocessing manager, which needs a ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings, ParallelSettings, PrecisionSettings, TransformerEngineMissing
from trainer import checkpoint, cpu_compat

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "trainer_worker.py"
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


#: a hang guard, not a speed check: 22 s alone, and over 150 s beside three workers' loop tests on 2 cores
RUN_TIMEOUT_S = 480


def _run(cmd: list[str], timeout: float = RUN_TIMEOUT_S) -> None:
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny():
    """The tiny model on a single-process gloo group in this process (TP=PP=DP=1)."""
    from trainer.model import build_model, init_parallel

    cfg = ModelSettings.tiny()
    info = init_parallel(cfg)
    return cfg, info, build_model(cfg)


def _batch(cfg: ModelSettings, b: int = 4, s: int = 32):
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return seq[:, :-1], torch.arange(s).expand(b, s), seq[:, 1:]


# --------------------------------------------------------------------------- config


def test_config_validation_names_the_field():
    """Bad values raise errors naming the field; FP8 implies bf16; the layout must fit the world size."""
    with pytest.raises(
        ValidationError, match=r"model\.hidden_size = 65 must be divisible by model\.num_attention_heads"
    ):
        ModelSettings.tiny(hidden_size=65)
    with pytest.raises(ConfigError, match=r"model\.vocab_size = 255 must be divisible by parallel\.tp = 2"):
        ModelSettings.tiny(vocab_size=255, parallel=ParallelSettings(tp=2))
    with pytest.raises(ValidationError, match=r"fp8\n.*'hybrid' or 'e4m3'"):
        PrecisionSettings(bf16=True, fp8="e5m2")
    with pytest.raises(ValidationError, match=r"fp8_recipe\n.*'delayed', 'tensorwise', 'mxfp8' or 'blockwise'"):
        PrecisionSettings(fp8_recipe="fast")
    with pytest.raises(ValidationError, match=r"precision\.fp8 = 'hybrid' needs precision\.bf16 = true"):
        PrecisionSettings(fp8="hybrid")
    with pytest.raises(ValidationError, match=r"tp\n.*greater than 0"):
        ParallelSettings(tp=0)
    with pytest.raises(ConfigError, match=r"parallel\.dp = 2 but world size 2"):
        ParallelSettings(tp=2, dp=2).resolve_dp(2)
    assert ParallelSettings(tp=2).resolve_dp(4) == 2
    t = ModelSettings.tiny()
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.vocab_size, t.seq_length) == (2, 64, 4, 256, 64)


def test_fp8_without_transformer_engine_is_a_hard_error():
    """Asking for FP8 where `import transformer_engine` fails raises TransformerEngineMissing (no silent bf16)."""
    from trainer.model import build_model, transformer_engine_status

    assert transformer_engine_status()[0] is False, "this CPU environment must not have Transformer Engine"
    for recipe in ("delayed", "mxfp8"):
        with pytest.raises(
            TransformerEngineMissing, match=r"precision\.fp8 = 'hybrid' needs NVIDIA Transformer Engine"
        ):
            build_model(ModelSettings.tiny(), PrecisionSettings(bf16=True, fp8="hybrid", fp8_recipe=recipe))
    assert issubclass(TransformerEngineMissing, ConfigError)


def test_transformer_engine_probe_catches_runtime_errors(monkeypatch):
    """A broken TE raises RuntimeError on import (not ImportError); the probe still reports it as missing."""
    import builtins

    from trainer.model import transformer_engine_status

    real_import = builtins.__import__

    def broken(name, *a, **k):
        if name.startswith("transformer_engine"):
            raise RuntimeError("libcuda.so not found")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", broken)
    ok, detail = transformer_engine_status()
    assert not ok and "RuntimeError: libcuda.so not found" in detail


# --------------------------------------------------------------------------- CPU shims


def test_cpu_compat_install_is_idempotent_and_inert_with_cuda(monkeypatch):
    """install() twice changes nothing; with CUDA reported available it installs nothing, and installed
    shims defer to the original CUDA calls."""
    import megatron.core.tensor_parallel.random as mrandom

    cpu_compat.install()
    first = cpu_compat.installed()
    assert {"current_device", "synchronize", "rng_tracker", "schedules", "tied_embeddings"} <= set(first)
    shim = torch.cuda.current_device
    assert cpu_compat.install() == first and torch.cuda.current_device is shim
    assert not getattr(shim.__wrapped__, "_rtrl_shim", False), "shim wrapped twice"
    assert torch.cuda.current_device() == torch.device("cpu")

    # Installed shims forward to the original when CUDA is available (here: the original raises).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.shims_needed() is False
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.synchronize()

    # With CUDA available install() does nothing at all.
    cpu_compat.uninstall()
    try:
        original = torch.cuda.current_device
        assert not getattr(original, "_rtrl_shim", False)
        assert cpu_compat.install() == [] and cpu_compat.installed() == []
        assert torch.cuda.current_device is original
        assert not getattr(mrandom.CudaRNGStatesTracker, "_rtrl_shim", False)
    finally:
        monkeypatch.undo()
        assert cpu_compat.install() == first


# --------------------------------------------------------------------------- model


def test_tiny_model_forward_and_training(tiny):
    """The tiny GPTModel builds on CPU; forward_logprobs gives finite [B, S] log-probs <= 0; a few AdamW
    steps on a fixed batch lower the mean NLL."""
    from megatron.core.models.gpt import GPTModel

    from trainer.model import forward_logprobs

    cfg, info, model = tiny
    assert isinstance(model, GPTModel)
    assert (info.world_size, info.tp, info.pp, info.dp, info.backend) == (1, 1, 1, 1, "gloo")
    tokens, pos, targets = _batch(cfg)
    lp = forward_logprobs(model, tokens, pos, targets)
    assert lp.shape == (4, 32) and lp.dtype == torch.float32
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    # Causal: changing the last token leaves earlier positions' log-probs unchanged.
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        assert torch.allclose(forward_logprobs(model, t2, pos, targets)[:, :-1], lp[:, :-1].detach(), atol=1e-6)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = -forward_logprobs(model, tokens, pos, targets).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_build_model_is_deterministic(tiny):
    """The weights depend only on the config: building twice (a policy and its reference) gives the same
    model whatever the RNGs did in between; another cfg.seed gives another model."""

    from trainer.model import build_model

    cfg = tiny[0]
    a = build_model(cfg)
    torch.rand(100)
    b = build_model(cfg)
    c = build_model(cfg.replace(seed=cfg.seed + 1))
    pa, pb, pc = (list(m.state_dict().values()) for m in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb) if isinstance(x, torch.Tensor))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc) if isinstance(x, torch.Tensor))


def test_bf16_model_on_cpu(tiny):
    """precision.bf16 builds a model whose parameters are all bf16; log-probs still come back float32 and finite."""
    from trainer.model import build_model, forward_logprobs

    cfg = tiny[0]
    model = build_model(cfg, PrecisionSettings(bf16=True))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens, pos, targets = _batch(cfg, b=2, s=16)
    with torch.no_grad():
        lp = forward_logprobs(model, tokens, pos, targets)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()


def test_forward_logprobs_rejects_bad_inputs(tiny):
    """Mismatched shapes and a non-boolean mask are errors, not silent broadcasting."""
    from trainer.model import forward_logprobs

    cfg, _, model = tiny
    tokens, pos, targets = _batch(cfg)
    with pytest.raises(ValueError, match="same"):
        forward_logprobs(model, tokens, pos, targets[:, :-1])
    with pytest.raises(ValueError, match="boolean"):
        forward_logprobs(model, tokens, pos, targets, attention_mask=torch.zeros(1, 1, 32, 32))


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    """One subprocess: train 3 steps, save (over a half-written folder), reload into a fresh model+AdamW."""
    out = tmp_path_factory.mktemp("roundtrip")
    _run([PY, str(WORKER), "roundtrip", str(out)])
    return out, json.loads((out / "roundtrip.json").read_text())


@pytest.mark.slow
def test_checkpoint_round_trip(roundtrip):
    """Parameters, AdamW state (moments, step, hyper-parameters) and the extra dict come back identical, and
    training continues identically; a complete checkpoint is never overwritten."""
    _, r = roundtrip
    assert r["differs_before"], "the fresh model must differ before loading for the test to mean anything"
    assert r["params_equal"] and r["opt_equal"]
    assert r["n_state"] == r["n_params"]
    assert r["extra"] == r["extra_expected"]
    assert r["next_loss"][0] == r["next_loss"][1]
    assert r["refused_overwrite"]
    assert {"COMPLETE", "extra.json", "metadata.json", "rng"} <= set(r["files"])
    assert "junk.distcp" not in r["files"], "the interrupted save's leftovers were not cleared"


def test_incomplete_checkpoint_is_ignored(roundtrip, tmp_path):
    """A folder without the COMPLETE marker (a save killed midway) is skipped by latest() and refused by load()."""
    out, _ = roundtrip
    root = tmp_path / "ckpts"
    shutil.copytree(out / "ckpts", root)
    good = checkpoint.latest(root)
    assert good == checkpoint.step_dir(root, 3)
    newer = checkpoint.step_dir(root, 9)
    shutil.copytree(good, newer)
    (newer / checkpoint.MARKER).unlink()
    (tmp_path / "ckpts" / "not_a_checkpoint").mkdir()
    assert checkpoint.latest(root) == good
    assert checkpoint.latest(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.load(newer, model=None)
    # Once its marker exists the newer step wins.
    marker = json.loads((good / checkpoint.MARKER).read_text())
    marker["step"] = 9
    (newer / checkpoint.MARKER).write_text(json.dumps(marker))
    assert checkpoint.latest(root) == newer


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_tp2_checkpoint_loads_at_tp1(tmp_path):
    """torchrun TP=2 trains 2 steps and saves; a TP=1 process loads it and gets the same loss (1e-5 rel),
    and one more AdamW step from the resharded moments gives the same loss as at TP=2."""
    port = _free_port()
    _run([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(port), str(WORKER), "tp2_save", str(tmp_path)])
    _run([PY, str(WORKER), "tp1_load", str(tmp_path)])
    tp2 = json.loads((tmp_path / "tp2_save.json").read_text())
    tp1 = json.loads((tmp_path / "tp1_load.json").read_text())
    assert (tp2["tp"], tp2["world_size"], tp1["tp"], tp1["world_size"]) == (2, 2, 1, 1)
    assert tp1["extra"] == {"step": 2, "saved_tp": 2}
    # Same seed, same model at any tp (CPU init splits one master weight).
    assert tp1["initial_loss"] == pytest.approx(tp2["initial_loss"], rel=1e-5)
    assert tp2["loss"] < tp2["initial_loss"]
    assert tp1["loss"] == pytest.approx(tp2["loss"], rel=1e-5)
    assert tp1["next_loss"] == pytest.approx(tp2["next_loss"], rel=1e-4)
