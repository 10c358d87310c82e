"""Hugging Face <-> Megatron-Core conversion (``trainer/hf/``) on tiny randomly initialised Llama, Qwen2 and
Qwen3 models built from a config here (no hub access), saved with ``save_pretrained`` as safetensors.

- Logits of the Hugging Face model and of the imported megatron model agree within fp32 rounding for each
  family, tied and untied: Llama with llama3 RoPE scaling (which measurably matters at 64 positions), Qwen2
  with QKV biases, Qwen3 with QK-norm and a head width other than hidden / heads. The vocabulary (100) is
  padded to 128 and the padded logits are masked, so log-probs agree too.
- Import then export is bit-exact (every tensor ``torch.equal``, the config equal) and the exported folder
  loads with transformers and gives the same logits.
- A tensor-parallel load over 2 torchrun ranks (gloo) gives the TP=1 logits; each rank materialised only its
  slices (a wrapper around ``safe_open`` records them and fails on a whole-tensor read); the export gathers
  the shards bit-exactly. A pipeline-parallel load and export over 2 stages writes the index and two files.
- Unsupported configs are refused naming the field; the name tables cover the local spec's state dict and
  the Transformer Engine names megatron's own ``sharded_state_dict_keys_map`` maps the local spec to.
- ``model.hf_path`` through the settings builds that model with its weights; a shape setting that disagrees
  is refused naming both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from devservices.broker import free_port  # noqa: E402
from rtrl.errors import ConfigError  # noqa: E402
from rtrl.sections.trainer import ModelSettings, ParallelSettings  # noqa: E402
from rtrl.settings import load_settings  # noqa: E402
from trainer.factory import build, model_config  # noqa: E402
from trainer.hf.config import config_from_hf  # noqa: E402
from trainer.hf.export import export_hf  # noqa: E402
from trainer.hf.layout import name_table  # noqa: E402
from trainer.hf.load import load_hf  # noqa: E402
from trainer.model import causal_mask, forward_logprobs, init_parallel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "hf_tp_worker.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

VOCAB = 100  # not a multiple of 128: exercises the padding
B, S = 2, 64
BASE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters=LLAMA3, max_position_embeddings=131072)),
    "qwen2": ("Qwen2Config", dict(max_position_embeddings=4096, rope_parameters={"rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", dict(max_position_embeddings=4096, head_dim=32)),
}
CASES = [(f, t) for f in FAMILIES for t in (False, True)]
IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in CASES]


def hf_config(family: str, tie: bool = False, **extra):
    cls_name, fam = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**BASE, **fam, **extra}, tie_word_embeddings=tie)


def hf_model(family: str, tie: bool = False, **extra):
    """A random model with weights far from their init (norms around 1, biases non-zero), so a wrong
    mapping cannot hide behind near-zero tensors."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, tie, **extra), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, tied) -> (folder, HF model), each saved once."""
    made: dict = {}

    def get(family: str, tie: bool):
        if (family, tie) not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{int(tie)}")
            model = hf_model(family, tie)
            model.save_pretrained(folder)
            made[family, tie] = folder, model
        return made[family, tie]

    return get


def fixed_tokens(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)  # what tests/dist/hf_tp_worker.py feeds
    return torch.randint(0, vocab, (B, S), generator=g), torch.arange(S).expand(B, S).contiguous()


def megatron_logits(model, cfg: ModelSettings) -> torch.Tensor:
    tok, pos = fixed_tokens()
    model.eval()
    with torch.no_grad():
        return model(tok, pos, causal_mask(S))


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=fixed_tokens()[0]).logits


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# --------------------------------------------------------------------------- logits


@pytest.mark.parametrize(("family", "tie"), CASES, ids=IDS)
def test_logits_match_hugging_face(checkpoints, family, tie):
    """Same tokens, same logits (fp32 rounding) and log-probs: the padded vocabulary rows take no probability."""
    folder, hf = checkpoints(family, tie)
    cfg = config_from_hf(folder)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.tie_embeddings) == (VOCAB, 128, tie)
    assert (cfg.qkv_bias, cfg.qk_layernorm) == (family == "qwen2", family == "qwen3")
    assert cfg.head_dim == (32 if family == "qwen3" else 0) and cfg.norm_eps == 1e-6
    init_parallel(cfg)
    model = build(cfg)
    out = megatron_logits(model, cfg)
    ref = hf_logits(hf)
    assert out.shape == (B, S, 128)
    torch.testing.assert_close(out[..., :VOCAB], ref, atol=1e-4, rtol=0)
    tok, pos = fixed_tokens()
    with torch.no_grad():
        lp = forward_logprobs(model, tok[:, :-1], pos[:, :-1], tok[:, 1:])
    ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, tok[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_is_what_makes_them_agree(checkpoints):
    """The agreement above is not blind to RoPE: without the scaling, or with linear scaling, the logits differ."""
    folder, hf = checkpoints("llama", False)
    cfg = config_from_hf(folder)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_base) == ("llama3", 8.0, 500000.0)
    init_parallel(cfg)
    ref = hf_logits(hf)
    for other in ("", "linear"):
        out = megatron_logits(build(cfg.replace(rope_scaling=other)), cfg)
        assert (out[..., :VOCAB] - ref).abs().max() > 1e-2, other


def test_linear_rope_scaling_matches(tmp_path):
    """``rope_type = linear`` maps to megatron's position interpolation (positions / factor)."""
    hf = hf_model("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    hf.save_pretrained(tmp_path)
    cfg = config_from_hf(tmp_path)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor) == ("linear", 4.0)
    init_parallel(cfg)
    torch.testing.assert_close(megatron_logits(build(cfg), cfg)[..., :VOCAB], hf_logits(hf), atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize(("family", "tie"), CASES, ids=IDS)
def test_import_export_is_bit_exact_and_loads_in_transformers(checkpoints, family, tie, tmp_path):
    folder, hf = checkpoints(family, tie)
    cfg = config_from_hf(folder)
    init_parallel(cfg)
    out = export_hf(build(cfg), cfg, tmp_path / "export")
    want, got = tensors(folder), tensors(out)
    assert sorted(got) == sorted(want)
    assert "lm_head.weight" not in got if tie else "lm_head.weight" in got
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    assert (out / "generation_config.json").is_file()  # the source's other files come along
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert torch.equal(hf_logits(again), hf_logits(hf))


def test_export_refuses_a_non_empty_folder_and_a_model_without_hf_config(checkpoints, tmp_path):
    folder, _ = checkpoints("qwen2", False)
    cfg = config_from_hf(folder)
    init_parallel(cfg)
    model = build(cfg)
    (tmp_path / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(model, cfg, tmp_path)
    with pytest.raises(ConfigError, match="hf_config is None"):
        export_hf(model, cfg.replace(hf_config=None), tmp_path / "new")


def test_multi_query_attention_round_trip(tmp_path):
    """One KV head (one query group): logits agree and the export (q, k, v out of one group) is bit-exact."""
    hf = hf_model("qwen2", num_key_value_heads=1)
    hf.save_pretrained(tmp_path / "hf")
    cfg = config_from_hf(tmp_path / "hf")
    assert cfg.num_query_groups == 1
    init_parallel(cfg)
    model = build(cfg)
    torch.testing.assert_close(megatron_logits(model, cfg)[..., :VOCAB], hf_logits(hf), atol=1e-4, rtol=0)
    want, got = tensors(tmp_path / "hf"), tensors(export_hf(model, cfg, tmp_path / "out"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_sharded_checkpoint_with_an_index_loads(tmp_path):
    """``model.safetensors.index.json`` + several files (save_pretrained with a small max_shard_size)."""
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    cfg = config_from_hf(tmp_path)
    init_parallel(cfg)
    model = build(cfg)
    torch.testing.assert_close(megatron_logits(model, cfg)[..., :VOCAB], hf_logits(hf), atol=1e-4, rtol=0)
    report = load_hf(model, cfg)
    assert len(report.files) == len(list(tmp_path.glob("*.safetensors")))
    assert report.elements_read == report.elements_in_checkpoint == sum(p.numel() for p in hf.parameters())


# --------------------------------------------------------------------------- tensor and pipeline parallel


@pytest.mark.slow  # torchrun process groups
def test_tp2_load_reads_only_its_shards_and_matches_tp1(tmp_path):
    hf = hf_model("llama")
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="60KB")  # sharded, with an index
    out = tmp_path / "out"
    out.mkdir()
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), str(WORKER), str(src), str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]

    cfg = config_from_hf(src)
    init_parallel(cfg)
    tp1 = megatron_logits(build(cfg), cfg)[..., :VOCAB]
    tp2 = torch.load(out / "logits.pt")
    torch.testing.assert_close(tp2, tp1, atol=1e-5, rtol=0)
    torch.testing.assert_close(tp2, hf_logits(hf), atol=1e-4, rtol=0)

    full: dict[str, tuple[int, ...]] = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            full.update({n: tuple(h.get_slice(n).get_shape()) for n in h.keys()})
    size = {n: int(torch.tensor(s).prod()) for n, s in full.items()}
    per_rank = [json.loads((out / f"reads{r}.json").read_text()) for r in (0, 1)]
    read = {n: 0 for n in full}
    for rank in per_rank:
        # what the wrapper saw materialised is what the loader reports, at build and at load_hf
        assert rank["wrapper"] == rank["report"] == rank["build_wrapper"]
        assert rank["elements_in_checkpoint"] == sum(size.values())
        assert rank["elements_read"] < 0.6 * sum(size.values())
        for name, shape in rank["report"]:
            n = int(torch.tensor(shape).prod())
            read[name] += n
            if len(full[name]) == 2:  # every matrix is split: no rank reads one whole
                assert n < size[name], (name, shape)
    for name in full:  # each element of a matrix is read by exactly one rank; norms by both
        assert read[name] == size[name] * (1 if len(full[name]) == 2 else 2), name
    shapes = {n: s for n, s in per_rank[1]["report"]}
    assert shapes["model.embed_tokens.weight"] == [VOCAB - 64, 64]  # rows 64..99 of the padded 128
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [32, 64]  # query group 1: heads 2 and 3
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == [64, 32]

    want, got = tensors(src), tensors(out / "export")  # the TP=2 export gathered the shards
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.slow  # torchrun process groups
def test_pp2_load_and_export_write_one_file_per_stage(tmp_path):
    """Each pipeline stage loads its own layers (global numbers) and the last stage's copy of a tied embedding;
    the export writes one safetensors file per stage and the index, bit-exact."""
    hf = hf_model("qwen3", tie=True)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        TORCHRUN,
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(WORKER),
        str(src),
        str(out),
        "--pp",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    stages = [json.loads((out / f"stage{r}.json").read_text()) for r in (0, 1)]
    assert [s["layers"] for s in stages] == [[1], [2]]
    assert stages[1]["has_output_copy"] and stages[1]["padding_zero"]
    index = json.loads((out / "export" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["weight_map"]["model.layers.1.mlp.up_proj.weight"] == files[1]
    want, got = tensors(src), tensors(out / "export")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    again = transformers.AutoModelForCausalLM.from_pretrained(out / "export", attn_implementation="eager").eval()
    assert torch.equal(hf_logits(again), hf_logits(hf))


# --------------------------------------------------------------------------- config errors


def _dict(family: str = "llama", **changes) -> dict:
    d = hf_config(family).to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            lambda: transformers.Qwen3MoeConfig(num_hidden_layers=2).to_dict(),
            r"num_(local_)?experts = \d+ means mixture of experts",
        ),
        (lambda: _dict(model_type="mixtral", num_local_experts=8), r"num_local_experts = 8 means mixture of experts"),
        (lambda: _dict("qwen2", use_sliding_window=True, sliding_window=16), r"use_sliding_window = True"),
        (lambda: _dict("qwen3", layer_types=["full_attention", "sliding_attention"]), r"layer_types = "),
        (lambda: _dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), r"rope_type = 'yarn'"),
        (
            lambda: _dict(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_parameters=None),
            r"rope_type = 'dynamic'",
        ),
        (lambda: _dict(rope_parameters={**LLAMA3, "low_freq_factor": 2.0}), r"rope_parameters.low_freq_factor = 2.0"),
        (lambda: _dict(model_type="mistral"), r"model_type = 'mistral' is not supported"),
        (lambda: _dict(hidden_act="gelu"), r"hidden_act = 'gelu'"),
        (lambda: _dict(attention_bias=True), r"attention_bias = True without the other"),
        (lambda: _dict("qwen3", attention_bias=True), r"attention_bias = True cannot be represented"),
        (lambda: _dict(partial_rotary_factor=0.5), r"partial_rotary_factor = 0.5"),
        (lambda: _dict(num_hidden_layers=0), r"num_hidden_layers = 0 must be a positive integer"),
    ],
    ids=[
        "moe-qwen3",
        "moe-mixtral",
        "sliding-window",
        "sliding-layer-types",
        "rope-yarn",
        "rope-dynamic-v4-style",
        "rope-llama3-other-factors",
        "model-type",
        "activation",
        "llama-attention-bias-alone",
        "qwen3-attention-bias",
        "partial-rotary",
        "layers",
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(config, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf(config())


def test_transformers_4_style_config_is_read():
    """``rope_theta`` + ``rope_scaling`` at the top level (what checkpoints saved by transformers 4 hold)."""
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    cfg = config_from_hf(_dict(rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling))
    assert (cfg.rope_base, cfg.rope_scaling, cfg.rope_scaling_factor) == (500000.0, "llama3", 8.0)
    assert config_from_hf(_dict(rope_parameters=None, rope_scaling=None, rope_theta=1e4)).rope_scaling == ""


def test_vocab_padding_rule():
    """Up to a multiple of lcm(128, tp): the same for tp 1, 2, 4, ... (checkpoints reshard); no padding by default."""
    for tp in (1, 2):
        assert config_from_hf(_dict(), parallel=ParallelSettings(tp=tp)).padded_vocab_size == 128
    assert config_from_hf(_dict(vocab_size=129)).padded_vocab_size == 256
    assert config_from_hf(_dict(vocab_size=128)).padded_vocab_size == 128
    for tp in (4, 8):
        wide = ModelSettings.tiny(
            num_attention_heads=8, vocab_size=100, vocab_multiple=128, parallel=ParallelSettings(tp=tp)
        )
        assert wide.padded_vocab_size == 128
    odd = ModelSettings.tiny(
        hidden_size=96, num_attention_heads=6, ffn_hidden_size=384, vocab_size=100, vocab_multiple=128
    )
    assert odd.replace(parallel=ParallelSettings(tp=3)).padded_vocab_size == 384  # lcm(128, 3)
    assert ModelSettings.tiny().padded_vocab_size == 256 and ModelSettings.tiny(vocab_size=100).padded_vocab_size == 100
    with pytest.raises(ConfigError, match=r"model\.vocab_size = 100 must be divisible by parallel\.tp = 3"):
        odd.replace(vocab_multiple=0, parallel=ParallelSettings(tp=3))


# --------------------------------------------------------------------------- name tables


@pytest.mark.parametrize("family", FAMILIES)
def test_name_tables_cover_the_local_and_transformer_engine_specs(checkpoints, family):
    """The local table names exactly the model's tensors; the TE table names exactly the keys megatron's local spec
    writes to checkpoints (its ``sharded_state_dict_keys_map``: the names of the TE spec's fused norms), with
    layer numbers; both use exactly the checkpoint's HF tensors."""
    folder, _ = checkpoints(family, False)
    cfg = config_from_hf(folder)
    init_parallel(cfg)
    model = build(cfg.replace(hf_path=""))  # random weights: only names matter
    local, te = name_table(cfg, "local"), name_table(cfg, "te")
    assert set(local) == {k for k in model.state_dict() if not k.endswith("_extra_state")}
    te_names = set()
    for key, sh in model.sharded_state_dict().items():
        if key.endswith("_extra_state"):
            continue
        if key.startswith("decoder.layers."):
            layer = key.split(".")[2]
            te_names.add(sh.key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1))
        else:
            te_names.add(sh.key)
    assert set(te) == te_names
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    hf_names = set(tensors(folder))
    for table in (local, te):
        assert {h for rule in table.values() for h in rule.hf} == hf_names


# --------------------------------------------------------------------------- settings


def test_hf_path_setting_builds_that_model_with_its_weights(checkpoints):
    folder, hf = checkpoints("qwen2", True)
    settings = load_settings(env={"RTRL_MODEL__HF_PATH": str(folder), "RTRL_MODEL__SEED": "5"})
    cfg, _ = model_config(settings)
    want = config_from_hf(folder, seed=5)
    assert cfg == want and cfg.hf_path == str(folder) and cfg.seq_length == 4096
    init_parallel(cfg)
    model, reference = build(cfg), build(cfg)  # what trainer.run does: the policy and its KL reference
    for m in (model, reference):
        torch.testing.assert_close(megatron_logits(m, cfg)[..., :VOCAB], hf_logits(hf), atol=1e-4, rtol=0)
    # settings that agree with the checkpoint may be set; ones that disagree are refused naming both
    agree = {"RTRL_MODEL__HIDDEN_SIZE": "64", "RTRL_MODEL__NUM_QUERY_GROUPS": "2", "RTRL_MODEL__TIE_EMBEDDINGS": "true"}
    assert model_config(load_settings(env={"RTRL_MODEL__HF_PATH": str(folder), **agree}))[0].hidden_size == 64
    for key, value, field in (
        ("HIDDEN_SIZE", "128", "hidden_size"),
        ("VOCAB_SIZE", "256", "vocab_size"),
        ("TIE_EMBEDDINGS", "false", "tie_word_embeddings"),
        ("NORMALIZATION", "LayerNorm", "RMSNorm"),
        ("HEAD_DIM", "32", "head_dim"),
        ("NORM_EPS", "1e-05", "rms_norm_eps"),
        ("QK_LAYERNORM", "true", "model_type"),
        ("ROPE_SCALING", "linear", "rope_scaling"),
    ):
        env = {"RTRL_MODEL__HF_PATH": str(folder), f"RTRL_MODEL__{key}": value}
        with pytest.raises(ConfigError, match=rf"model\.{key.lower()} = .* disagrees with model\.hf_path.*{field}"):
            model_config(load_settings(env=env))
    env = {"RTRL_MODEL__HF_PATH": str(folder), "RTRL_MODEL__SEQ_LENGTH": "8192"}
    with pytest.raises(ConfigError, match=r"model\.seq_length = 8192 exceeds .*max_position_embeddings = 4096"):
        model_config(load_settings(env=env))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        model_config(load_settings(env={"RTRL_MODEL__HF_PATH": str(folder / "absent")}))
    wide = model_config(load_settings(env={"RTRL_MODEL__HF_PATH": str(folder), "RTRL_MODEL__VOCAB_MULTIPLE": "256"}))
    assert wide[0].padded_vocab_size == 256 and cfg.padded_vocab_size == 128  # 0 = 128 with a checkpoint
    default, _ = model_config(load_settings(env={}))
    assert default == ModelSettings.tiny() and default.hf_path == "" and default.hf_config is None


def test_checkpoint_tensors_must_fit_the_config(checkpoints, tmp_path):
    """A config.json that is not the checkpoint's own: unknown tensors or wrong shapes are named."""
    folder, _ = checkpoints("llama", False)
    cfg = config_from_hf(folder)
    init_parallel(cfg)
    wide = cfg.replace(ffn_hidden_size=128, hf_path="")
    with pytest.raises(
        ConfigError, match=r"do not fit its config.json: .*gate_proj.weight \(96, 64\) \(config: \(128, 64\)\)"
    ):
        load_hf(build(wide), wide, folder)
    qwen3 = config_from_hf(checkpoints("qwen3", False)[0])
    with pytest.raises(ConfigError, match=r"tensors have no place in this model \(.*q_norm"):
        load_hf(build(cfg.replace(hf_path="")), cfg, checkpoints("qwen3", False)[0])
    assert qwen3.qk_layernorm


@pytest.mark.slow  # a CLI subprocess per family
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rtrl_model_init_writes_a_checkpoint_transformers_loads(family, tmp_path):
    """`rtrl model init DIR --family F`: a random checkpoint of the loop's shape (the simulator's 32-token
    vocabulary, 64 positions) that transformers loads and whose logits equal the imported Megatron model's;
    a non-empty DIR is refused in one line."""
    out = tmp_path / family
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"RTRL_DATA_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "app.cli", "model", "init", str(out), "--family", family]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"RTRL_MODEL__HF_PATH={out} rtrl run" in " ".join(proc.stdout.split())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    assert hf.config.model_type == family and hf.config.vocab_size == 32 and hf.config.max_position_embeddings == 64
    cfg = config_from_hf(out)
    init_parallel(cfg)
    model = build(cfg)
    tok = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        ours = model(tok, torch.arange(16).expand(2, 16).contiguous(), causal_mask(16))[..., :32]
        theirs = hf(input_ids=tok).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stdout.startswith("error:") and len(again.stdout.splitlines()) == 1


def test_the_loop_refuses_a_checkpoint_whose_vocabulary_is_not_the_tasks(checkpoints):
    """`rtrl run` with model.hf_path: the simulator's tasks need its 32-token vocabulary; another checkpoint is one
    error naming the loop and the fix (not a disagreement with a model.vocab_size the user never set)."""
    from app.serving import loop_model_config

    folder, _ = checkpoints("qwen2", False)
    with pytest.raises(ConfigError, match=r"vocabulary of 100 tokens; the closed loop's tasks use the simulator's 32"):
        loop_model_config(load_settings(env={"RTRL_MODEL__HF_PATH": str(folder)}))
    relative = load_settings(env={"RTRL_MODEL__HF_PATH": "some/relative/folder"}).model.hf_path
    assert relative == os.path.abspath("some/relative/folder")  # every part of the loop finds the same folder


@pytest.mark.slow  # writes a checkpoint
def test_rtrl_model_init_writes_the_model_settings_it_was_given(tmp_path):
    """`rtrl model init` writes a set `model.norm_eps` and `model.head_dim` into config.json, so training that
    checkpoint with the same settings is not refused; a setting a plain config.json cannot hold is refused."""
    import argparse

    from rich.console import Console

    from app.cli_loop import cmd_model_init

    env = {"RTRL_DATA_DIR": str(tmp_path), "RTRL_MODEL__NORM_EPS": "1e-6", "RTRL_MODEL__HEAD_DIM": "32"}
    settings = load_settings(env=env)
    out = tmp_path / "qwen3"
    assert cmd_model_init(settings, argparse.Namespace(dir=str(out), family="qwen3", tie=False), Console()) == 0
    written = json.loads((out / "config.json").read_text())
    assert (written["rms_norm_eps"], written["head_dim"]) == (1e-6, 32)
    trained = load_settings(env=env | {"RTRL_MODEL__HF_PATH": str(out)})
    cfg, _ = model_config(trained)  # the same settings agree with the checkpoint's config.json
    assert (cfg.norm_eps, cfg.kv_channels) == (1e-6, 32)
    scaled = load_settings(env={"RTRL_DATA_DIR": str(tmp_path), "RTRL_MODEL__ROPE_SCALING": "llama3"})
    args = argparse.Namespace(dir=str(tmp_path / "scaled"), family="llama", tie=False)
    with pytest.raises(ConfigError, match=r"without model\.rope_scaling; fix: unset"):
        cmd_model_init(scaled, args, Console())
