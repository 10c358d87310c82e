"""Per-org LoRA adapters: serving throughput and memory with 1, 8 and 64 adapters loaded next to the base alone,
and an adapter's training tokens/s next to full training of the same model, all measured in the same run.

    .venv/bin/python bench/adapters.py [--rounds 6] [--hidden 256] [--layers 4] [--rank 8] [--loaded 1,8,64]
                                       [--requests 8] [--train-steps 6] [--threads 1] [--only serving|training]

The model: a small Llama-like megatron ``GPTModel`` (RMSNorm, SwiGLU, RoPE, no biases; by default hidden 256,
4 layers, 4 heads, FFN 704, vocab 2,048: 4.26M parameters, fp32), built once for serving and three more times
(policy, reference, adapter model) for training. Adapters: :mod:`trainer.lora`, rank ``--rank`` (alpha 2 x rank)
on the four targets of every layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``; not the
output layer, which ``adapters.targets`` adds by default, so the figures stay those of bench/RESULTS.md), with
non-zero ``B`` so they change the policy, each saved as an rtrl adapter checkpoint.

1. Serving. One :class:`simulator.openai_server.CompletionServer` over the one base, requests over HTTP through
   :class:`client.rollouts.CompletionsClient` (``--clients`` threads sending at once). Conditions, alternating
   within every round (the order rotates by one each round): the base alone (no adapter loaded, requests name the
   base), then 1, 8 and 64 adapters loaded through vLLM's runtime API (``POST /v1/load_lora_adapter``), each
   request's ``model`` drawn uniformly among the loaded adapters (S-LoRA-style traffic). Every condition sends
   the same ``--requests`` requests per round (``--prompts`` fixed prompts x ``n`` of ``--prompt-len`` tokens,
   ``--max-tokens`` completion tokens with ``ignore_eos``, seeded): completion tokens per wall second, median over
   rounds with a 95% order-statistic interval, and the ratio to the base alone taken per round (paired) with the
   same interval. Memory at each condition: parameter bytes (the base's, and the loaded adapters' summed) and the
   process RSS (first round, where the conditions come in ascending order).
2. Training. :func:`trainer.train.train` on the same model shape and the same packed micro-batches (``--rows`` x
   ``--seq-len``, one sample per row, made by the batch flow's ``pack``): one adapter (``TrainConfig.adapter``,
   base frozen, KL reference the base alone) vs full training (``adapter = ""``, a model without adapters and a
   frozen reference copy), alternating rounds; processed tokens/s from the end of step 1 to the end of the last
   step, medians and intervals over rounds, the paired ratio; trainable parameters, gradient bytes and the AdamW
   moment bytes of each (measured on a real AdamW over the same parameters).

What the serving figure is and is not: this server serves one request at a time under its lock and activates the
request's adapter for the whole request (all its sequences), so requests naming different adapters run one after
another, each base forward unmerged plus the adapter's two small matmuls per target. Punica/S-LoRA batch
sequences of many adapters into one forward with gathered multi-adapter kernels (SGMV/BGMV) and page adapter
weights to the GPU; none of that exists here, and the server has no KV cache (each token recomputes the whole
sequence). The ratio therefore measures the per-request cost of the adapter path and of switching adapters on
CPU, not the batching effects of a GPU multi-LoRA server.

PNG: ``bench/adapters.png``. Record the figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rtrl.quiet import quiet_known_warnings

LAYER_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The adapters' targets here: every layer's four linears (the figures in bench/RESULTS.md were measured so)."""
BASE_NAME = "bench-base"
TRAINED = "org-00"


# --------------------------------------------------------------------------- statistics


def median_interval(xs: list[float]) -> tuple[float, float, float, float]:
    """Median with a distribution-free interval from order statistics: ``[x_(j), x_(n+1-j)]`` with the largest
    ``j`` whose coverage (``1 - 2 P(Binomial(n, 1/2) < j)``) is still >= 95%; below 6 values no ``j`` reaches 95%
    and the range is given with its lower coverage. Returns (median, low, high, coverage)."""
    s = sorted(xs)
    n = len(s)
    if n == 1:
        return s[0], s[0], s[0], 0.0

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

    j = 1
    while j + 1 <= n // 2 and coverage(j + 1) >= 0.95:
        j += 1
    return statistics.median(s), s[j - 1], s[n - j], coverage(j)


def fmt_ci(m: float, lo: float, hi: float, spec: str = ",.0f") -> str:
    return f"{m:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


MB = 1e6


# --------------------------------------------------------------------------- model


def model_config(args: argparse.Namespace) -> Any:
    from rtrl.sections.trainer import ModelSettings

    ffn = args.ffn or max(64, round(args.hidden * 8 / 3 / 64) * 64)  # Llama's 8/3 x hidden, a multiple of 64
    return ModelSettings(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=ffn,
        vocab_size=args.vocab,
        seq_length=max(args.seq_len, args.prompt_len + args.max_tokens),
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        linear_bias=False,
    )


def split_bytes(model: Any) -> tuple[int, int]:
    """(base parameter bytes, bytes of every adapter on the model summed)."""
    from trainer import lora

    base = lora.base_parameters(model)
    ids = {id(p) for p in base}
    return nbytes(base), nbytes(p for p in model.parameters() if id(p) not in ids)


# --------------------------------------------------------------------------- serving


@dataclass
class ServeRound:
    loaded: int
    round: int
    tokens: int
    seconds: float
    cpu_s: float
    requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


@dataclass
class Memory:
    loaded: int
    base_bytes: int
    adapter_bytes: int
    rss: int


@dataclass
class Serving:
    rounds: list[ServeRound] = field(default_factory=list)
    memory: dict[int, Memory] = field(default_factory=dict)
    load_ms: list[float] = field(default_factory=list)
    unload_ms: list[float] = field(default_factory=list)
    adapter_params: int = 0
    base_params: int = 0
    checked: str = ""


def save_adapters(model: Any, names: list[str], lcfg: Any, root: Path) -> dict[str, str]:
    """Each adapter with ``A`` as initialised and a small random ``B`` (so it changes the logits), saved as an rtrl
    adapter checkpoint and removed again: the server loads them from disk, as vLLM would."""
    from trainer import lora

    g = torch.Generator().manual_seed(1)
    paths = {}
    for i, name in enumerate(names):
        lora.add_adapter(model, name, lcfg, seed=i)
        with torch.no_grad():
            for b in lora.adapter_parameters(model, name)[1::2]:  # (A, B) per linear: the B's
                b.copy_(torch.randn(b.shape, generator=g) * 0.02)
        paths[name] = str(lora.save_adapter(root / name, model, name, step=1, base=BASE_NAME))
        lora.remove_adapter(model, name)
    return paths


def run_serving(args: argparse.Namespace, cfg: Any, progress: Progress, task: Any, console: Console) -> Serving:
    from client.rollouts import CompletionsClient
    from simulator.openai_server import CompletionServer
    from trainer import lora
    from trainer.model import build_model

    lcfg = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=LAYER_TARGETS)
    conditions = [0] + args.loaded
    names = [f"org-{i:02d}" for i in range(max(conditions))]
    model = build_model(cfg)
    out = Serving(base_params=sum(p.numel() for p in model.parameters()))
    root = Path(tempfile.mkdtemp(prefix="adapters-bench-"))
    try:
        paths = save_adapters(model, names, lcfg, root)
        if names:
            lora.add_adapter(model, "probe", lcfg)
            out.adapter_params = sum(p.numel() for p in lora.adapter_parameters(model, "probe"))
            lora.remove_adapter(model, "probe")
        rnd = random.Random(7)
        prompts = [
            [[rnd.randrange(cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
            for _ in range(args.requests)
        ]
        gc.collect()
        with (
            CompletionServer({BASE_NAME: model}, max_loras=max(1, max(conditions))) as server,
            CompletionsClient(server.url, BASE_NAME, timeout_s=600, logprobs=1) as client,
            ThreadPoolExecutor(args.clients) as pool,
        ):

            def send(job: tuple[int, str]) -> int:
                i, name = job
                groups = client.complete(
                    prompts[i], n=args.n, max_tokens=args.max_tokens, seed=1000 + i, ignore_eos=True, model=name
                )
                return sum(len(c.ids) for g in groups for c in g)

            def set_loaded(k: int) -> None:
                want = set(names[:k])
                for name in [n for n in server.loras if n not in want]:
                    t = time.perf_counter()
                    client.unload_lora_adapter(name)
                    out.unload_ms.append((time.perf_counter() - t) * 1e3)
                for name in names[:k]:
                    if name not in server.loras:
                        t = time.perf_counter()
                        client.load_lora_adapter(name, paths[name])
                        out.load_ms.append((time.perf_counter() - t) * 1e3)
                assert sorted(server.loras) == sorted(want)

            send((0, BASE_NAME))  # warm-up: first-call costs belong to no condition
            for r in range(args.rounds):
                shift = r % len(conditions)
                for k in conditions[shift:] + conditions[:shift]:
                    set_loaded(k)
                    if r == 0:  # ascending order in the first round: RSS only grows
                        gc.collect()
                        base_b, adapter_b = split_bytes(model)
                        out.memory[k] = Memory(k, base_b, adapter_b, rss_bytes())
                    draw = random.Random(r * 1000 + k)
                    targets = names[:k] or [BASE_NAME]
                    jobs = [(i, draw.choice(targets)) for i in range(args.requests)]
                    t, cpu = time.perf_counter(), time.process_time()
                    tokens = sum(pool.map(send, jobs))
                    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
                    assert tokens == args.requests * args.prompts * args.n * args.max_tokens, tokens
                    row = ServeRound(k, r, tokens, seconds, cpu, args.requests)
                    out.rounds.append(row)
                    progress.console.print(
                        f"  serving round {r + 1}/{args.rounds}, {k:>2} adapter(s) loaded: "
                        f"{row.tokens_per_s:,.0f} completion tokens/s ({seconds:.2f} s)"
                    )
                    progress.advance(task)
            if names:  # the adapters do change what is sampled: same prompt and seed, base vs an adapter
                set_loaded(1)
                base_lp = client.complete(prompts[0][:1], max_tokens=4, seed=5, model=BASE_NAME)[0][0].logprobs
                ad_lp = client.complete(prompts[0][:1], max_tokens=4, seed=5, model=names[0])[0][0].logprobs
                same = all(abs(a - b) < 1e-6 for a, b in zip(base_lp, ad_lp))
                out.checked = "NOT different (the adapters do nothing!)" if same else "differ from the base's"
                console.print(f"  check: an adapter's sampled log-probs {out.checked}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- training


@dataclass
class TrainRound:
    mode: str
    round: int
    processed_per_s: float
    trained_per_s: float
    step_s: float
    processed_per_cpu_s: float


@dataclass
class Training:
    rounds: list[TrainRound] = field(default_factory=list)
    trainable: dict[str, int] = field(default_factory=dict)
    grad_bytes: dict[str, int] = field(default_factory=dict)
    moment_bytes: dict[str, int] = field(default_factory=dict)
    processed_per_step: int = 0


def micro_batches(cfg: Any, args: argparse.Namespace, adapter: str) -> list[Any]:
    """``train_steps x micro_batches`` packed micro-batches of ``rows`` samples (a quarter prompt, the rest a
    trained completion; one sample per row), by the batch flow's own ``pack``, decoded as the trainer reads them.
    Advantages alternate +1 / -1; behaviour log-probs are an untrained model's (-log vocab)."""
    from flows.batching import Sample, pack
    from schemas.codec import encode_batch
    from schemas.records import Rollout
    from trainer.batch import to_batch

    rnd = random.Random(3)
    prompt = args.seq_len // 4
    completion = args.seq_len - prompt
    lp = -math.log(cfg.vocab_size)
    out = []
    for b in range(args.train_steps * args.micro_batches):
        samples = []
        for i in range(args.rows):
            tid = f"s{b}-{i}"
            ro = Rollout(
                trajectory_id=tid,
                policy_version=1,
                group_id=f"g{b}-{i // 2}",
                group_size=2,
                org_id=TRAINED,
                task_kind="bugfix",
                prompt_ids=[rnd.randrange(cfg.vocab_size) for _ in range(prompt)],
                completion_ids=[rnd.randrange(cfg.vocab_size) for _ in range(completion)],
                behaviour_logprobs=[lp] * completion,
                loss_mask=[1] * completion,
                created_at=1000,
            )
            samples.append(Sample(ro, 1.0, 0, advantage=1.0 if i % 2 else -1.0))
        mb = msgspec.structs.replace(pack(samples, seq_len=args.seq_len, created_at=1000), adapter=adapter)
        out.append(to_batch(encode_batch(mb), 0, b))
    return out


def memory_source(batches: list[Any], _offsets: dict[str, int] | None) -> Any:
    from trainer.train import MemorySource

    return MemorySource(batches)


def stamp(ends: list[tuple[float, float]]) -> Callable[[Any], None]:
    """An ``on_step`` that records each step's end: (wall, process CPU) seconds."""

    def on_step(_step: Any) -> None:
        ends.append((time.perf_counter(), time.process_time()))

    return on_step


def run_training(args: argparse.Namespace, cfg: Any, progress: Progress, task: Any) -> Training:
    from rtrl.sections.trainer import TrainConfig
    from trainer import lora
    from trainer.factory import Policy
    from trainer.model import build_model
    from trainer.train import Hooks, train

    full, reference, adapted = build_model(cfg), build_model(cfg), build_model(cfg)
    lora.add_adapter(adapted, TRAINED, lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=LAYER_TARGETS))
    models = {"full": (full, reference, ""), "adapter": (adapted, None, TRAINED)}
    batches = {mode: micro_batches(cfg, args, adapter) for mode, (_, _, adapter) in models.items()}
    out = Training(processed_per_step=args.micro_batches * args.rows * (args.seq_len - 1))
    modes = list(models)
    for r in range(args.rounds):
        for mode in modes[r % 2 :] + modes[: r % 2]:
            model, ref, adapter = models[mode]
            ends: list[tuple[float, float]] = []
            tc = TrainConfig(
                run_id=f"bench-{mode}-{r}",
                adapter=adapter,
                micro_batches_per_step=args.micro_batches,
                steps=args.train_steps,
                idle_timeout_s=0.01,
                resume=False,
                max_policy_lag=4,
                max_delayed_lag=0,
                checkpoint_every=5,
            )
            source = functools.partial(memory_source, batches[mode])
            steps = train(Policy(model, ref, version=1), source, tc, Hooks(on_step=stamp(ends)))
            assert len(steps) == args.train_steps and {s.adapter for s in steps} == {adapter}
            seconds = ends[-1][0] - ends[0][0]  # steady: the end of step 1 to the end of the last
            cpu = ends[-1][1] - ends[0][1]
            n = args.train_steps - 1
            row = TrainRound(
                mode,
                r,
                out.processed_per_step * n / seconds,
                sum(s.tokens for s in steps[1:]) / seconds,
                seconds / n,
                out.processed_per_step * n / cpu,
            )
            out.rounds.append(row)
            progress.console.print(
                f"  training round {r + 1}/{args.rounds}, {mode:<7}: {row.processed_per_s:,.0f} processed tokens/s "
                f"({row.step_s * 1e3:,.0f} ms per step)"
            )
            progress.advance(task)
    for mode, (model, _, _) in models.items():
        params = [p for p in model.parameters() if p.requires_grad]  # what train() handed its AdamW
        out.trainable[mode] = sum(p.numel() for p in params)
        out.grad_bytes[mode] = nbytes(p.grad for p in params if p.grad is not None)
        opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)  # lr 0: the step creates the state, moves nothing
        opt.step()
        out.moment_bytes[mode] = nbytes(t for st in opt.state.values() for k, t in st.items() if k != "step")
        del opt
    return out


# --------------------------------------------------------------------------- report


def report_serving(s: Serving, args: argparse.Namespace, console: Console) -> None:
    conditions = [0] + args.loaded
    base = {r.round: r.tokens_per_s for r in s.rounds if r.loaded == 0}
    per_req = args.prompts * args.n * args.max_tokens
    cov = median_interval([r.tokens_per_s for r in s.rounds if r.loaded == 0])[3]
    base_cpu = {r.round: r.tokens_per_cpu_s for r in s.rounds if r.loaded == 0}
    t = Table(
        title=escape(
            f"Serving over HTTP: completion tokens per wall second and per CPU second of this process (server and "
            f"clients), {args.rounds} rounds alternating; median [interval over rounds, coverage {cov:.1%}]; ratios "
            "per round to the base alone in the same round"
        )
    )
    for col in ("adapters loaded", "requests name", "tokens/s (wall)", "ratio to base alone", "ms per request",
                "tokens per CPU s", "ratio per CPU s"):  # fmt: skip
        t.add_column(col, justify="left" if col == "requests name" else "right")
    for k in conditions:
        rows = [r for r in s.rounds if r.loaded == k]
        tps = median_interval([r.tokens_per_s for r in rows])
        ratio = median_interval([r.tokens_per_s / base[r.round] for r in rows])
        cpu = median_interval([r.tokens_per_cpu_s for r in rows])
        cpu_ratio = median_interval([r.tokens_per_cpu_s / base_cpu[r.round] for r in rows])
        ms = statistics.median(r.seconds / r.requests * 1e3 for r in rows)
        t.add_row(
            "0 (base alone)" if k == 0 else str(k),
            "the base" if k == 0 else f"one of {k}, uniformly",
            fmt_ci(*tps[:3]),
            "1 (baseline)" if k == 0 else fmt_ci(*ratio[:3], spec=".3f"),
            f"{ms:,.0f}",
            fmt_ci(*cpu[:3]),
            "1 (baseline)" if k == 0 else fmt_ci(*cpu_ratio[:3], spec=".3f"),
        )
    console.print(t)
    console.print(
        f"Each request: {args.prompts} prompt(s) x n={args.n}, {args.prompt_len} prompt tokens, {args.max_tokens} "
        f"completion tokens (ignore_eos) = {per_req} completion tokens; {args.requests} requests per condition and "
        f"round from {args.clients} client thread(s). Adapter load over HTTP (read checkpoint + add): median "
        f"{statistics.median(s.load_ms or [0.0]):.1f} ms ({len(s.load_ms)} loads); unload "
        f"{statistics.median(s.unload_ms or [0.0]):.1f} ms."
    )
    m = Table(title="Memory with the adapters loaded (parameters: exact bytes; RSS: this whole process, first round)")
    for col in ("adapters loaded", "base params MB", "adapter params MB (per adapter)", "total params MB",
                "ratio total/base", "RSS MB", "RSS - base alone's, MB"):  # fmt: skip
        m.add_column(col, justify="right")
    base_mem = s.memory[0]
    for k in conditions:
        x = s.memory[k]
        m.add_row(
            "0 (base alone)" if k == 0 else str(k),
            f"{x.base_bytes / MB:.2f}",
            f"{x.adapter_bytes / MB:.2f}" + (f" ({x.adapter_bytes / k / MB:.3f})" if k else ""),
            f"{(x.base_bytes + x.adapter_bytes) / MB:.2f}",
            f"{(x.base_bytes + x.adapter_bytes) / base_mem.base_bytes:.3f}",
            f"{x.rss / MB:,.0f}",
            f"{(x.rss - base_mem.rss) / MB:+,.1f}",
        )
    console.print(m)
    if s.adapter_params:
        console.print(
            f"Base {s.base_params:,} parameters; one rank-{args.rank} adapter on all four targets "
            f"{s.adapter_params:,} ({s.adapter_params / s.base_params:.2%} of the base)."
        )


def report_training(tr: Training, args: argparse.Namespace, console: Console) -> None:
    full = {r.round: r.processed_per_s for r in tr.rounds if r.mode == "full"}
    cov = median_interval(list(full.values()))[3]
    full_cpu = {r.round: r.processed_per_cpu_s for r in tr.rounds if r.mode == "full"}
    t = Table(
        title=escape(
            f"Training, {args.train_steps} steps x {args.micro_batches} micro-batches of {args.rows} x "
            f"{args.seq_len} per round (the first step untimed), {args.rounds} rounds alternating; median [interval "
            f"over rounds, coverage {cov:.1%}]; ratios per round to full training in the same round"
        )
    )
    for col in ("mode", "trainable params", "processed tokens/s", "ratio to full", "ms per step",
                "per CPU s", "ratio per CPU s", "trained tokens/s", "gradient MB", "AdamW moments MB"):  # fmt: skip
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode in ("full", "adapter"):
        rows = [r for r in tr.rounds if r.mode == mode]
        ratio = median_interval([r.processed_per_s / full[r.round] for r in rows])
        cpu_ratio = median_interval([r.processed_per_cpu_s / full_cpu[r.round] for r in rows])
        t.add_row(
            "full (adapter = '')" if mode == "full" else f"adapter {TRAINED} (base frozen)",
            f"{tr.trainable[mode]:,}",
            fmt_ci(*median_interval([r.processed_per_s for r in rows])[:3]),
            "1 (baseline)" if mode == "full" else fmt_ci(*ratio[:3], spec=".3f"),
            f"{statistics.median(r.step_s for r in rows) * 1e3:,.0f}",
            fmt_ci(*median_interval([r.processed_per_cpu_s for r in rows])[:3]),
            "1 (baseline)" if mode == "full" else fmt_ci(*cpu_ratio[:3], spec=".3f"),
            f"{statistics.median(r.trained_per_s for r in rows):,.0f}",
            f"{tr.grad_bytes[mode] / MB:.2f}",
            f"{tr.moment_bytes[mode] / MB:.2f}",
        )
    console.print(t)
    console.print(
        f"AdamW moments, adapter/full: {tr.moment_bytes['adapter'] / tr.moment_bytes['full']:.4f} "
        f"({tr.moment_bytes['adapter']:,} vs {tr.moment_bytes['full']:,} bytes). Both modes run one no-grad "
        "reference forward per micro-batch (full: a frozen copy; adapter: the same model with no adapter active)."
    )


def plot(s: Serving | None, tr: Training | None, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if s else 0) + (1 if tr else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), squeeze=False)
    ax_iter = iter(axes[0])
    if s:
        conditions = [0] + args.loaded
        ax = next(ax_iter)
        xs = list(range(len(conditions)))
        for attr, label, shift in (
            ("tokens_per_s", "per wall second", -0.06),
            ("tokens_per_cpu_s", "per CPU second", 0.06),
        ):
            stats = [median_interval([getattr(r, attr) for r in s.rounds if r.loaded == k]) for k in conditions]
            at = [x + shift for x in xs]
            line = ax.errorbar(
                at,
                [x[0] for x in stats],
                yerr=[[x[0] - x[1] for x in stats], [x[2] - x[0] for x in stats]],
                marker="o",
                capsize=4,
                label=label,
            )
            for r in range(args.rounds):
                ax.scatter(
                    at,
                    [next(getattr(x, attr) for x in s.rounds if x.loaded == k and x.round == r) for k in conditions],
                    s=8,
                    color=line.lines[0].get_color(),
                    alpha=0.35,
                )
        ax.set_xticks(xs, ["base\nalone"] + [str(k) for k in args.loaded])
        ax.set_xlabel("adapters loaded (requests: one of them, uniformly)")
        ax.set_ylabel("completion tokens")
        ax.set_ylim(bottom=0)
        ax.set_title("Serving throughput (median, interval; dots: rounds)", fontsize=10)
        ax.legend(fontsize=8, loc="lower left")
        ax.grid(alpha=0.3)
        ax = next(ax_iter)
        base_mb = [s.memory[k].base_bytes / MB for k in conditions]
        ad_mb = [s.memory[k].adapter_bytes / MB for k in conditions]
        ax.bar(xs, base_mb, label="base parameters")
        ax.bar(xs, ad_mb, bottom=base_mb, label=f"adapters (rank {args.rank}), summed")
        ax.plot(xs, [(s.memory[k].rss - s.memory[0].rss) / MB + base_mb[0] for k in conditions], "k.--",
                label="RSS growth over base alone + base params")  # fmt: skip
        ax.set_xticks(xs, ["base\nalone"] + [str(k) for k in args.loaded])
        ax.set_xlabel("adapters loaded")
        ax.set_ylabel("MB")
        ax.set_title("Serving memory", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    if tr:
        ax = next(ax_iter)
        modes = ("full", "adapter")
        width = 0.38
        for shift, attr, label in ((-width / 2, "processed_per_s", "per wall second"),
                                   (width / 2, "processed_per_cpu_s", "per CPU second")):  # fmt: skip
            stats = [median_interval([getattr(r, attr) for r in tr.rounds if r.mode == m]) for m in modes]
            ax.bar(
                [0 + shift, 1 + shift],
                [x[0] for x in stats],
                width,
                yerr=[[x[0] - x[1] for x in stats], [x[2] - x[0] for x in stats]],
                capsize=5,
                label=label,
            )
        ax.set_xticks([0, 1], ["full training", f"one adapter\n(rank {args.rank}, base frozen)"])
        ax.set_ylabel("processed tokens")
        ax.set_title("Training throughput (median, interval over rounds)", fontsize=10)
        ax.legend(fontsize=8, loc="lower left")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"Per-org LoRA adapters on a {args.hidden}-hidden, {args.layers}-layer Llama-like model, CPU "
        f"({torch.get_num_threads()} torch thread(s))",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    quiet_known_warnings()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds; every condition / mode runs once per round")
    ap.add_argument("--only", choices=["serving", "training"], help="run one half only")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=0, help="MLP width; 0 = 8/3 x hidden rounded to a multiple of 64")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank), all four targets")
    ap.add_argument("--loaded", default="1,8,64", help="adapter counts to serve, next to the base alone")
    ap.add_argument("--requests", type=int, default=8, help="requests per condition and round")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per request")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16, help="completion tokens per sample (ignore_eos)")
    ap.add_argument("--clients", type=int, default=2, help="client threads sending requests at once")
    ap.add_argument("--train-steps", type=int, default=6, help="optimizer steps per round and mode (first untimed)")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--rows", type=int, default=4, help="rows (samples) per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--png", default=str(Path(__file__).with_name("adapters.png")))
    args = ap.parse_args()
    args.loaded = sorted({int(x) for x in args.loaded.split(",") if x.strip()})
    if any(k < 1 for k in args.loaded) or args.rounds < 1 or args.train_steps < 2:
        ap.error("--loaded takes counts >= 1, --rounds >= 1, --train-steps >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    from trainer.model import init_parallel

    console = Console(width=200)  # wide tables stay readable when the output goes to a file
    cfg = model_config(args)
    init_parallel(cfg)
    console.print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, FFN "
        f"{cfg.ffn_width} (SwiGLU), RMSNorm, RoPE, vocab {cfg.vocab_size}, fp32; adapters rank {args.rank} on "
        f"all four targets; torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)"
    )
    started = time.monotonic()
    serving = training = None
    do_serve, do_train = args.only in (None, "serving"), args.only in (None, "training")
    total = args.rounds * ((1 + len(args.loaded)) * do_serve + 2 * do_train)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("adapters bench", total=total)
        if do_serve:
            serving = run_serving(args, cfg, progress, task, console)
        if do_train:
            training = run_training(args, cfg, progress, task)
    if serving:
        report_serving(serving, args, console)
    if training:
        report_training(training, args, console)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    console.print(
        f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load} at the end (1/5/15 min): {time.monotonic() - started:.0f} s in all"
    )
    plot(serving, training, args, Path(args.png))


if __name__ == "__main__":
    main()
