"""LoRA adapters on the megatron GPTModel (``trainer/lora/``), on real models built from ``ModelSettings`` on CPU
and real ``transformers`` + ``peft`` models; nothing is mocked.

Contracts checked here:

- ``LoraConfig`` refuses bad ``adapters.rank``, ``adapters.alpha``, ``adapters.targets`` (naming the allowed
  targets) and ``adapters.dropout`` with a ConfigError naming the setting; ``scale = alpha / rank``.
- A fresh adapter (``B = 0``) leaves the logits bit-for-bit unchanged; a non-zero ``B`` changes them; with no
  adapter active (or after the ``activate`` context) the model is the base again, bit for bit. Init is seeded
  by (seed, name): same seed and name, same adapter. Adapters are invisible to the base model's
  ``state_dict``/``sharded_state_dict``/``load_state_dict``. Sequence parallelism is refused.
- Training: after AdamW steps on a real loss (``forward_logprobs``) only the trained adapter changed; every
  base tensor and the other adapter on the same model are ``torch.equal`` to before.
- Tensor parallelism (slow, torchrun, gloo): at tp = 2 the logits with a non-zero adapter, the loss, the full
  adapter gradients, their global norm (``trainer.train.clip_grad_norm``: shards counted once), the adapter after
  one AdamW step and its PEFT export equal tp = 1's within fp32 rounding (1e-6; logits 1e-5); ``load_peft`` of
  the tp = 2 export at tp = 2 is bit-exact; the adapter checkpoint written at tp = 2 loads at tp = 1 (full
  tensors: tp-independent) bit-exactly.
- Checkpoints: save/load restores adapter, AdamW moments, step, base and extra exactly; a complete checkpoint
  is not overwritten; an unmarked folder is skipped by ``latest_adapter`` and replaced by a later save; a
  checkpoint of another base is refused. Slow: a training subprocess killed with SIGKILL inside a save (after
  the rename, before the marker) and again mid-run resumes each time from the newest complete checkpoint and
  ends with an adapter bit-exactly (``torch.equal``) equal to an uninterrupted run's (same data order, same
  process settings).
- PEFT: ``export_peft`` of a Llama and of a Qwen2 (QKV biases, 2 KV heads < 4 query heads) imported with
  ``trainer.hf.load.load_hf`` loads with ``peft.PeftModel.from_pretrained`` and gives the megatron+LoRA logits (fp32
  tolerance 1e-4, as tests/test_hf_convert.py); ``peft.LoraConfig.from_pretrained`` parses the config; the
  tensor names are what vLLM's LoRA loader reads (``base_model.model.`` prefix, ``.lora_A.weight`` /
  ``.lora_B.weight``, no biases, no embedding or lm_head); ``load_peft`` of the export is bit-exact, and
  unfusable folders (q/k/v with different A, q without k/v, DoRA) are refused. ``trainer.hf.export.export_hf`` of the
  base model with an adapter attached is still bit-exact to the source checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings
from tests.test_hf_convert import BASE, VOCAB  # noqa: E402
from trainer import lora
from trainer.factory import build
from trainer.model import causal_mask, forward_logprobs, init_parallel

ROOT = Path(__file__).resolve().parents[1]
TP_WORKER = ROOT / "tests" / "dist" / "lora_tp_worker.py"
TRAIN = ROOT / "tests" / "dist" / "lora_train.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
B, S = 2, 16


def tokens(vocab: int, seed: int = 0, b: int = B, s: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    return tok, torch.arange(s).expand(b, s).contiguous()


def logits(model, vocab: int) -> torch.Tensor:
    tok, pos = tokens(vocab)
    with torch.no_grad():
        return model(tok, pos, causal_mask(S))


def randomize_b(model, name: str, seed: int = 5, std: float = 0.05) -> None:
    state = lora.adapter_state_dict(model, name)
    g = torch.Generator().manual_seed(seed)
    lora.load_adapter_state_dict(
        model,
        name,
        {k: (std * torch.randn(v.shape, generator=g) if k.endswith("lora_B") else v) for k, v in state.items()},
    )


@pytest.fixture
def tiny():
    """A tiny megatron model (LayerNorm, GELU, biases: skip_bias_add on linear_proj and linear_fc2) in eval mode."""
    cfg = ModelSettings.tiny()
    init_parallel(cfg)
    return cfg, build(cfg).eval()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        (dict(rank=0), "adapters.rank"),
        (dict(rank=2.5), "adapters.rank"),
        (dict(alpha=0), "adapters.alpha"),
        (dict(alpha=True), "adapters.alpha"),
        (dict(targets=("linear_qkv", "q_proj")), "adapters.targets"),
        (dict(targets=()), "adapters.targets"),
        (dict(dropout=1.0), "adapters.dropout"),
        (dict(dropout=-0.1), "adapters.dropout"),
    ],
)
def test_config_errors_name_the_setting(kwargs, setting):
    with pytest.raises(ConfigError, match=re.escape(setting)) as e:
        lora.LoraConfig(**kwargs)
    if setting == "adapters.targets":
        assert all(t in str(e.value) for t in lora.TARGETS)  # the allowed names are listed
        if "q_proj" in kwargs["targets"]:
            assert "unknown 'q_proj'" in str(e.value)


def test_config_defaults_and_scale():
    cfg = lora.LoraConfig()
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.scale) == (8, 16.0, 0.0, 2.0)
    assert cfg.targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
    assert lora.LoraConfig(rank=4, alpha=2, targets=["linear_fc2"]).targets == ("linear_fc2",)  # type: ignore[arg-type]
    assert lora.LoraConfig(rank=4, alpha=2).scale == 0.5


# --------------------------------------------------------------------------- forward


def test_scaling_an_adapter_scales_its_term_and_touches_nothing_else(tiny):
    """``lora.scale_adapter`` (a refused re-validation's second try, app.adapters): every lora_B of that adapter
    times the factor, lora_A and the other adapters unchanged; on the output layer alone the logits' change from
    the base scales exactly by the factor (its term is linear in B and the last layer's input does not move), and
    a factor of 0 gives the base."""
    cfg, model = tiny
    base = logits(model, cfg.vocab_size)
    lora.add_adapter(model, "org-a", lora.LoraConfig(rank=4, targets=("output_layer",)), seed=1)
    lora.add_adapter(model, "org-b", lora.LoraConfig(rank=4), seed=2)
    randomize_b(model, "org-a")
    randomize_b(model, "org-b", seed=6)
    before_a, before_b = lora.adapter_state_dict(model, "org-a"), lora.adapter_state_dict(model, "org-b")
    with lora.activate(model, "org-a"):
        full = logits(model, cfg.vocab_size) - base
    lora.scale_adapter(model, "org-a", 0.5)
    after_a = lora.adapter_state_dict(model, "org-a")
    assert all(torch.equal(after_a[k], v * 0.5 if k.endswith("lora_B") else v) for k, v in before_a.items())
    assert all(torch.equal(v, before_b[k]) for k, v in lora.adapter_state_dict(model, "org-b").items())
    with lora.activate(model, "org-a"):
        half = logits(model, cfg.vocab_size) - base
    assert full.abs().max() > 1e-3 and torch.allclose(half, 0.5 * full, atol=1e-6)
    lora.scale_adapter(model, "org-a", 0.0)
    with lora.activate(model, "org-a"):
        assert torch.equal(logits(model, cfg.vocab_size), base)
    with pytest.raises(KeyError, match="no adapter 'nope'"):
        lora.scale_adapter(model, "nope", 0.5)


def test_zero_adapter_leaves_logits_unchanged_and_nonzero_changes_them(tiny):
    cfg, model = tiny
    base = logits(model, cfg.vocab_size)
    lora.add_adapter(model, "org-a", lora.LoraConfig(rank=4), seed=1)
    lora.add_adapter(model, "org-b", lora.LoraConfig(rank=2, targets=("linear_qkv", "linear_fc2")), seed=2)
    assert lora.adapter_names(model) == ["org-a", "org-b"] and lora.active_adapter(model) is None
    lora.activate(model, "org-a")
    assert lora.active_adapter(model) == "org-a"
    assert torch.equal(logits(model, cfg.vocab_size), base)  # B = 0: exactly the base
    state = lora.adapter_state_dict(model, "org-a")
    assert all(torch.count_nonzero(v) == 0 for k, v in state.items() if k.endswith("lora_B"))
    assert all(torch.count_nonzero(v) == v.numel() for k, v in state.items() if k.endswith("lora_A"))
    randomize_b(model, "org-a")
    with_a = logits(model, cfg.vocab_size)
    assert (with_a - base).abs().max() > 1e-3
    with lora.activate(model, None):  # base alone inside, org-a again after
        assert torch.equal(logits(model, cfg.vocab_size), base)
    assert lora.active_adapter(model) == "org-a" and torch.equal(logits(model, cfg.vocab_size), with_a)
    with lora.activate(model, "org-b"):  # zero B too
        assert torch.equal(logits(model, cfg.vocab_size), base)
    lora.remove_adapter(model, "org-a")
    assert lora.adapter_names(model) == ["org-b"] and lora.active_adapter(model) is None
    assert torch.equal(logits(model, cfg.vocab_size), base)
    with pytest.raises(KeyError, match="org-a"):
        lora.activate(model, "org-a")


def test_adapter_term_is_scale_b_a_x_on_each_linear(tiny):
    """The hook adds exactly alpha/rank * B(A(x)) to the linear's output and keeps its (output, bias) tuple."""
    cfg, model = tiny
    lora.add_adapter(model, "org", lora.LoraConfig(rank=3, alpha=6.0), seed=4)
    randomize_b(model, "org")
    x = torch.randn(5, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for name in ("self_attention.linear_qkv", "mlp.linear_fc1", "self_attention.linear_proj"):
        linear = model.decoder.layers[1].get_submodule(name)
        inp = x if name != "self_attention.linear_proj" else torch.randn(5, 2, linear.input_size)
        with lora.activate(model, None):
            out0, bias0 = linear(inp)
        with lora.activate(model, "org"):
            out1, bias1 = linear(inp)
        pair = linear.lora_adapters.adapters["org"]
        want = out0 + 2.0 * (inp @ pair.lora_A.T @ pair.lora_B.T)
        torch.testing.assert_close(out1, want, atol=1e-6, rtol=0)
        assert (bias0 is None) == (bias1 is None) == (not linear.skip_bias_add)
        if bias0 is not None:  # skip_bias_add: the bias still comes back apart, untouched
            assert torch.equal(bias0, bias1)
    assert model.decoder.layers[0].self_attention.linear_proj.skip_bias_add  # the case is exercised


def test_init_is_seeded_by_seed_and_name(tiny):
    cfg, model = tiny
    lora.add_adapter(model, "x", seed=9)
    first = lora.adapter_state_dict(model, "x")
    lora.remove_adapter(model, "x")
    lora.add_adapter(model, "x", seed=9)
    lora.add_adapter(model, "y", seed=9)
    again, other = lora.adapter_state_dict(model, "x"), lora.adapter_state_dict(model, "y")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(not torch.equal(first[k], other[k]) for k in first if k.endswith("lora_A"))
    a = first["decoder.layers.0.mlp.linear_fc1.lora_A"]
    assert a.shape == (8, cfg.hidden_size) and a.abs().max() <= 1 / cfg.hidden_size**0.5
    assert first["decoder.layers.0.mlp.linear_fc2.lora_A"].shape == (8, cfg.ffn_width)
    with pytest.raises(ConfigError, match="already exists"):
        lora.add_adapter(model, "x")
    with pytest.raises(ConfigError, match="adapter name"):
        lora.add_adapter(model, "a.b")


def test_adapters_are_invisible_to_the_base_state_dict(tiny):
    cfg, model = tiny
    keys = list(model.state_dict())
    sharded = sorted(model.sharded_state_dict())
    lora.add_adapter(model, "org", seed=1)
    assert list(model.state_dict()) == keys
    assert sorted(model.sharded_state_dict()) == sharded
    result = model.load_state_dict(model.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert any("lora_adapters" in n for n, _ in model.named_parameters())  # but they are parameters


def test_sequence_parallel_is_refused(tiny):
    cfg, model = tiny
    model.config.sequence_parallel = True  # what a TE-spec model with parallel.sequence_parallel has
    try:
        with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel"):
            lora.add_adapter(model, "org")
    finally:
        model.config.sequence_parallel = False
    assert lora.adapter_names(model) == []


# --------------------------------------------------------------------------- training


def test_only_the_active_adapter_changes_in_training():
    cfg = ModelSettings.tiny(normalization="RMSNorm", activation="swiglu", num_query_groups=2)
    init_parallel(cfg)
    model = build(cfg)
    lora.add_adapter(model, "org-a", lora.LoraConfig(rank=4), seed=1)
    lora.add_adapter(model, "org-b", lora.LoraConfig(rank=4), seed=2)
    randomize_b(model, "org-b", seed=3)
    base = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    a0, b0 = lora.adapter_state_dict(model, "org-a"), lora.adapter_state_dict(model, "org-b")
    lora.activate(model, "org-a")
    params = lora.train_only(model, "org-a")
    assert params == lora.adapter_parameters(model, "org-a") and len(params) == 2 * (4 * cfg.num_layers + 1)  # + output
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapters.org-a." in n for n in trainable)
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(3):
        tok, pos = tokens(cfg.vocab_size, seed=step, s=S + 1)
        loss = -forward_logprobs(model, tok[:, :-1], pos[:, :-1], tok[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    b1 = lora.adapter_state_dict(model, "org-b")
    assert all(torch.equal(b0[k], b1[k]) for k in b0)
    a1 = lora.adapter_state_dict(model, "org-a")
    assert all(not torch.equal(a0[k], a1[k]) for k in a0)  # A and B of every target moved
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- checkpoints


def _trained(cfg: ModelSettings, steps: int = 2):
    model = build(cfg)
    lora.add_adapter(model, "org", lora.LoraConfig(rank=4, targets=("linear_qkv", "linear_fc2")), seed=1)
    lora.activate(model, "org")
    opt = torch.optim.AdamW(lora.train_only(model, "org"), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        tok, pos = tokens(cfg.vocab_size, seed=step, s=S + 1)
        (-forward_logprobs(model, tok[:, :-1], pos[:, :-1], tok[:, 1:]).mean()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_checkpoint_save_load_latest(tmp_path):
    cfg = ModelSettings.tiny()
    init_parallel(cfg)
    model, opt = _trained(cfg)
    root = tmp_path / "ck"
    extra = {"offsets": {"rollouts/0": 17, "rollouts/1": 4}}
    p2 = lora.save_adapter(root, model, "org", step=2, base="base@v1", optimizer=opt, extra=extra)
    assert lora.latest_adapter(root) == p2 and not list(root.glob(".tmp-*"))
    with pytest.raises(FileExistsError, match="complete"):
        lora.save_adapter(root, model, "org", step=2, base="base@v1", optimizer=opt)

    fresh = build(cfg)
    lora.add_adapter(fresh, "other", seed=5)  # another org's adapter on the same base stays as it is
    other = lora.adapter_state_dict(fresh, "other")
    ck = lora.load_adapter(p2, fresh, "org", base="base@v1")  # adds the adapter with the checkpoint's config
    assert "org" in lora.adapter_names(fresh) and ck.step == 2
    opt2 = torch.optim.AdamW(lora.adapter_parameters(fresh, "org"), lr=0.5)
    ck = lora.load_adapter(p2, fresh, "org", opt2, base="base@v1")
    assert (ck.step, ck.base, ck.extra, ck.config) == (2, "base@v1", extra, lora.adapter_config(model, "org"))
    want, got = lora.adapter_state_dict(model, "org"), lora.adapter_state_dict(fresh, "org")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(v, lora.adapter_state_dict(fresh, "other")[k]) for k, v in other.items())
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["weight_decay"] == 0.1
    for p, q in zip(lora.adapter_parameters(model, "org"), lora.adapter_parameters(fresh, "org"), strict=True):
        s, t = opt.state[p], opt2.state[q]
        assert float(s["step"]) == float(t["step"]) == 2.0
        assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])

    with pytest.raises(ConfigError, match="base@v1"):
        lora.load_adapter(p2, build(cfg), "org", base="base@v2")

    # an interrupted save (renamed but not marked) of a later step is skipped, then replaced; a half-written
    # hidden folder is ignored, then cleaned up
    (root / ".tmp-step_000000010-dead").mkdir()
    (root / ".tmp-step_000000010-dead" / "state.json").write_text("{")
    p9 = root / "step_000000009"
    (root / "scratch").mkdir()
    os.rename(lora.save_adapter(root / "scratch", model, "org", step=9, base="base@v1"), p9)
    (p9 / "COMPLETE").unlink()
    assert lora.latest_adapter(root) == p2
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        lora.load_adapter(p9, fresh, "org")
    assert lora.save_adapter(root, model, "org", step=9, base="base@v1") == p9
    assert lora.latest_adapter(root) == p9 and lora.read_adapter_checkpoint(p9)["step"] == 9
    assert not list(root.glob(".tmp-*"))


def _run_until(args: list[str], env: dict, line_wanted: str) -> str:
    """Start ``lora_train.py args``, SIGKILL it as soon as it prints ``line_wanted``; return its output."""
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == line_wanted:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


@pytest.mark.slow  # four training subprocesses (a megatron import each)
def test_kill_9_resumes_from_newest_complete_checkpoint(tmp_path):
    """Killed once inside a save (its folder renamed into place, no COMPLETE yet) and once mid-run (right after
    a checkpoint, in the next step's training or save), the run ends with the uninterrupted run's adapter, bit
    for bit (same data order; same process settings, so the same float operations)."""
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    steps = "8"
    full = subprocess.run(
        [sys.executable, str(TRAIN), str(tmp_path / "a"), str(tmp_path / "a.safetensors"), steps],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert full.returncode == 0, full.stderr[-4000:]
    root, out = tmp_path / "b", tmp_path / "b.safetensors"
    args = [str(root), str(out), steps]

    _run_until([*args, "0", "4"], env, "renamed 4")  # hangs in the save of step 4, before its marker
    assert (root / "step_000000004" / "adapter.safetensors").is_file()
    assert not (root / "step_000000004" / "COMPLETE").exists()
    assert lora.latest_adapter(root) == root / "step_000000003"

    second = _run_until(args, env, "saved 6")  # resumes from 3 (replacing the unmarked 4), killed after 6
    assert "resumed 3" in second and "saved 4" in second
    killed_at = lora.latest_adapter(root)
    assert killed_at is not None and 6 <= lora.read_adapter_checkpoint(killed_at)["step"] <= 7
    assert not out.exists()

    again = subprocess.run(
        [sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = int(re.search(r"resumed (\d+)", again.stdout).group(1))  # type: ignore[union-attr]
    assert 6 <= resumed <= 7 and "saved 8" in again.stdout

    want, got = load_file(str(tmp_path / "a.safetensors")), load_file(str(out))
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)  # bit-exact
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in want.items() if k.endswith("lora_B"))  # trained


# --------------------------------------------------------------------------- tensor parallel


@pytest.mark.slow  # torchrun process group
def test_tp2_equals_tp1(tmp_path):
    from devservices.broker import free_port
    from tests.dist.lora_tp_worker import BASE, NAME, model_config, scenario

    out2 = tmp_path / "tp2"
    out2.mkdir()
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), str(TP_WORKER), str(out2)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    tp2 = torch.load(out2 / "result.pt")
    out1 = tmp_path / "tp1"
    tp1 = scenario(1, out1)
    torch.testing.assert_close(tp2["logits"], tp1["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(tp2["loss"], tp1["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(tp2["kl"], tp1["kl"], atol=1e-7, rtol=0)  # the full KL's vocabulary-parallel sums
    assert float(tp1["kl"]) > 1e-4  # the seeded adapter moves the model off the base: the KL term is not trivial
    for part in ("grads", "after"):
        assert sorted(tp2[part]) == sorted(tp1[part])
        for k in tp1[part]:
            torch.testing.assert_close(tp2[part][k], tp1[part][k], atol=1e-6, rtol=0, msg=f"{part} {k}")
    assert max(v.abs().max() for v in tp1["grads"].values()) > 1e-3  # the gradients are not trivially zero
    want_norm = torch.cat([g.flatten() for g in tp1["grads"].values()]).norm().item()
    assert tp2["norm"] == pytest.approx(want_norm, rel=1e-5) and tp1["norm"] == pytest.approx(want_norm, rel=1e-5)

    from safetensors.torch import load_file

    peft1, peft2 = (
        load_file(str(out1 / "peft" / "adapter_model.safetensors")),
        load_file(str(out2 / "peft" / "adapter_model.safetensors")),
    )
    assert sorted(peft1) == sorted(peft2) and len(peft1) == (2 * 7 + 1) * 2  # 2 layers x 7 modules, lm_head
    assert tp2["roundtrip"] is True and tp1["roundtrip"] is True  # load_peft at tp = 2 is bit-exact too
    for k in peft1:
        torch.testing.assert_close(peft2[k], peft1[k], atol=1e-6, rtol=0, msg=k)

    # the tp = 2 checkpoint loads at tp = 1
    model = build(model_config(1))
    lora.add_adapter(model, NAME, lora.LoraConfig(rank=4, alpha=8.0))
    opt = torch.optim.AdamW(lora.adapter_parameters(model, NAME), lr=1e-2)
    ck = lora.load_adapter(lora.latest_adapter(out2 / "ckpt"), model, NAME, opt, base=BASE)  # type: ignore[arg-type]
    assert ck.step == 1 and ck.extra == {"offsets": {"memory/0": 1}}
    loaded = lora.adapter_state_dict(model, NAME)
    assert all(torch.equal(loaded[k], tp2["after"][k]) for k in loaded)
    import json

    saved1 = json.loads((lora.latest_adapter(out1 / "ckpt") / "state.json").read_text())  # type: ignore[operator]
    assert saved1["optimizer"]["step"] == 1.0


# --------------------------------------------------------------------------- PEFT

HF_SHAPE = BASE | {"max_position_embeddings": 256}  # the conversion tests' tiny model, as tests/test_registry.py
VLLM_KEY = re.compile(
    r"^base_model\.model\.(model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|lm_head)"
    r"\.lora_[AB]\.weight$"
)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    made = {}
    for family, cls in (("llama", "LlamaConfig"), ("qwen2", "Qwen2Config")):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(**HF_SHAPE), attn_implementation="eager"
        ).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        made[family] = folder
    return made


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_export_matches_hf_peft_logits_and_round_trips(hf_folders, family, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from trainer.hf.config import config_from_hf
    from trainer.hf.export import export_hf

    folder = hf_folders[family]
    cfg = config_from_hf(folder, seq_length=S)
    assert cfg.qkv_bias == (family == "qwen2") and cfg.num_query_groups == 2
    init_parallel(cfg)
    model = build(cfg).eval()  # cfg.hf_path: trainer.hf.load.load_hf fills it
    lcfg = lora.LoraConfig(rank=4, alpha=12.0)
    lora.add_adapter(model, "org", lcfg, seed=3)
    randomize_b(model, "org", std=0.2)
    lora.activate(model, "org")
    ours = logits(model, VOCAB)[..., :VOCAB]
    out = lora.export_peft(model, cfg, "org", tmp_path / "peft", base_model_name_or_path=str(folder))

    pcfg = peft.LoraConfig.from_pretrained(str(out))
    assert (pcfg.r, pcfg.lora_alpha, pcfg.lora_dropout, pcfg.bias) == (4, 12.0, 0.0, "none")
    assert str(pcfg.task_type).endswith("CAUSAL_LM") and str(pcfg.peft_type).endswith("LORA")
    assert not pcfg.use_rslora and not pcfg.use_dora and not pcfg.fan_in_fan_out and not pcfg.modules_to_save
    assert sorted(pcfg.target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )
    assert pcfg.base_model_name_or_path == str(folder)

    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == (cfg.num_layers * 7 + 1) * 2 and all(VLLM_KEY.match(k) for k in tensors)
    assert not any("bias" in k or "embed" in k for k in tensors)
    d, kv = 64 // 4, 2
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (kv * d, 4)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, 96)
    # lm_head: the real vocabulary's rows only (megatron's output layer is padded to a multiple of 128)
    assert cfg.padded_vocab_size > cfg.vocab_size == VOCAB
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (VOCAB, 4)

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    tok, _ = tokens(VOCAB)
    with torch.no_grad():
        base = hf(input_ids=tok).logits
    peft_model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=tok).logits
    assert (theirs - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    # the base model's own export is unaffected by the adapters on it: bit-exact to the source checkpoint
    base_out = export_hf(model, cfg, tmp_path / "base")
    src, exported = load_file(str(folder / "model.safetensors")), load_file(str(base_out / "model.safetensors"))
    assert sorted(src) == sorted(exported) and all(torch.equal(src[k], exported[k]) for k in src)

    assert lora.load_peft(model, cfg, "again", out) == lcfg
    want, got = lora.adapter_state_dict(model, "org"), lora.adapter_state_dict(model, "again")
    # the output layer's padded vocabulary rows come back as zeros (their logits are masked: they never matter,
    # and training leaves them at their zero init)
    head = "output_layer.lora_B"
    assert torch.equal(got[head][VOCAB:], torch.zeros_like(got[head][VOCAB:]))
    want[head], got[head] = want[head][:VOCAB], got[head][:VOCAB]
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_output_layer_adapter_with_tied_embeddings():
    """With tied embeddings the output layer has no weight of its own: its adapter takes the shared weight's dtype
    and device, a new one leaves the logits unchanged and a trained one changes them."""
    cfg = ModelSettings.tiny(tie_embeddings=True)
    init_parallel(cfg)
    model = build(cfg).eval()
    assert model.output_layer.weight is None
    before = logits(model, cfg.vocab_size)
    lora.add_adapter(model, "org", lora.LoraConfig(rank=2, targets=("output_layer",)), seed=1)
    lora.activate(model, "org")
    assert torch.equal(logits(model, cfg.vocab_size), before)
    randomize_b(model, "org")
    assert (logits(model, cfg.vocab_size) - before).abs().max() > 1e-3
    assert list(lora.adapter_state_dict(model, "org")) == ["output_layer.lora_A", "output_layer.lora_B"]


def test_output_layer_adapter_trains_the_real_vocabulary_only(hf_folders):
    """The output layer's adapter (lm_head) adds its term before the padded-vocabulary mask: the padding rows keep
    their masked logit, get no gradient and stay at their zero init through AdamW steps, while the real rows
    train; so an export that cuts them off loses nothing."""
    from trainer.hf.config import config_from_hf
    from trainer.model import PADDED_LOGIT, forward_logprobs

    cfg = config_from_hf(hf_folders["llama"], seq_length=S)
    assert cfg.padded_vocab_size > cfg.vocab_size == VOCAB
    init_parallel(cfg)
    model = build(cfg)
    lora.add_adapter(model, "org", lora.LoraConfig(rank=4, targets=("output_layer",)), seed=1)
    lora.activate(model, "org")
    opt = torch.optim.AdamW(lora.train_only(model, "org"), lr=1e-2, weight_decay=0.1)
    tok, pos = tokens(VOCAB)
    for _ in range(3):
        opt.zero_grad()
        lp = forward_logprobs(model, tok, pos, torch.roll(tok, -1, 1), causal_mask(S))
        (-lp.mean()).backward()
        opt.step()
    head = lora.adapter_state_dict(model, "org")["output_layer.lora_B"]
    assert head.shape == (cfg.padded_vocab_size, 4)
    assert torch.count_nonzero(head[VOCAB:]) == 0 and torch.count_nonzero(head[:VOCAB]) > 0
    out = logits(model, VOCAB)
    assert torch.all(out[..., VOCAB:] == PADDED_LOGIT)


def test_load_peft_refuses_what_cannot_be_fused(hf_folders, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from trainer.hf.config import config_from_hf

    cfg = config_from_hf(hf_folders["llama"], seq_length=S)
    init_parallel(cfg)
    model = build(cfg)
    lora.add_adapter(model, "org", lora.LoraConfig(rank=2, targets=("linear_qkv", "linear_fc1")), seed=1)
    out = lora.export_peft(model, cfg, "org", tmp_path / "peft")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == [
        "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj",
    ]  # fmt: skip
    with pytest.raises(FileExistsError):
        lora.export_peft(model, cfg, "org", out)

    t = load_file(str(out / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    t[key] = t[key] + 1.0
    save_file(t, str(out / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="different lora_A"):
        lora.load_peft(model, cfg, "bad", out)

    c = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**c, "target_modules": ["q_proj", "v_proj"]}))
    with pytest.raises(ConfigError, match="k_proj"):
        lora.load_peft(model, cfg, "bad", out)
    (out / "adapter_config.json").write_text(json.dumps({**c, "use_dora": True}))
    with pytest.raises(ConfigError, match="use_dora"):
        lora.load_peft(model, cfg, "bad", out)
    assert lora.adapter_names(model) == ["org"]
    with pytest.raises(ConfigError, match="RMSNorm"):
        lora.export_peft(model, cfg.replace(normalization="LayerNorm"), "org", tmp_path / "x")
