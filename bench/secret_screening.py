"""Secret screening (client/screening.py): its false-positive rate, and its cost next to the SDK's own encoding.

- False positives on the simulator's ordinary traffic: rollouts of sampled tasks decoded with the simulator's
  vocabulary, as the policy server screens them. Then on ordinary code: this project's own Python source outside
  tests/, cut into 40-line chunks as a coding agent's context would hold it (tests/ holds planted secrets).
- Cost: rollouts per second through decode and scan, next to the same rollouts through the SDK's JSON codec
  (what the SDK does to every rollout it sends), in the same run, as a ratio.

    .venv/bin/python bench/secret_screening.py [--rollouts 5000]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

from client.screening import DetectSecrets, Screen
from schemas.codec import JsonCodec
from schemas.records import Rollout
from simulator.tasks import decode, sample_task, warm_start_completion

ROOT = Path(__file__).resolve().parent.parent


def simulator_rollouts(n: int, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = sample_task(rng, f"org-{i % 6:02d}", hard_share=0.5)
        completion = warm_start_completion(rng, task)
        out.append(
            Rollout(
                trajectory_id=f"t{i}", policy_version=1, group_id=f"t{i}", group_size=1, org_id=task.org_id,
                task_kind=task.kind, prompt_ids=task.prompt, completion_ids=completion,
                behaviour_logprobs=[-0.5] * len(completion), loss_mask=[1] * len(completion), created_at=1,
            )
        )  # fmt: skip
    return out


def code_chunks(lines_per_chunk: int = 40) -> list[str]:
    chunks = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT).parts
        if rel[0] in ("tests", ".venv", ".rtrl") or "site-packages" in rel:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        chunks += ["\n".join(lines[i : i + lines_per_chunk]) for i in range(0, len(lines), lines_per_chunk)]
    return chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=5000)
    args = ap.parse_args()
    scanner = DetectSecrets()
    screen = Screen(scanner, decode)
    rollouts = simulator_rollouts(args.rollouts)

    flagged = sum(bool(screen.rollout(r.prompt_ids, r.completion_ids)) for r in rollouts)
    chunks = code_chunks()
    hits = [(c.splitlines()[0][:60], scanner.scan(c)) for c in chunks]
    code_flagged = [(head, found) for head, found in hits if found]

    codec: JsonCodec[Rollout] = JsonCodec(Rollout)
    t = time.perf_counter()
    for r in rollouts:
        codec.encode(r)
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    for r in rollouts:
        screen.rollout(r.prompt_ids, r.completion_ids)
    screen_s = time.perf_counter() - t
    t = time.perf_counter()
    for c in chunks:
        scanner.scan(c)
    code_s = time.perf_counter() - t

    print(f"machine: {platform.node()} {platform.machine()} python {platform.python_version()}")
    print(
        f"simulator traffic: {flagged} of {len(rollouts):,} rollouts flagged (false-positive rate {flagged / len(rollouts):.4%})"
    )
    print(
        f"ordinary code: {len(code_flagged)} of {len(chunks):,} 40-line chunks of rtrl's own source flagged "
        f"({len(code_flagged) / len(chunks):.2%})"
    )
    for head, found in code_flagged:
        print(f"  flagged: {head!r}: {sorted({d for d, _ in found})}")
    print(
        f"cost: screening {len(rollouts) / screen_s:,.0f} rollouts/s vs the SDK's JSON encoding "
        f"{len(rollouts) / encode_s:,.0f} rollouts/s: {screen_s / encode_s:.1f}x the encoding's time"
    )
    print(f"code: {len(chunks) / code_s:,.0f} 40-line chunks/s scanned")


if __name__ == "__main__":
    main()
