"""Checkpoints through ``megatron.core.dist_checkpointing``: model, AdamW state, RNG and extra state.

Layout of one checkpoint folder::

    <dir>/                 dist_checkpointing files (metadata.json, common.pt, *.distcp):
                           the model's sharded_state_dict() and the optimizer state sharded like
                           the parameters, so a checkpoint saved at one (tp, pp) loads at another
    <dir>/extra.json       the caller's plain-JSON dict (step, consumed Kafka offsets, data state ...),
                           written atomically by rank 0
    <dir>/rng/rank<R>.json each rank's RNG states (python, torch CPU, CUDA, megatron tracker)
    <dir>/COMPLETE         written last, after every rank finished: without it the folder is ignored

A kill -9 during :func:`save` leaves a folder without ``COMPLETE``; :func:`latest` skips it, so the
previous checkpoint stays the one to resume from, and a later save to the same folder replaces it.

The optimizer is a plain ``torch.optim.AdamW`` (or ``Adam``): ``get_megatron_optimizer`` does not run
on CPU. Its per-parameter moments are mapped onto the parameters' sharding with
``dist_checkpointing.optimizer.get_param_id_to_sharded_param_map`` and
``optim_state_to_sharding_state``; its ``step`` count (equal for all parameters in normal training)
is kept as one common value, its hyper-parameters as common state.

Saving starts a spawn-mode multiprocessing manager: scripts that call :func:`save` need an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
EXTRA = "extra.json"
RNG_DIR = "rng"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- small helpers


def _dist():
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call trainer.model.init_parallel(cfg) first")
    return dist


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file + fsync + rename, then fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so a rename or a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unwrap(model):
    """The model under wrappers such as megatron's DistributedDataParallel (``.module``), so the
    checkpoint keys do not depend on the wrapping (DDP's own sharded_state_dict adds ``module.``)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": _dist().get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _tensor_b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _b64_tensor(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as a plain-JSON dict (python, torch CPU, CUDA if any, megatron tracker)."""
    from megatron.core.tensor_parallel import random as mrandom

    py = random.getstate()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "torch": _tensor_b64(torch.get_rng_state()),
        "cuda": _tensor_b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None,
        "tracker": {},
    }
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and tracker.is_initialized():
        state["tracker"] = {
            name: _tensor_b64(s) for name, s in tracker.get_states().items() if isinstance(s, torch.Tensor)
        }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (on the same kind of device)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    torch.set_rng_state(_b64_tensor(state["torch"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_b64_tensor(state["cuda"]))
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states({k: _b64_tensor(v) for k, v in state["tracker"].items()})


# --------------------------------------------------------------------------- optimizer state


_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"trainer.checkpoint supports torch.optim.Adam/AdamW, got {type(optimizer).__name__}")


def _ensure_state(optimizer: torch.optim.Optimizer, step: float) -> None:
    """Give every parameter Adam state (zero moments, ``step``), as a first ``optimizer.step()`` would.

    Zero moments with step 0 are exactly Adam's lazily created initial state, so this changes
    nothing for parameters that never had a gradient in a run that has not stepped yet.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if "exp_avg" in st:
                continue
            st["step"] = torch.tensor(float(step), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _common_step(optimizer: torch.optim.Optimizer) -> float:
    steps = {float(st["step"]) for st in optimizer.state.values() if "step" in st}
    if len(steps) > 1:
        log.warning("optimizer parameters have different step counts %s; saving the largest", sorted(steps))
    return max(steps, default=0.0)


def _params_in_order(optimizer: torch.optim.Optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _optimizer_sharded_state_dict(model, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    step = _common_step(optimizer)
    _ensure_state(optimizer, step)
    id_map = get_param_id_to_sharded_param_map(model.sharded_state_dict(), _params_in_order(optimizer))
    n = len(_params_in_order(optimizer))
    if len(id_map) != n:
        raise RuntimeError(
            f"{n - len(id_map)} of {n} optimizer parameters are not parameters of the model's sharded state dict"
        )
    state = optimizer.state_dict()
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    state["step"] = step
    return state


# --------------------------------------------------------------------------- save / load


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a checkpoint whose save finished (its ``COMPLETE`` marker exists)."""
    return (Path(path) / MARKER).is_file()


def save(
    path: str | os.PathLike,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a checkpoint to folder ``path`` (collective: every rank calls it with the same path).

    ``model`` is this rank's megatron module (wrappers with ``.module`` are unwrapped).
    ``extra`` must be JSON-serialisable (step, consumed Kafka offsets, data state ...); rank 0
    writes it. Refuses to overwrite a complete checkpoint; an incomplete folder at ``path``
    (an interrupted save) is replaced. ``COMPLETE`` is written last.
    """
    from megatron.core import dist_checkpointing

    dist = _dist()
    model = unwrap(model)
    path = Path(path).absolute()
    rank = dist.get_rank()
    extra = dict(extra or {})
    extra_text = json.dumps(extra, indent=1, sort_keys=True)  # fail before touching the disk
    if optimizer is not None:
        _check_optimizer(optimizer)

    err = None
    if rank == 0:
        if is_complete(path):
            err = f"checkpoint {path} already exists and is complete; save to a new folder"
        else:
            if path.exists():
                log.warning("replacing incomplete checkpoint folder %s", path)
                shutil.rmtree(path)
            path.mkdir(parents=True)  # empty: dist_checkpointing warns about non-empty folders
            fsync_path(path.parent)
    flag = [err]
    dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        raise FileExistsError(flag[0])

    state: dict[str, Any] = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state_dict(model, optimizer)
    dist_checkpointing.save(state, str(path))

    layout = _layout()
    (path / RNG_DIR).mkdir(exist_ok=True)
    _write_atomic(path / RNG_DIR / f"rank{rank}.json", json.dumps({"layout": layout, "rng": rng_state()}))
    if rank == 0:
        _write_atomic(path / EXTRA, extra_text)
    dist.barrier()
    if rank == 0:
        marker = {
            "format": FORMAT_VERSION,
            "step": extra.get("step"),
            "saved_at": time.time(),
            "layout": layout,
            "optimizer": optimizer is not None,
        }
        _write_atomic(path / MARKER, json.dumps(marker, sort_keys=True))
    dist.barrier()
    return path


def load(
    path: str | os.PathLike,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a complete checkpoint into ``model`` (and ``optimizer``); return its extra dict.

    Collective. The model may use another (tp, pp) than the one that saved: tensors are
    resharded. RNG states are restored only when the layout is the same (else they are
    meaningless per rank and left alone). Raises FileNotFoundError for an incomplete folder.
    """
    from megatron.core import dist_checkpointing

    path = Path(path).absolute()
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    dist = _dist()
    model = unwrap(model)
    marker = json.loads((path / MARKER).read_text())
    if optimizer is not None:
        _check_optimizer(optimizer)
        if not marker.get("optimizer", False):
            raise ValueError(f"checkpoint {path} holds no optimizer state; load it with optimizer=None")

    state: dict[str, Any] = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state_dict(model, optimizer)
    loaded = dist_checkpointing.load(state, str(path))

    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")

    if optimizer is not None:
        osd = loaded["optimizer"]
        step = float(osd.pop("step"))
        for param_state in osd["state"].values():
            param_state["step"] = torch.tensor(step, dtype=torch.float32)
        optimizer.load_state_dict(osd)

    if restore_rng:
        rank = dist.get_rank()
        rng_file = path / RNG_DIR / f"rank{rank}.json"
        if rng_file.is_file():
            saved = json.loads(rng_file.read_text())
            if saved["layout"] == _layout():
                set_rng_state(saved["rng"])
            else:
                log.info("checkpoint layout %s differs from %s: RNG states not restored", saved["layout"], _layout())
    return read_extra(path)


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The extra state saved with a checkpoint (step, offsets, ...) without loading any weights."""
    return json.loads((Path(path) / EXTRA).read_text())


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The conventional folder for the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step_{step:09d}"


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder directly under ``root`` (None if there is none).

    Newest = highest ``extra["step"]`` recorded in the marker, then latest save time; folders
    without a ``COMPLETE`` marker (interrupted saves) are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[Any, ...] | None = None
    best_path: Path | None = None
    for child in root.iterdir():
        if not child.is_dir() or not is_complete(child):
            continue
        try:
            marker = json.loads((child / MARKER).read_text())
        except (OSError, ValueError):
            continue
        step = marker.get("step")
        key = (
            1 if isinstance(step, (int, float)) else 0,
            step if isinstance(step, (int, float)) else 0,
            marker.get("saved_at", 0.0),
            child.name,
        )
        if best is None or key > best:
            best, best_path = key, child
    return best_path
