"""torchrun worker for tests/test_adapters.py: one LoRA training step at tensor-parallel size 2.

    torchrun --nproc_per_node 2 tests/dist/lora_tp_worker.py OUT_DIR

:func:`scenario` is what the test also runs in-process at tp = 1: a tiny SwiGLU + RMSNorm + GQA model (with
biases, so ``skip_bias_add`` is exercised), an adapter with a seeded non-zero ``B``, the logits of fixed tokens,
one AdamW step on ``-mean(log-prob)`` plus the mean exact KL to the base alone (``trainer.model.full_kl``, the
adapters' default KL: its vocabulary sums reduce over the tp group), and an adapter checkpoint of the result. Rank 0 writes OUT_DIR/result.pt
(gathered logits, loss, full adapter gradients, their global norm and the parameters after the step); every rank takes part in the
checkpoint OUT_DIR/ckpt/step_000000001 and the PEFT export OUT_DIR/peft, which it loads back (``roundtrip``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer import lora  # noqa: E402
from rtrl.sections.trainer import ModelSettings, ParallelSettings  # noqa: E402
from trainer.model import (  # noqa: E402
    build_model,
    causal_mask,
    forward_logprobs_and_log_softmax,
    full_kl,
    init_parallel,
)
from trainer.train import clip_grad_norm  # noqa: E402

B, S = 2, 32
NAME = "org-a"
BASE = "tiny-swiglu@test"


def model_config(tp: int) -> ModelSettings:
    return ModelSettings.tiny(
        normalization="RMSNorm",
        activation="swiglu",
        num_query_groups=2,
        ffn_hidden_size=96,
        parallel=ParallelSettings(tp=tp),
    )


def nonzero_b(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full adapter with every ``lora_B`` replaced by seeded values (same for any tp)."""
    g = torch.Generator().manual_seed(5)
    return {
        k: (0.05 * torch.randn(v.shape, generator=g) if k.endswith("lora_B") else v) for k, v in sorted(state.items())
    }


def scenario(tp: int, out: Path) -> dict[str, Any]:
    """Run the step at ``tp`` (the caller's process layout); return what rank 0 compares."""
    from megatron.core import parallel_state as ps

    cfg = model_config(tp)
    init_parallel(cfg)
    model = build_model(cfg)
    lora.add_adapter(model, NAME, lora.LoraConfig(rank=4, alpha=8.0), seed=7)
    lora.load_adapter_state_dict(model, NAME, nonzero_b(lora.adapter_state_dict(model, NAME)))
    lora.activate(model, NAME)
    params = lora.train_only(model, NAME)
    # eps well above the smallest gradients: Adam's first step is ~lr * g / (|g| + eps), which turns the float32
    # summation-order noise of a gradient near eps (3e-9 on 8e-8 under the full KL with the output layer's
    # adapter) into a visible difference
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-4)
    g = torch.Generator().manual_seed(11)
    tok = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g)
    pos = torch.arange(S).expand(B, S).contiguous()
    with torch.no_grad():
        local = model(tok[:, :-1], pos, causal_mask(S)).contiguous()
    if tp > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, -1)
    lp, log_softmax = forward_logprobs_and_log_softmax(model, tok[:, :-1], pos, tok[:, 1:])
    with torch.no_grad(), lora.activate(model, None):  # the base alone: the adapter's KL reference
        _, base = forward_logprobs_and_log_softmax(model, tok[:, :-1], pos, tok[:, 1:])
    kl = full_kl(log_softmax, base).mean()
    loss = -lp.mean() + kl
    loss.backward()
    grads = lora.adapter_state_dict(model, NAME, grads=True)
    norm = clip_grad_norm(model, 1e9)  # counts the adapter's shards once (tensor_model_parallel marks)
    opt.step()
    after = lora.adapter_state_dict(model, NAME)
    lora.save_adapter(out / "ckpt", model, NAME, step=1, base=BASE, optimizer=opt, extra={"offsets": {"memory/0": 1}})
    lora.export_peft(model, cfg, NAME, out / "peft")  # gathers the shards; rank 0 writes
    lora.load_peft(model, cfg, "back", out / "peft")  # every rank takes its slices of the export
    back = lora.adapter_state_dict(model, "back")
    roundtrip = sorted(back) == sorted(after) and all(torch.equal(back[k], after[k]) for k in after)
    return {"logits": local, "loss": loss.detach(), "kl": kl.detach(), "grads": grads, "after": after, "norm": norm, "roundtrip": roundtrip}


def main(out: Path) -> None:
    import torch.distributed as dist

    result = scenario(2, out)
    if dist.get_rank() == 0:
        torch.save(result, out / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
