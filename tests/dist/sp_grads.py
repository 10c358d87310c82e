"""torchrun worker (tp = 2): the gradients of parameters megatron marks ``sequence_parallel`` are summed
over the tensor-parallel group by trainer.train.reduce_sequence_parallel_grads; other gradients stay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtrl.sections.trainer import ModelSettings
from trainer.model import build_model, init_parallel
from trainer.train import reduce_sequence_parallel_grads


def main() -> None:
    cfg = ModelSettings.tiny().with_parallel(tp=2)
    info = init_parallel(cfg)
    model = build_model(cfg)
    marked, other = [], []
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, float(info.tp_rank + 1))
        if "layernorm" in name:  # what megatron marks under sequence parallelism
            p.sequence_parallel = True
            marked.append(name)
        else:
            other.append(name)
    reduce_sequence_parallel_grads(model)
    params = dict(model.named_parameters())
    # one file per rank: two ranks printing to the same pipe can interleave their lines
    out = Path(sys.argv[1]) / f"rank{info.tp_rank}.json"
    out.write_text(json.dumps({
        "rank": info.tp_rank,
        "marked": {n: float(params[n].grad.unique().item()) for n in marked},
        "other": sorted({float(params[n].grad.unique().item()) for n in other}),
    }))


if __name__ == "__main__":
    main()
