"""Subprocess / torchrun worker for tests/test_trainer_model.py (saving needs a ``__main__`` guard).

    python tests/dist/trainer_worker.py roundtrip OUT_DIR     one process: save, reload, compare
    torchrun --nproc_per_node 2 tests/dist/trainer_worker.py tp2_save OUT_DIR
    python tests/dist/trainer_worker.py tp1_load OUT_DIR      loads OUT_DIR/ckpt saved at TP=2

Each command writes its findings to OUT_DIR/<command>.json (rank 0) for the test to assert on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer import checkpoint  # noqa: E402
from rtrl.sections.trainer import ModelSettings  # noqa: E402
from trainer.model import build_model, forward_logprobs, init_parallel  # noqa: E402

B, S = 4, 32


def fixed_batch(cfg: ModelSettings):
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g)
    return seq[:, :-1], torch.arange(S).expand(B, S).contiguous(), seq[:, 1:]


def mean_nll(model, batch) -> torch.Tensor:
    return -forward_logprobs(model, *batch).mean()


def train_steps(model, opt, batch, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        mean_nll(model, batch).backward()
        opt.step()


def eval_loss(model, batch) -> float:
    with torch.no_grad():
        return mean_nll(model, batch).item()


def make_opt(model, lr: float = 1e-2):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def write(out: Path, name: str, data: dict) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        (out / f"{name}.json").write_text(json.dumps(data))


def roundtrip(out: Path) -> None:
    cfg = ModelSettings.tiny()
    init_parallel(cfg)
    batch = fixed_batch(cfg)
    model = build_model(cfg)
    opt = make_opt(model)
    train_steps(model, opt, batch, 3)
    root = out / "ckpts"
    # An interrupted earlier save at the same path (junk, no marker) is replaced.
    partial = checkpoint.step_dir(root, 3)
    partial.mkdir(parents=True)
    (partial / "junk.distcp").write_text("half-written")
    extra = {"step": 3, "offsets": {"rtrl.batches": {"0": 17, "1": 4}}, "data": {"epoch": 0}}
    saved = checkpoint.save(partial, model, opt, extra)
    refused = False
    try:
        checkpoint.save(saved, model, opt, extra)
    except FileExistsError:
        refused = True

    model2 = build_model(cfg.replace(seed=99))  # differs from the saved model before loading
    opt2 = make_opt(model2, lr=0.5)
    differs_before = any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())
    )
    loaded_extra = checkpoint.load(checkpoint.latest(root), model2, opt2)

    params_equal = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values())
        if isinstance(a, torch.Tensor)
    )
    s1, s2 = opt.state_dict(), opt2.state_dict()
    opt_equal = s1["param_groups"] == s2["param_groups"] and s1["state"].keys() == s2["state"].keys()
    for k in s1["state"]:
        for name, t in s1["state"][k].items():
            opt_equal &= torch.equal(t, s2["state"][k][name])
    # Both continue identically (same state, same next update).
    train_steps(model, opt, batch, 1)
    train_steps(model2, opt2, batch, 1)
    write(
        out,
        "roundtrip",
        {
            "files": sorted(p.name for p in saved.iterdir()),
            "refused_overwrite": refused,
            "differs_before": differs_before,
            "params_equal": params_equal,
            "opt_equal": bool(opt_equal),
            "extra": loaded_extra,
            "extra_expected": extra,
            "next_loss": [eval_loss(model, batch), eval_loss(model2, batch)],
            "n_state": len(s1["state"]),
            "n_params": len(list(model.parameters())),
        },
    )


def tp_run(out: Path, tp: int, load: bool) -> None:
    cfg = ModelSettings.tiny().with_parallel(tp=tp)
    info = init_parallel(cfg)
    batch = fixed_batch(cfg)
    model = build_model(cfg)
    opt = make_opt(model)
    result = {"tp": info.tp, "world_size": info.world_size, "shims": list(info.shims)}
    result["initial_loss"] = eval_loss(model, batch)
    if load:
        extra = checkpoint.load(out / "ckpt", model, opt)
        result["extra"] = extra
    else:
        train_steps(model, opt, batch, 2)
        checkpoint.save(out / "ckpt", model, opt, {"step": 2, "saved_tp": tp})
    result["loss"] = eval_loss(model, batch)
    train_steps(model, opt, batch, 1)  # exercises the (resharded) Adam moments
    result["next_loss"] = eval_loss(model, batch)
    write(out, f"tp{tp}_{'load' if load else 'save'}", result)


def main() -> None:
    cmd, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if cmd == "roundtrip":
        roundtrip(out)
    elif cmd == "tp2_save":
        tp_run(out, tp=2, load=False)
    elif cmd == "tp1_load":
        tp_run(out, tp=1, load=True)
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
