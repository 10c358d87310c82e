"""FP8 (Transformer Engine) against bf16 training throughput of a ~1B-parameter GPTModel on one GPU.

Builds the trainer's own model (``rtrl.sections.trainer.ModelSettings`` -> ``trainer.model.build_model``; by
default 18 layers, hidden 2048, 16 heads, MLP 8192, seq 2048, vocab 32,768: about 1.04B parameters,
the exact count is printed) and times forward + backward + optimizer steps (``forward_logprobs``,
mean negative log-likelihood of random tokens, ``torch.optim.AdamW(fused=True)`` on the bf16
parameters) under

  (a) bf16: ``PrecisionSettings(bf16=True)``, and
  (b) FP8: ``PrecisionSettings(bf16=True, fp8="hybrid", fp8_recipe="delayed")`` (``--fp8``,
      ``--fp8-recipe`` change it) through Transformer Engine's layer spec.

Warm-up steps are not timed; the timed steps are bracketed by ``torch.cuda.synchronize()``.
Printed per precision: tokens/s, step time, peak memory and MFU, then the FP8/bf16 ratio (aim >= 1.3).

MFU = model FLOPs per token x tokens/s / peak dense bf16 FLOP/s of the GPU, with
model FLOPs per token = 6 * N + 12 * L * h * s, where N = parameters that take part in matmuls
(all parameters less the input word/position embedding tables, plus the output layer's V x h when
it is tied to the embedding), L layers, h hidden size, s sequence length (the 12*L*h*s attention
term counts full, not causal, attention, as in PaLM's appendix B). Peak: H100 SXM and H200
989 TFLOP/s (H100 PCIe 756); any other GPU needs ``--peak-tflops``. The FP8 run's MFU is also
against the bf16 peak, so the two MFUs compare directly.

Which layer spec runs: with Transformer Engine importable, both (a) and (b) use megatron's TE spec
(fused attention, TE linears), so the ratio isolates FP8. Without TE, (a) runs the local spec
(megatron's unfused attention; slower) and (b) is reported as not run: asking
``trainer.model.build_model`` for FP8 without TE is a hard error by design (megatron-core would
silently train in bf16). The exit code is then 3, after the bf16 half has run.

``--torch-scaled-mm`` adds a measurement that needs no TE, clearly labelled "not Transformer
Engine": ``torch._scaled_mm`` FP8 GEMMs (e4m3 forward; e5m2 gradients for ``hybrid``; tensor-wise
scales; bf16 out) against bf16 ``torch.matmul`` at this model's matmul shapes (QKV, attention
projection, MLP in/out, output layer; forward, data-gradient and weight-gradient shapes), weighted
as one training step's GEMMs, with and without the bf16->FP8 casts (amax + scale + cast of both
operands). It says how much of the ratio FP8 GEMMs can give on this GPU, not what TE training gives.

Usage::

    python bench/gpu_fp8.py                       # bf16 and FP8 (TE), default ~1B model
    python bench/gpu_fp8.py --torch-scaled-mm     # ... plus the torch._scaled_mm GEMM comparison
    python bench/gpu_fp8.py --only-scaled-mm      # only the GEMM comparison (no megatron needed)
    python bench/gpu_fp8.py --layers 24 --vocab 50304 --micro-batch 2 --steps 20
    python bench/gpu_fp8.py --dry-run-cpu         # no GPU: build a small variant on CPU, check the
                                                  # parameter count formula, run 2 steps
    python bench/gpu_fp8.py --new-hf-qwen /tmp/q1b  # write a random Qwen2-shaped ~1.2B Hugging Face
                                                  # checkpoint there, then time it imported through
                                                  # trainer/hf/ (``--hf DIR`` times an existing one)

With ``--hf DIR`` (or ``--new-hf-qwen DIR``) the model is the Hugging Face checkpoint imported through
``trainer.hf`` (``model.hf_path``'s path: config.json -> ModelSettings, weights read per tensor-parallel rank into
the TE spec on a GPU); its shape flags are ignored, MFU counts the built model's matmul parameters (SwiGLU, the
padded vocabulary). The device machine also needs the ``safetensors`` cp312 wheel in ``.whl`` (step 1).
Exit codes: 0 all requested measurements ran; 2 no CUDA device (and no ``--dry-run-cpu``); 3 the FP8
(TE) half was requested but could not run (the reason is printed).

Running it on a lent H200 (the project's device tool; see ``/work/shared/DESIGN.md``, "GPU checks
on a lent H200", and the tool's README). The machine's image has Python 3.12, torch 2.11 (CUDA 13),
numpy, packaging, psutil and einops, but neither megatron-core nor Transformer Engine, and it
cannot download anything; one call carries at most 64 MiB (working tree included).

1. Here, once: ``echo /.whl/ >> .git/info/exclude`` and fetch megatron-core for cp312 (~2.4 MB)::

       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
           --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
           --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 safetensors  # safetensors: --hf

   (the trainer imports only ``rtrl.errors`` from this repo's package, so nothing else is needed
   for this script).
2. One device call, ``carry: [".whl"]``, ``timeout_s`` ~ 420::

       python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
         && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \\
         && python3 bench/gpu_fp8.py --torch-scaled-mm 2>&1 | tee $OUT/gpu_fp8.log

   Without TE this gives the bf16 tokens/s and MFU of the ~1B model, "FP8 (TE): not run", and the
   ``torch._scaled_mm`` FP8-vs-bf16 GEMM figures (exit 3). Budget: imports ~10 s, model build a few s,
   each half ~1 min at the defaults.
3. FP8 through TE needs three wheels: ``transformer_engine`` (meta, small), ``transformer_engine_cu13``
   (the core library, ~277 MB) and ``transformer_engine_torch``, which PyPI ships only as source that
   must be compiled against CUDA, cuDNN and NCCL headers (many minutes of the device budget). The
   core wheel does not fit in one call: split it (``split -b 55M``) into ignored folders carried one
   per call (``.te1``, ``.te2``, ... — files left in ignored folders stay on a *warm* machine between
   calls), reassemble with ``cat`` on the last call, build ``transformer_engine_torch`` there and
   return its wheel through ``$OUT`` for later sessions. At 15 minutes of device time per task this
   does not fit alongside the measurement; an image with TE preinstalled (NGC PyTorch) does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

PEAK_BF16_DENSE = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12}  # FLOP/s, dense, no sparsity


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int
    tied: bool = False
    position: str = "rope"


def analytic_params(s: Shape) -> dict[str, int]:
    """Parameters of megatron's GPTModel (LayerNorm with bias, linear biases on, no GLU)."""
    d = s.hidden // s.heads
    qkv_out = s.hidden + 2 * s.kv_heads * d
    per_layer = (
        2 * s.hidden  # input LayerNorm
        + s.hidden * qkv_out
        + qkv_out  # QKV
        + s.hidden * s.hidden
        + s.hidden  # attention output projection
        + 2 * s.hidden  # pre-MLP LayerNorm
        + s.hidden * s.ffn
        + s.ffn  # fc1
        + s.ffn * s.hidden
        + s.hidden  # fc2
    )
    word = s.vocab * s.hidden
    pos = s.seq * s.hidden if s.position == "learned_absolute" else 0
    output = 0 if s.tied else s.vocab * s.hidden
    total = word + pos + s.layers * per_layer + 2 * s.hidden + output
    matmul = total - word - pos + (s.vocab * s.hidden if s.tied else 0)
    return {"total": total, "matmul": matmul, "embedding": word + pos}


def flops_per_token(s: Shape, matmul_params: int) -> float:
    """6 * N (forward + backward matmuls) + 12 * L * h * s (attention scores and values, full)."""
    return 6.0 * matmul_params + 12.0 * s.layers * s.hidden * s.seq


def peak_flops(name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for key, value in PEAK_BF16_DENSE.items():  # "H100 PCIe" before "H100"
        if all(part in name for part in key.split()):
            return value
    return None


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_steps(cfg, precision, shape: Shape, micro_batch: int, warmup: int, steps: int, device) -> dict:
    """Build the model under ``precision`` and time ``steps`` optimizer steps after ``warmup``."""
    import torch

    from trainer.factory import build
    from trainer.model import forward_logprobs, layer_spec

    spec = layer_spec(precision)
    qkv = spec.submodules.self_attention.submodules.linear_qkv
    qkv = getattr(qkv, "module", qkv)
    spec_name = "TE" if getattr(qkv, "__name__", "").startswith("TE") else "local"
    model = build(cfg, precision)  # with cfg.hf_path: the checkpoint's weights, through trainer.hf.load
    n_params = sum(p.numel() for p in model.parameters())
    # parameters in matmuls: 2-D weights less the input embedding table, plus the output layer when tied to it
    tied = getattr(cfg, "tie_embeddings", False)
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n) + (
        sum(p.numel() for n, p in model.named_parameters() if "word_embeddings" in n) if tied else 0
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (micro_batch, shape.seq + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(shape.seq, device=device).expand(micro_batch, -1).contiguous()

    def step() -> torch.Tensor:
        lp = forward_logprobs(model, inputs, positions, targets)  # None mask = plain causal
        loss = -lp.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    _sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    t_all = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        _sync()
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - t_all
    out = {
        "spec": spec_name,
        "params": n_params,
        "matmul_params": matmul_params,
        "tokens_per_s": steps * micro_batch * shape.seq / total,
        "step_ms_median": statistics.median(times) * 1e3,
        "loss": loss.item(),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
    }
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def gemm_shapes(s: Shape, tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(name, M, K, N, count per training step) of every GEMM: forward, data grad, weight grad."""
    d = s.hidden // s.heads
    linears = [
        ("qkv", s.hidden, s.hidden + 2 * s.kv_heads * d, s.layers),
        ("proj", s.hidden, s.hidden, s.layers),
        ("fc1", s.hidden, s.ffn, s.layers),
        ("fc2", s.ffn, s.hidden, s.layers),
        ("output", s.hidden, s.vocab, 1),
    ]
    out = []
    for name, k_in, n_out, count in linears:
        out.append((f"{name} fwd", tokens, k_in, n_out, count))
        out.append((f"{name} dgrad", tokens, n_out, k_in, count))
        out.append((f"{name} wgrad", k_in, tokens, n_out, count))
    return out


def scaled_mm_bench(s: Shape, tokens: int, fp8_format: str, iters: int = 20, device: str = "cuda") -> dict:
    """torch._scaled_mm FP8 GEMMs against bf16 matmuls at the model's shapes (not Transformer Engine)."""
    import torch

    dev = torch.device(device)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    g = torch.Generator(device=dev).manual_seed(0)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        _sync()
        if dev.type != "cuda":  # --dry-run-cpu exercises the code path only
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) / iters
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters / 1e3  # s

    def to_fp8(x, dtype):
        amax = x.abs().amax().float().clamp(min=1e-12)
        scale = torch.finfo(dtype).max / amax
        return (x.float() * scale).to(dtype), scale.reciprocal()

    rows, total = [], {"bf16": 0.0, "fp8": 0.0, "fp8_cast": 0.0, "flops": 0.0}
    for name, m, k, n, count in gemm_shapes(s, tokens):
        if m % 16 or k % 16 or n % 16:
            rows.append((name, m, k, n, count, float("nan"), float("nan"), float("nan")))
            print(f"  {name}: {m}x{k}x{n} skipped (FP8 GEMMs need multiples of 16)")
            continue
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        b_t = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g)  # b = b_t.T: column-major
        grad_side = fp8_format == "hybrid" and not name.endswith("fwd")
        # hybrid: gradients in e5m2 (dgrad: grad x W; wgrad: X^T x grad); e5m2 x e5m2 is never needed
        a_dtype = e5m2 if grad_side and name.endswith("dgrad") else e4m3
        b_dtype = e5m2 if grad_side and name.endswith("wgrad") else e4m3
        a8, sa = to_fp8(a, a_dtype)
        b8_t, sb = to_fp8(b_t, b_dtype)
        b, b8 = b_t.t(), b8_t.t()
        t_bf16 = timed(lambda: torch.matmul(a, b))
        t_fp8 = timed(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))

        def cast_and_mm():
            x8, sx = to_fp8(a, a_dtype)
            w8_t, sw = to_fp8(b_t, b_dtype)
            return torch._scaled_mm(x8, w8_t.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)

        t_cast = timed(cast_and_mm)
        flops = 2.0 * m * k * n
        rows.append((name, m, k, n, count, flops / t_bf16 / 1e12, flops / t_fp8 / 1e12, flops / t_cast / 1e12))
        total["bf16"] += count * t_bf16
        total["fp8"] += count * t_fp8
        total["fp8_cast"] += count * t_cast
        total["flops"] += count * flops
        del a, b_t, a8, b8_t
    torch.cuda.empty_cache()
    return {"rows": rows, "total": total}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="FP8 (Transformer Engine) vs bf16 training throughput of a ~1B GPTModel "
        "on one GPU; see the module docstring for how to run it on a lent GPU."
    )
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention KV heads (default: = heads)")
    ap.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per step (tokens/step = micro-batch x seq)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per precision")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    ap.add_argument("--fp8", choices=("hybrid", "e4m3"), default="hybrid")
    ap.add_argument("--fp8-recipe", choices=("delayed", "tensorwise", "mxfp8", "blockwise"), default="delayed")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument(
        "--torch-scaled-mm",
        action="store_true",
        help="also measure torch._scaled_mm FP8 GEMMs vs bf16 GEMMs at the model's shapes (not TE)",
    )
    ap.add_argument("--only-scaled-mm", action="store_true", help="only the torch._scaled_mm GEMM comparison")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense bf16 TFLOP/s for MFU (default: 989 for H100 SXM / H200, 756 for H100 PCIe)",
    )
    ap.add_argument("--hf", metavar="DIR", help="time this Hugging Face checkpoint, imported through trainer/hf/")
    ap.add_argument(
        "--new-hf-qwen",
        metavar="DIR",
        help="first write a random Qwen2-shaped ~1.2B checkpoint (18 layers, hidden 2048, 16 heads, 2 KV, MLP 5632, "
        "vocab 151,936, tied, bf16) into DIR, then time it as --hf DIR",
    )
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="no GPU needed: build a small variant on CPU (fp32), check the parameter-count formula "
        "against the built model, run 2 steps, print the full config's plan",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.new_hf_qwen:
        args.hf = write_qwen(args.new_hf_qwen, args.seq)
    if args.hf:
        from trainer.hf.config import config_from_hf

        c = config_from_hf(args.hf, seq_length=args.seq)
        args.layers, args.hidden, args.heads = c.num_layers, c.hidden_size, c.num_attention_heads
        args.kv_heads, args.ffn, args.vocab = (
            c.kv_heads,
            c.ffn_width,
            c.vocab_size,
        )
    ffn = args.ffn or 4 * args.hidden
    shape = Shape(args.layers, args.hidden, args.heads, ffn, args.vocab, args.seq, args.kv_heads or args.heads)
    plan = analytic_params(shape)
    tokens_per_step = args.micro_batch * args.seq
    print(
        f"model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads ({shape.kv_heads} KV), "
        f"MLP {shape.ffn}, vocab {shape.vocab}, seq {shape.seq}: {plan['total']:,} parameters by formula "
        f"({plan['matmul']:,} in matmuls); {tokens_per_step:,} tokens per step "
        f"({args.micro_batch} x {args.seq}); "
        f"FLOPs/token = 6*N + 12*L*h*s = {flops_per_token(shape, plan['matmul']):.4g}"
    )
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")

    if args.dry_run_cpu:
        return dry_run_cpu()
    if not torch.cuda.is_available():
        print(
            "error: no CUDA device. bench/gpu_fp8.py measures GPU training throughput (bf16 vs FP8); run it on "
            "an H100/H200 (how: the module docstring, `python bench/gpu_fp8.py --help`), or pass --dry-run-cpu "
            "to check the model-building path here.",
            file=sys.stderr,
        )
        return 2

    name = torch.cuda.get_device_name()
    peak = peak_flops(name, args.peak_tflops)
    print(
        f"GPU: {name}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB; peak dense bf16 "
        f"{'unknown (pass --peak-tflops)' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}"
    )
    rc = 0
    results: dict[str, dict] = {}
    if not args.only_scaled_mm:
        rc = model_runs(args, shape, peak, results)
    if args.torch_scaled_mm or args.only_scaled_mm:
        report_scaled_mm(shape, tokens_per_step, args.fp8)
    return rc


def model_runs(args, shape: Shape, peak: float | None, results: dict) -> int:

    from rtrl.sections.trainer import ModelSettings, PrecisionSettings, TransformerEngineMissing
    from trainer.model import init_parallel, transformer_engine_status

    te_ok, te_detail = transformer_engine_status()
    print(f"Transformer Engine: {'importable, ' + te_detail if te_ok else 'MISSING (' + te_detail + ')'}")
    if args.hf:  # the Hugging Face import path: the TE spec on a GPU, this rank's slices of each tensor
        from trainer.hf.config import config_from_hf

        cfg = config_from_hf(args.hf, seq_length=shape.seq)
        print(f"model from {args.hf} (trainer/hf/ import, {(cfg.hf_config or {}).get('model_type')})")
    else:
        cfg = ModelSettings(
            num_layers=shape.layers,
            hidden_size=shape.hidden,
            num_attention_heads=shape.heads,
            num_query_groups=args.kv_heads or 0,
            ffn_hidden_size=shape.ffn,
            vocab_size=shape.vocab,
            seq_length=shape.seq,
        )
    info = init_parallel(cfg)
    runs = []
    if not args.skip_bf16:
        runs.append(("bf16", PrecisionSettings(bf16=True)))
    if not args.skip_fp8:
        runs.append(
            (
                f"fp8 {args.fp8}/{args.fp8_recipe} (TE)",
                PrecisionSettings(bf16=True, fp8=args.fp8, fp8_recipe=args.fp8_recipe),
            )
        )
    rc = 0
    for label, precision in runs:
        try:
            r = train_steps(cfg, precision, shape, args.micro_batch, args.warmup, args.steps, info.device)
        except TransformerEngineMissing as e:
            print(f"{label}: NOT RUN - {e}")
            rc = 3
            continue
        matmul = r["matmul_params"] if args.hf else analytic_params(shape)["matmul"]
        fpt = flops_per_token(shape, matmul)
        mfu = None if peak is None else fpt * r["tokens_per_s"] / peak
        r["mfu"] = mfu
        results[label] = r
        print(
            f"{label}: {r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms_median']:.1f} ms (median), "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}, {r['params']:,} parameters (built), layer spec "
            f"{r['spec']}, peak memory {r['peak_mem_gib']:.1f} GiB, last loss {r['loss']:.3f}",
            flush=True,
        )
        if not args.hf and r["params"] != analytic_params(shape)["total"]:
            print(f"  note: built parameter count differs from the formula ({analytic_params(shape)['total']:,})")
    if len(results) == 2:
        bf16, fp8 = results.values()
        ratio = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        same_spec = "" if bf16["spec"] == fp8["spec"] else f" (bf16 ran the {bf16['spec']} spec: not like for like)"
        print(f"FP8/bf16 tokens/s ratio: {ratio:.3f}  aim >= 1.3: {'met' if ratio >= 1.3 else 'NOT met'}{same_spec}")
    return rc


def report_scaled_mm(shape: Shape, tokens: int, fp8_format: str) -> None:
    import torch

    if not hasattr(torch, "_scaled_mm"):
        print("torch._scaled_mm: not in this torch build")
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        print(f"torch._scaled_mm: FP8 GEMMs need compute capability >= 8.9, this GPU is {major}.{minor}")
        return
    r = scaled_mm_bench(shape, tokens, fp8_format)
    print(
        f"\nNOT Transformer Engine: torch._scaled_mm FP8 ({fp8_format}, tensor-wise scales, bf16 out) vs bf16 "
        f"torch.matmul at the model's GEMM shapes, {tokens:,} tokens; TFLOP/s (mean of 20 after 3 warm-ups)"
    )
    print(f"{'GEMM':14}{'M':>7}{'K':>7}{'N':>7}{'x/step':>7}{'bf16':>9}{'fp8':>9}{'fp8+cast':>10}")
    for name, m, k, n, count, tb, tf, tc in r["rows"]:
        print(f"{name:14}{m:>7}{k:>7}{n:>7}{count:>7}{tb:>9.0f}{tf:>9.0f}{tc:>10.0f}")
    t = r["total"]
    print(
        f"one step's GEMMs: bf16 {t['bf16'] * 1e3:.1f} ms, fp8 {t['fp8'] * 1e3:.1f} ms "
        f"(x{t['bf16'] / t['fp8']:.2f}), fp8 with casts {t['fp8_cast'] * 1e3:.1f} ms "
        f"(x{t['bf16'] / t['fp8_cast']:.2f}); "
        f"{t['flops'] / t['bf16'] / 1e12:.0f} / {t['flops'] / t['fp8'] / 1e12:.0f} / "
        f"{t['flops'] / t['fp8_cast'] / 1e12:.0f} TFLOP/s. GEMMs only: attention, norms, optimizer and "
        "TE's amax bookkeeping are not in these figures"
    )


def write_qwen(out: str, seq: int) -> str:
    """A random Qwen2-shaped ~1.2B checkpoint (bf16 on disk) in ``out`` through trainer/hf/, unless one is there."""
    from pathlib import Path

    from trainer.hf.config import config_from_hf, new_hf_config
    from trainer.hf.export import init_hf
    from trainer.model import init_parallel

    if (Path(out) / "config.json").is_file():
        print(f"using the checkpoint already in {out}")
        return out
    hf = new_hf_config(
        "qwen2",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=18,
        num_attention_heads=16,
        num_key_value_heads=2,
        intermediate_size=5632,
        max_position_embeddings=max(seq, 4096),
        rope_theta=1e6,
        tie_word_embeddings=True,
    ) | {"torch_dtype": "bfloat16"}
    t = time.perf_counter()
    init_parallel(config_from_hf(hf))
    init_hf(out, hf)
    print(f"wrote a random Qwen2-shaped checkpoint to {out} in {time.perf_counter() - t:.1f}s")
    return out


def dry_run_cpu() -> int:
    """Small variant on CPU through the same build + step path; checks the parameter-count formula."""

    from rtrl.sections.trainer import ModelSettings, PrecisionSettings, TransformerEngineMissing
    from trainer.model import init_parallel

    small = Shape(layers=2, hidden=128, heads=4, ffn=512, vocab=512, seq=128, kv_heads=4)
    cfg = ModelSettings(
        num_layers=small.layers,
        hidden_size=small.hidden,
        num_attention_heads=small.heads,
        ffn_hidden_size=small.ffn,
        vocab_size=small.vocab,
        seq_length=small.seq,
    )
    info = init_parallel(cfg)
    r = train_steps(cfg, PrecisionSettings(), small, micro_batch=2, warmup=1, steps=2, device=info.device)
    formula = analytic_params(small)["total"]
    ok = r["params"] == formula
    print(
        f"dry run (CPU, fp32, small variant {small.layers} layers, hidden {small.hidden}, vocab {small.vocab}, "
        f"seq {small.seq}): built {r['params']:,} parameters, formula {formula:,} -> "
        f"{'match' if ok else 'MISMATCH'}; layer spec {r['spec']}; {r['tokens_per_s']:,.0f} tokens/s on CPU "
        f"(not a GPU figure); loss {r['loss']:.3f}"
    )
    try:
        from trainer.model import build_model

        build_model(cfg, PrecisionSettings(bf16=True, fp8="hybrid"))
        print("FP8 request on CPU: built (unexpected)")
    except TransformerEngineMissing as e:
        print(f"FP8 request on CPU is refused as on a GPU without TE: {str(e)[:120]}...")
    import tempfile

    from trainer.hf.config import config_from_hf, new_hf_config
    from trainer.hf.export import init_hf

    with tempfile.TemporaryDirectory() as tmp:  # the --hf path: a tiny Qwen2 written, imported, trained 2 steps
        hf = new_hf_config(
            "qwen2",
            vocab_size=small.vocab,
            hidden_size=small.hidden,
            num_layers=small.layers,
            num_attention_heads=small.heads,
            num_key_value_heads=2,
            intermediate_size=small.ffn,
            max_position_embeddings=small.seq,
        )
        init_hf(f"{tmp}/q", hf)
        qcfg = config_from_hf(f"{tmp}/q", seq_length=small.seq)
        q = train_steps(qcfg, PrecisionSettings(), small, micro_batch=2, warmup=1, steps=2, device=info.device)
        print(
            f"--hf path on CPU (tiny Qwen2 through trainer/hf/): {q['params']:,} parameters, "
            f"{q['matmul_params']:,} in matmuls, loss {q['loss']:.3f}"
        )
    r = scaled_mm_bench(small, 256, "hybrid", iters=1, device="cpu")
    print(f"torch._scaled_mm path on CPU: {len(r['rows'])} GEMM shapes ran (timings meaningless on CPU)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
