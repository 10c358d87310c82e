"""A LoRA training run for tests/test_adapters.py's kill -9 test: one process, an adapter checkpoint every step.

    python tests/dist/lora_train.py CKPT_ROOT OUT_FILE STEPS [SLEEP_S] [HANG_AT]

Resumes from the newest complete adapter checkpoint under CKPT_ROOT (if any) and trains adapter ``org-a`` up to
STEPS steps; step ``s`` always trains on the batch drawn from seed ``s`` (same data order however often it is
interrupted). After each checkpoint it prints ``saved <step>`` and sleeps SLEEP_S (so a test can kill it between
steps, or during the next step's save). At the end it writes the full adapter to OUT_FILE (safetensors).
With HANG_AT = n, the save of step n stops after its folder was renamed into place and before its ``COMPLETE``
marker is written, prints ``renamed n`` and hangs there: a test kills it at exactly that point.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors.torch import save_file  # noqa: E402

from trainer import checkpoint, lora  # noqa: E402
from rtrl.sections.trainer import ModelSettings  # noqa: E402
from trainer.model import build_model, forward_logprobs, init_parallel  # noqa: E402

NAME = "org-a"
BASE = "tiny@kill-test"
B, S = 2, 24


def hang_before_marker(step: int) -> None:
    """Make the save of ``step`` hang just before it writes its completeness marker (test harness only)."""
    real = checkpoint._write_atomic

    def write(path: Path, text: str) -> None:
        if path.name == checkpoint.MARKER and path.parent.name == checkpoint.step_dir("", step).name:
            print(f"renamed {step}", flush=True)
            time.sleep(600)
        real(path, text)

    checkpoint._write_atomic = write  # type: ignore[assignment]


def main(root: Path, out: Path, steps: int, sleep_s: float, hang_at: int) -> None:
    if hang_at:
        hang_before_marker(hang_at)
    cfg = ModelSettings.tiny(normalization="RMSNorm", activation="swiglu", num_query_groups=2)
    init_parallel(cfg)
    model = build_model(cfg)
    lora.add_adapter(model, NAME, lora.LoraConfig(rank=4), seed=3)
    lora.activate(model, NAME)
    opt = torch.optim.AdamW(lora.train_only(model, NAME), lr=1e-2)
    start = 0
    path = lora.latest_adapter(root)
    if path is not None:
        ck = lora.load_adapter(path, model, NAME, opt, base=BASE)
        start = ck.step
        assert ck.extra["offsets"] == {"memory/0": start}, ck.extra
        print(f"resumed {start}", flush=True)
    pos = torch.arange(S).expand(B, S).contiguous()
    for step in range(start, steps):
        tok = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(step))
        loss = -forward_logprobs(model, tok[:, :-1], pos, tok[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        lora.save_adapter(
            root, model, NAME, step=step + 1, base=BASE, optimizer=opt, extra={"offsets": {"memory/0": step + 1}}
        )
        print(f"saved {step + 1}", flush=True)
        time.sleep(sleep_s)
    save_file({k: v.contiguous() for k, v in lora.adapter_state_dict(model, NAME).items()}, str(out))


if __name__ == "__main__":
    args = sys.argv[1:] + ["0", "0"][len(sys.argv[4:]) :]
    main(Path(args[0]), Path(args[1]), int(args[2]), float(args[3]), int(args[4]))
