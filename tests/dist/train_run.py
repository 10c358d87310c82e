"""A tiny training run for tests: micro-batches from Kafka (or a fixed in-memory set), one JSON line
per optimizer step on stdout. Usage: train_run.py OUT_DIR [--bootstrap B --topic T] [--steps N]
[--tp N] [--pp N] [--tie] [--init CKPT] [--params] (run under torchrun for tp/pp/dp > 1).

Several runs in one process: train_run.py --job NAME "OUT_DIR ARGS" [--job NAME "OUT_DIR ARGS" ...].
They run one after another, each from freshly built parallel groups and seeds, as a new process would.
Each run's JSON lines carry ``"run": NAME``.
That saves the ~5 s import of torch and megatron per process and run.
(``--job``, not ``--run``: torchrun's parser would take ``--run`` for its ``--run-path``.)"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import msgspec


def synthetic_batches(n: int, seed: int = 0):
    """Deterministic packed micro-batches (2 rows x 33 tokens, two samples per row)."""
    import numpy as np

    from trainer.batch import Batch

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rows, seq = 2, 33
        seg = np.full((rows, seq), -1)
        seg[:, :20], seg[:, 20:30] = 0, 1
        mask = np.zeros((rows, seq), np.float32)
        mask[:, 8:20], mask[:, 25:30] = 1, 1
        out.append(
            Batch(
                f"b{i:03d}",
                rng.integers(0, 256, (rows, seq)),
                mask,
                rng.normal(size=(rows, seq)).astype(np.float32),
                np.full((rows, seq), -5.5, np.float32),
                seg,
                [f"s{i}a", f"s{i}b"],
                np.array([0, i % 2]),
                0,
                i,
            )
        )
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """One run's arguments (the single-run command line)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bootstrap")
    ap.add_argument("--topic")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (run under torchrun)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (run under torchrun)")
    ap.add_argument("--tie", action="store_true", help="tie the input embedding and the output layer")
    ap.add_argument("--params", action="store_true", help="print the final parameters' fingerprint")
    ap.add_argument(
        "--init",
        help="initial weights: save them to this checkpoint folder if it does not exist, else load them from it "
        "(a pipeline stage draws other initial weights than a whole model: runs to compare share one init)",
    )
    ap.add_argument(
        "--kl-estimator",
        choices=("k3", "full"),
        default="k3",
        help="loss.kl_estimator (full: with a KL weight of 0.5, so the exact KL shows in the losses)",
    )
    ap.add_argument("--updates", type=int, default=1, help="train.updates_per_step: optimizer updates per step")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """One run (the plain command line), or several given as ``--job NAME "ARGS"`` groups."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "--job":
        run(parse_args(argv))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", nargs=2, action="append", metavar=("NAME", "ARGS"), required=True)
    runs = [(name, parse_args(shlex.split(line))) for name, line in ap.parse_args(argv).job]
    for i, (name, args) in enumerate(runs):
        if i:
            _reset_parallel()
        run(args, name)


def _reset_parallel() -> None:
    """Drop megatron's parallel groups so the next run's ``init_parallel`` builds its own and reseeds.

    Megatron's own tests re-initialise so: destroy, barrier, initialise.
    ``torch.distributed`` itself stays up (its world does not change between runs).
    """
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    gc.collect()  # the last run's models and optimizer
    ps.destroy_model_parallel()
    dist.barrier()


def run(args: argparse.Namespace, name: str | None = None) -> None:
    """Train one run and print its JSON lines on rank 0 (tagged ``"run": name`` when named)."""
    from pathlib import Path

    from trainer import checkpoint
    from rtrl.sections.trainer import ModelSettings
    from trainer.data import BatchStream
    from trainer.model import build_model, init_parallel
    from rtrl.sections.trainer import TrainConfig
    from trainer.factory import Policy
    from trainer.train import Hooks, MemorySource, train

    cfg = ModelSettings(seq_length=64, tie_embeddings=args.tie).with_parallel(tp=args.tp, pp=args.pp)
    info = init_parallel(cfg)
    model, reference = build_model(cfg), build_model(cfg)
    if args.init and checkpoint.is_complete(args.init):
        checkpoint.load(args.init, model, restore_rng=False)
    elif args.init:
        checkpoint.save(Path(args.init), model, extra={"step": 0})
    reference.load_state_dict(model.state_dict())
    if args.bootstrap:
        make = lambda off: BatchStream(args.bootstrap, args.topic, args.topic + ".dlq", start=off, timeout_s=10)  # noqa: E731
    else:
        batches = synthetic_batches(2 * args.steps)[info.dp_rank :: info.dp]  # DP ranks split the global batch
        make = lambda off: MemorySource(batches, off)  # noqa: E731
    tc = TrainConfig(
        run_id="test",
        steps=args.steps,
        micro_batches_per_step=2 // info.dp,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=args.out,
        idle_timeout_s=10,
        max_policy_lag=1,
        updates_per_step=args.updates,
        max_delayed_lag=0,
    )
    if args.kl_estimator == "full":
        tc = tc.model_copy(update=dict(loss=tc.loss.model_copy(update=dict(kl_estimator="full", kl_coef=0.5))))

    tag = {} if name is None else {"run": name}

    def emit(step):
        if info.rank == 0:
            record = {**msgspec.structs.asdict(step), **tag} if tag else step
            sys.stdout.write(msgspec.json.encode(record).decode() + "\n")
            sys.stdout.flush()

    train(Policy(model, reference, version=1), make, tc, Hooks(on_step=emit))
    if args.params:  # full parameters (gathered over tensor parallelism): sum and abs-sum per tensor
        total = {}
        for name, p in model.named_parameters():
            if getattr(p, "shared", False):
                continue  # the last pipeline stage's copy of a tied embedding: the first stage reports it
            v = p.detach()
            if info.tp > 1 and getattr(p, "tensor_model_parallel", False):
                v = _gather_dim(v, p.partition_dim)
            total[_global_name(model, name)] = [float(v.double().sum()), float(v.double().abs().sum())]
        if info.pp > 1:  # each stage holds its own layers: merge every stage's parameters on rank 0
            import torch.distributed as dist

            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, total)
            total = {k: v for part in parts for k, v in part.items()}
        if info.rank == 0:
            print(json.dumps({"params": dict(sorted(total.items())), **tag}), flush=True)
    if info.rank == 0:
        print(json.dumps({"done": True, **tag}), flush=True)


def _global_name(model, name: str) -> str:
    """``decoder.layers.<i>.`` with the layer's index in the whole model (a later pipeline stage
    numbers its own layers from 0; megatron keeps the global 1-based ``layer_number``)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def _gather_dim(v, dim):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(v) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, v.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


if __name__ == "__main__":
    main()
