"""A tiny training run for tests: micro-batches from Kafka (or a fixed in-memory set), one JSON line
per optimizer step on stdout. Usage: train_run.py OUT_DIR [--bootstrap B --topic T] [--steps N]."""

from __future__ import annotations

import argparse
import json
import sys

import msgspec


def synthetic_batches(n: int, seed: int = 0):
    """Deterministic packed micro-batches (2 rows x 33 tokens, two samples per row)."""
    import numpy as np

    from trainer.data import Batch

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rows, seq = 2, 33
        seg = np.full((rows, seq), -1)
        seg[:, :20], seg[:, 20:30] = 0, 1
        mask = np.zeros((rows, seq), np.float32)
        mask[:, 8:20], mask[:, 25:30] = 1, 1
        out.append(Batch(f"b{i:03d}", rng.integers(0, 256, (rows, seq)), mask,
                         rng.normal(size=(rows, seq)).astype(np.float32), np.full((rows, seq), -5.5, np.float32),
                         seg, [f"s{i}a", f"s{i}b"], np.array([0, i % 2]), 0, i))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bootstrap")
    ap.add_argument("--topic")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    args = ap.parse_args()

    from trainer.config import ModelConfig
    from trainer.data import BatchStream
    from trainer.model import build_model, init_parallel
    from trainer.train import MemorySource, TrainConfig, train

    cfg = ModelConfig(seq_length=64)
    init_parallel(cfg)
    model, reference = build_model(cfg), build_model(cfg)
    reference.load_state_dict(model.state_dict())
    if args.bootstrap:
        make = lambda off: BatchStream(args.bootstrap, args.topic, args.topic + ".dlq", start=off, timeout_s=10)  # noqa: E731
    else:
        batches = synthetic_batches(2 * args.steps)
        make = lambda off: MemorySource(batches, off)  # noqa: E731
    tc = TrainConfig(run_id="test", max_steps=args.steps, micro_batches_per_step=2, checkpoint_every=args.checkpoint_every,
                     checkpoint_dir=args.out, idle_timeout_s=10, max_policy_lag=1)

    def emit(step):
        sys.stdout.write(msgspec.json.encode(step).decode() + "\n")
        sys.stdout.flush()

    train(model, reference, make, tc, policy_version=1, on_step=emit)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
