"""A LoRA training run for tests/test_adapters.py's kill -9 test: one process, an adapter checkpoint every step.

    python tests/dist/lora_train.py CKPT_ROOT OUT_FILE STEPS [SLEEP_S]

Resumes from the newest complete adapter checkpoint under CKPT_ROOT (if any) and trains adapter ``org-a`` up to
STEPS steps; step ``s`` always trains on the batch drawn from seed ``s`` (same data order however often it is
interrupted). After each checkpoint it prints ``saved <step>`` and sleeps SLEEP_S (so a test can kill it between
steps, or during the next step's save). At the end it writes the full adapter to OUT_FILE (safetensors).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors.torch import save_file  # noqa: E402

from trainer import lora  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.model import build_model, forward_logprobs, init_parallel  # noqa: E402

NAME = "org-a"
BASE = "tiny@kill-test"
B, S = 2, 24


def main(root: Path, out: Path, steps: int, sleep_s: float) -> None:
    cfg = ModelConfig.tiny(normalization="RMSNorm", activation="swiglu", num_query_groups=2)
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
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
