"""torchrun worker for tests/test_hf_convert.py: load a Hugging Face checkpoint at tensor-parallel size 2
(or, with ``--pp``, over two pipeline stages).

    torchrun --nproc_per_node 2 tests/dist/hf_tp_worker.py HF_DIR OUT_DIR [--pp]

Each rank loads only its shards (``trainer.hf.load.load_hf``) through a wrapper around ``safe_open`` that
records the shape of every slice it materialises and fails on a whole-tensor read (``get_tensor``); rank 0
saves the gathered logits of fixed tokens; every rank writes what it read; then all ranks export the
model (the tensor-parallel gather) to OUT_DIR/export. Files: OUT_DIR/logits.pt, OUT_DIR/reads<rank>.json.
With ``--pp`` each stage loads its layers and the export writes one file per stage and the index; the last
stage of a tied model reports whether its copy of the embedding (``output_layer.weight``) holds the checkpoint's
embedding (OUT_DIR/stage<rank>.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.factory import build  # noqa: E402
from trainer.hf.config import config_from_hf  # noqa: E402
from trainer.hf.export import export_hf  # noqa: E402
import trainer.hf.load as hf_load  # noqa: E402
from trainer.hf.load import load_hf  # noqa: E402
from rtrl.sections.trainer import ParallelSettings  # noqa: E402
from trainer.model import causal_mask, init_parallel  # noqa: E402

B, S = 2, 64


def tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, vocab, (B, S), generator=g), torch.arange(S).expand(B, S).contiguous()


class _Slice:
    def __init__(self, inner, name: str, seen: list):
        self.inner, self.name, self.seen = inner, name, seen

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, idx):
        t = self.inner[idx]
        self.seen.append([self.name, list(t.shape)])
        return t


class _Handle:
    def __init__(self, inner, seen: list):
        self.inner, self.seen = inner, seen

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name: str):
        return _Slice(self.inner.get_slice(name), name, self.seen)

    def get_tensor(self, name: str):
        raise AssertionError(f"{name} read whole: load_hf must read slices")


def pipeline(src: Path, out: Path) -> None:
    import torch.distributed as dist
    from safetensors import safe_open

    cfg = config_from_hf(src, parallel=ParallelSettings(pp=2))
    init_parallel(cfg)
    model = build(cfg)
    rank = dist.get_rank()
    layers = [layer.layer_number for layer in model.decoder.layers]
    info: dict = {"layers": layers, "has_output_copy": False}
    weight = getattr(model.output_layer, "weight", None) if hasattr(model, "output_layer") else None
    if cfg.tie_embeddings and rank == 1 and weight is not None:
        files = {p.name for p in src.glob("*.safetensors")}
        index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"] if len(files) > 1 else None
        file = index["model.embed_tokens.weight"] if index else "model.safetensors"
        with safe_open(str(src / file), framework="pt") as f:
            embed = f.get_tensor("model.embed_tokens.weight")
        info["has_output_copy"] = bool(torch.equal(weight[: cfg.vocab_size].detach(), embed))
        info["padding_zero"] = bool((weight[cfg.vocab_size :] == 0).all())
    (out / f"stage{rank}.json").write_text(json.dumps(info))
    export_hf(model, cfg, out / "export")
    dist.barrier()
    dist.destroy_process_group()


def main(src: Path, out: Path) -> None:
    import torch.distributed as dist

    seen: list = []
    real_open = hf_load.safe_open
    hf_load.safe_open = lambda *a, **k: _Handle(real_open(*a, **k), seen)  # type: ignore[assignment]
    cfg = config_from_hf(src, parallel=ParallelSettings(tp=2))
    init_parallel(cfg)
    model = build(cfg)  # with cfg.hf_path: loads this rank's shards
    seen_at_build = list(seen)
    seen.clear()
    report = load_hf(model, cfg)  # again, to get the report (same reads)
    model.eval()
    tok, pos = tokens(cfg.vocab_size)
    with torch.no_grad():
        local = model(tok, pos, causal_mask(S)).contiguous()  # [B, S, 128 / 2]: this rank's vocabulary rows
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local)
    logits = torch.cat(parts, dim=-1)
    rank = dist.get_rank()
    if rank == 0:
        torch.save(logits[..., : cfg.vocab_size].clone(), out / "logits.pt")
    (out / f"reads{rank}.json").write_text(
        json.dumps(
            {
                "wrapper": seen,
                "build_wrapper": seen_at_build,
                "report": [[n, list(s)] for n, s in report.reads],
                "elements_read": report.elements_read,
                "elements_in_checkpoint": report.elements_in_checkpoint,
            }
        )
    )
    export_hf(model, cfg, out / "export")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    (pipeline if "--pp" in sys.argv[3:] else main)(Path(sys.argv[1]), Path(sys.argv[2]))
