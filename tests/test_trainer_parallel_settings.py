"""A production run configures the trainer from settings alone: architecture, parallel layout,
precision, optimizer.

Contract pinned here:
- ``trainer.factory.model_config(settings)`` is the one mapping from the ``model``/``parallel``/
  ``precision`` sections to the model, and every setting of those sections reaches it;
  ``rtrl.sections.trainer.TrainConfig.from_settings`` is the one mapping of ``train`` and ``loss``.
- The architecture settings build what they say (RMSNorm, SwiGLU, GQA, QKV bias, tied embeddings,
  RoPE base) as a real megatron-core GPTModel.
- Gradient-norm clipping is on by default and clips like ``torch.nn.utils.clip_grad_norm_``.
- ``torchrun --nproc_per_node 2 -m trainer`` with a settings file asking TP=2 builds the sharded model
  from Kafka input and trains; one asking PP=2 (tied embeddings) trains through megatron's pipeline
  schedule, records the last stage's metrics from rank 0, and checkpoints what loads at PP=1; FP8 on a
  CPU machine fails with the clear Transformer Engine error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from confluent_kafka import Producer

from devservices.broker import free_port
from rtrl.errors import ConfigError
from rtrl.kafka import producer_config
from rtrl.sections.trainer import TrainConfig
from rtrl.settings import load_settings
from schemas.codec import encode_batch
from tests.dist.train_run import synthetic_batches
from tests.test_trainer_train import _to_micro
from trainer.factory import model_config
from trainer.train import clip_grad_norm

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ARCH = {
    "RTRL_MODEL__NUM_LAYERS": "2",
    "RTRL_MODEL__HIDDEN_SIZE": "64",
    "RTRL_MODEL__NUM_ATTENTION_HEADS": "4",
    "RTRL_MODEL__NUM_QUERY_GROUPS": "2",
    "RTRL_MODEL__FFN_HIDDEN_SIZE": "128",
    "RTRL_MODEL__NORMALIZATION": "RMSNorm",
    "RTRL_MODEL__ACTIVATION": "swiglu",
    "RTRL_MODEL__ROPE_BASE": "500000",
    "RTRL_MODEL__QKV_BIAS": "true",
    "RTRL_MODEL__LINEAR_BIAS": "false",
    "RTRL_MODEL__TIE_EMBEDDINGS": "true",
}


def test_every_model_parallel_precision_setting_reaches_the_model_config():
    """Every field of the three sections, set to a value other than its default, arrives unchanged in the
    model and precision configs (0 = derived values resolve when left at their defaults)."""
    values = {
        "model": {
            "num_layers": 4,
            "hidden_size": 128,
            "num_attention_heads": 8,
            "num_query_groups": 2,
            "head_dim": 32,
            "ffn_hidden_size": 320,
            "vocab_size": 512,
            "vocab_multiple": 128,
            "seq_length": 96,
            "normalization": "RMSNorm",
            "norm_eps": 1e-6,
            "activation": "swiglu",
            "position_embedding_type": "learned_absolute",
            "rope_base": 500000.0,
            "rope_scaling_factor": 8.0,
            "tie_embeddings": True,
            "qkv_bias": True,
            "linear_bias": False,
            "qk_layernorm": True,
            "hidden_dropout": 0.1,
            "attention_dropout": 0.2,
            "init_method_std": 0.01,
            "seed": 7,
        },
        "parallel": {"tp": 2, "pp": 2, "dp": 3, "sequence_parallel": True},
        "precision": {"bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise"},
    }
    defaults = load_settings(env={})
    for section, kv in values.items():
        # model.hf_path replaces the shape settings by a checkpoint's: tests/test_hf_convert.py
        # (test_hf_path_setting_builds_that_model_with_its_weights) covers it; rope_scaling needs rope: below
        covered = set(kv) | ({"hf_path", "rope_scaling"} if section == "model" else set())
        assert covered == set(type(getattr(defaults, section)).model_fields), f"{section}: test every field"
        assert all(getattr(getattr(defaults, section), k) != v for k, v in kv.items()), f"{section}: non-defaults"
    env = {
        f"RTRL_{sec.upper()}__{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
        for sec, kv in values.items()
        for k, v in kv.items()
    }
    cfg, precision = model_config(load_settings(env=env))
    for section, obj in (("model", cfg), ("parallel", cfg.parallel), ("precision", precision)):
        for key, want in values[section].items():
            assert getattr(obj, key) == want, f"{section}.{key}"
    scaled, _ = model_config(load_settings(env={"RTRL_MODEL__ROPE_SCALING": "llama3"}))
    assert scaled.rope_scaling == "llama3" != defaults.model.rope_scaling
    default, default_precision = model_config(defaults)
    assert (default.ffn_hidden_size, default.num_query_groups, default.head_dim) == (0, 0, 0)  # 0 = derived:
    assert (default.ffn_width, default.kv_heads, default.kv_channels) == (4 * 64, 4, 64 // 4)
    assert default.parallel.dp == 0 and default_precision.fp8 == ""


def test_shape_errors_name_the_setting():
    with pytest.raises(Exception, match="model.num_attention_heads.*parallel.tp = 3"):
        model_config(load_settings(env={"RTRL_PARALLEL__TP": "3"}))
    with pytest.raises(Exception, match="parallel.sequence_parallel needs parallel.tp > 1"):
        load_settings(env={"RTRL_PARALLEL__SEQUENCE_PARALLEL": "true"})


def test_sequence_parallel_needs_the_transformer_engine_spec():
    """On megatron-core's local spec the norms cannot be split along the sequence: a clear error naming the
    setting, not megatron's bare AssertionError."""
    from trainer.model import build_model, init_parallel

    if torch.cuda.is_available():
        pytest.skip("a GPU machine may have Transformer Engine")
    cfg, precision = model_config(load_settings(env={}))
    init_parallel(cfg)
    sp = cfg.with_parallel(tp=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel needs the Transformer Engine layer spec"):
        build_model(sp, precision)


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"RTRL_MODEL__POSITION_EMBEDDING_TYPE": "learned_absolute", "RTRL_BATCHING__SEQ_LEN": "200"},
            "batching.seq_len = 200 gives 199 positions but model.seq_length = 64",
        ),
        (
            {"RTRL_PARALLEL__TP": "2", "RTRL_PARALLEL__SEQUENCE_PARALLEL": "true", "RTRL_BATCHING__SEQ_LEN": "128"},
            "127 positions must divide evenly over parallel.tp = 2",
        ),
        (
            {
                "RTRL_PRECISION__BF16": "true",
                "RTRL_PRECISION__FP8": "hybrid",
                "RTRL_BATCHING__ROWS": "3",
                "RTRL_BATCHING__SEQ_LEN": "128",
            },
            "3 x 127 tokens per micro-batch; FP8 GEMMs need a multiple of 8",
        ),
    ],
)
def test_micro_batch_shapes_are_checked_against_the_model(env, expected):
    from rtrl.sections.trainer import check_input_shapes

    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_input_shapes(load_settings(env=env))
    check_input_shapes(load_settings(env={}))
    check_input_shapes(
        load_settings(
            Path(__file__).resolve().parent.parent / "deploy" / "production.example.toml",
            env={"RTRL_SDK__SALT": "the-production-secret"},
        )
    )


@pytest.mark.slow
def test_sequence_parallel_gradients_are_summed_over_tensor_parallel_ranks(tmp_path):
    """Two tp ranks with rank-dependent gradients: the marked (sequence-parallel) ones become the sum on
    both ranks, the others are left alone."""
    script = str(Path(__file__).parent / "dist" / "sp_grads.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), script, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {r["rank"]: r for r in (json.loads(f.read_text()) for f in tmp_path.glob("rank*.json"))}
    assert set(out) == {0, 1}
    for rank, r in out.items():
        assert r["marked"] and set(r["marked"].values()) == {3.0}
        assert r["other"] == [float(rank + 1)]


def test_train_and_loss_sections_make_the_train_config():
    s = load_settings(
        env={
            "RTRL_TRAIN__LR": "0.0003",
            "RTRL_TRAIN__BETA2": "0.95",
            "RTRL_TRAIN__WEIGHT_DECAY": "0.1",
            "RTRL_TRAIN__WARMUP_STEPS": "5",
            "RTRL_LOSS__KL_COEF": "0.05",
            "RTRL_LOSS__IS_CAP": "3",
        }
    )
    tc = TrainConfig.from_settings(s, run_id="r", checkpoint_dir="/tmp/x")
    assert (tc.lr, (tc.beta1, tc.beta2), tc.weight_decay, tc.warmup_steps, tc.grad_clip) == (
        0.0003,
        (0.9, 0.95),
        0.1,
        5,
        1.0,
    )
    assert (tc.loss.kl_coef, tc.loss.is_cap, tc.run_id, tc.checkpoint_dir) == (0.05, 3.0, "r", "/tmp/x")
    with pytest.raises(TypeError, match="come from settings only"):
        TrainConfig.from_settings(s, lr=1.0)


def test_architecture_settings_build_that_model():
    """RMSNorm, SwiGLU, GQA, QKV bias without other biases, tied embeddings and the RoPE base, as a real
    megatron-core GPTModel on CPU."""
    from trainer.model import build_model, forward_logprobs, init_parallel

    cfg, precision = model_config(load_settings(env=ARCH))
    init_parallel(cfg)
    model = build_model(cfg, precision)
    params = dict(model.named_parameters())
    layer = model.decoder.layers[0]
    assert (
        type(layer.input_layernorm).__name__ in ("RMSNorm", "WrappedTorchNorm", "FusedLayerNorm")
        and "decoder.layers.0.input_layernorm.bias" not in params
    )  # RMSNorm has no bias
    assert params["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 128, 64)  # gate and up projections
    head_dim = 64 // 4
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * head_dim, 64)  # GQA
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in params
    assert "decoder.layers.0.mlp.linear_fc2.bias" not in params
    assert "output_layer.weight" not in params  # tied to the embedding
    inv_freq = model.rotary_pos_emb.inv_freq
    assert torch.allclose(inv_freq[1], torch.tensor(500000.0 ** (-2 / head_dim)), rtol=1e-4)
    tokens = torch.randint(0, 256, (2, 16))
    lp = forward_logprobs(model, tokens, torch.arange(16).expand(2, 16), tokens)
    assert lp.shape == (2, 16) and torch.isfinite(lp).all()


def test_gradient_clipping_is_on_by_default_and_matches_torch():
    assert load_settings(env={}).train.grad_clip == 1.0 and TrainConfig().grad_clip == 1.0
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8) * 100
    for m in (a, b):
        m(x).pow(2).sum().backward()
    before = clip_grad_norm(a, 1.0)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
    assert before == pytest.approx(float(want), rel=1e-6) and before > 1.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


def _settings_file(tmp_path: Path, broker, topic_prefix: str, **sections: dict) -> Path:
    doc = {
        "data_dir": str(tmp_path / "data"),
        "kafka": {"bootstrap": broker.bootstrap, "topic_prefix": topic_prefix},
        "train": {"steps": 3, "idle_timeout_s": 5.0, "run_id": "tp-run", "micro_batches_per_step": 2},
    } | sections
    lines = []
    for k, v in doc.items():
        if not isinstance(v, dict):
            lines.append(f"{k} = {json.dumps(v)}")
    for sec, kv in doc.items():
        if isinstance(kv, dict):
            lines.append(f"[{sec}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in kv.items()]
    f = tmp_path / "rtrl.toml"
    f.write_text("\n".join(lines) + "\n")
    return f


def _torchrun(config: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            TORCHRUN,
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            "-m",
            "trainer",
            "--config",
            str(config),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 128,
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "qkv_bias": True,
    "linear_bias": False,
}


def _produce_batches(broker, topic_prefix: str, n: int = 6) -> None:
    p = Producer(producer_config(broker.bootstrap))
    for b in synthetic_batches(n):
        p.produce(topic_prefix + "batches", value=encode_batch(_to_micro(b)), key=b.batch_id.encode(), partition=0)
    assert p.flush(10) == 0


def _load_at_one_rank(config: Path, ckpt: Path, layout: str, probe: str) -> list[str]:
    """Load ``ckpt`` into the settings' architecture with ``parallel.<layout> = 1`` in a fresh process, next
    to a freshly initialised copy (``init``; the loaded one is ``m``); ``probe`` prints what to check after
    the word 'moved'. Returns the printed words."""
    code = (
        "import torch\n"
        "from rtrl.settings import load_settings\n"
        "from trainer.factory import model_config\n"
        "from trainer.model import init_parallel, build_model\n"
        "from trainer import checkpoint\n"
        f"s = load_settings({str(config)!r}, env={{}}).updated({{'parallel.{layout}': 1}})\n"
        "cfg, prec = model_config(s); init_parallel(cfg)\n"
        "init, m = build_model(cfg, prec), build_model(cfg, prec)\n"
        f"checkpoint.load({str(ckpt)!r}, m, restore_rng=False)\n"
        + probe
        # tear the process group down before exit: left to interpreter shutdown, gloo's threads were seen
        # to abort the process once (after the probe had printed)
        + "import sys; sys.stdout.flush(); torch.distributed.destroy_process_group()\n"
    )
    check = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    return check.stdout.split("moved")[-1].split()


@pytest.mark.slow
def test_torchrun_tp2_from_a_settings_file_trains(broker, topic_prefix, tmp_path):
    """Two ranks, tensor parallel 2 (one data-parallel replica): every rank holds half of each sharded matrix,
    reads rtrl.batches from Kafka, takes 3 optimizer steps, writes train_metrics and a checkpoint that loads
    into the same architecture at TP=1 with trained (changed) weights."""
    _produce_batches(broker, topic_prefix)
    config = _settings_file(tmp_path, broker, topic_prefix, model=MODEL, parallel={"tp": 2})
    proc = _torchrun(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "tp 2 pp 1 dp 1" in proc.stdout and "RMSNorm, swiglu" in proc.stdout
    assert "trained 3 steps" in proc.stdout
    ckpt = tmp_path / "data" / "checkpoints" / "step_000000003"
    assert (ckpt / "COMPLETE").exists()
    # the TP=2 checkpoint is the configured architecture: it loads into it at TP=1, and training moved it
    moved, fc1 = _load_at_one_rank(
        config,
        ckpt,
        "tp",
        "d = max((a - b).abs().max().item() for a, b in zip(init.parameters(), m.parameters()))\n"
        "print('moved', d, m.decoder.layers[0].mlp.linear_fc1.weight.shape[0])\n",
    )
    assert float(moved) > 0 and int(fc1) == 2 * 128


@pytest.mark.slow
def test_torchrun_pp2_from_a_settings_file_trains(broker, topic_prefix, tmp_path):
    """Two ranks, pipeline parallel 2 (one data-parallel replica) with tied embeddings: the first stage holds
    the embedding and layer 0, the last layer 1 and the output layer (a copy of the embedding). Both read
    rtrl.batches from Kafka and take 3 optimizer steps through megatron's 1F1B schedule; rank 0 (the first
    stage, which computes no loss) records the last stage's metrics in train_metrics; the checkpoint loads
    into the same architecture at PP=1 with trained (changed) weights."""
    _produce_batches(broker, topic_prefix)
    model = MODEL | {"tie_embeddings": True}
    config = _settings_file(tmp_path, broker, topic_prefix, model=model, parallel={"pp": 2})
    proc = _torchrun(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "tp 1 pp 2 dp 1" in proc.stdout and "RMSNorm, swiglu" in proc.stdout
    assert "trained 3 steps" in proc.stdout
    ckpt = tmp_path / "data" / "checkpoints" / "step_000000003"
    assert (ckpt / "COMPLETE").exists()
    # rank 0 wrote the metrics the last stage computed (a first stage alone would count 0 tokens)
    dsn = load_settings(config, env={}).clickhouse_dsn
    dump = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import json; from rtrl import clickhouse\n"
                f"ch = clickhouse.connect({dsn!r})\n"
                "print(json.dumps(ch.query('SELECT step, batch_ids, tokens, loss, kl, on_policy_fraction FROM "
                "rtrl.train_metrics FINAL ORDER BY step').result_rows, default=str))"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dump.returncode == 0, dump.stderr[-3000:]
    rows = json.loads(dump.stdout.strip().splitlines()[-1])
    assert [r[0] for r in rows] == [1, 2, 3]
    assert [r[1] for r in rows] == [["b000", "b001"], ["b002", "b003"], ["b004", "b005"]]
    assert all(r[2] > 0 and r[3] != 0 and 0 < r[5] <= 1 for r in rows)
    assert rows[-1][4] > 0  # the policy moved away from the reference
    # The PP=2 checkpoint is the configured architecture: it loads into it at PP=1. The first stage draws
    # the embedding and layer 0 exactly as a whole model does (same seed, same order), so a change there
    # is training; layer 1 comes from the last stage.
    moved, n_params, untied_output, fc1 = _load_at_one_rank(
        config,
        ckpt,
        "pp",
        "a, b = dict(init.named_parameters()), dict(m.named_parameters())\n"
        "first = [k for k in a if k.startswith(('embedding.', 'decoder.layers.0.'))]\n"
        "d = max((a[k] - b[k]).abs().max().item() for k in first)\n"
        "print('moved', d, len(a), 'output_layer.weight' in a, b['decoder.layers.1.mlp.linear_fc1.weight'].shape[0])\n",
    )
    assert 0 < float(moved) < 1 and untied_output == "False" and int(fc1) == 2 * 128


@pytest.mark.slow
def test_fp8_on_a_cpu_machine_fails_with_the_clear_error(broker, topic_prefix, tmp_path):
    """FP8 asked for in a settings file, no Transformer Engine: the trainer job stops with the TE error
    (megatron-core would otherwise train in bf16 silently)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine may have Transformer Engine")
    config = _settings_file(
        tmp_path,
        broker,
        topic_prefix,
        precision={"bf16": True, "fp8": "hybrid"},
        model={"hidden_size": 64, "ffn_hidden_size": 256},
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(config)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "precision.fp8 = 'hybrid' needs NVIDIA Transformer Engine" in proc.stderr
