"""The model registry: each promoted version of a Hugging Face model, exported where an inference fleet loads it.

Layout: ``<serving.registry_dir>/v<N>/`` (default ``<data_dir>/registry/v<N>/``), one folder per promoted version,
which vLLM, SGLang and transformers load as a model folder:

- ``config.json`` and ``model.safetensors`` (with pp > 1 one file per pipeline stage and
  ``model.safetensors.index.json``) written by :func:`trainer.hf.export.export_hf`, plus the other files of the imported
  checkpoint (tokenizer, generation config);
- ``rtrl.json``: ``format``, ``version``, ``parent``, ``reward_version`` and ``reward_checksum`` (what the cycle
  trained on), ``eval_results``, ``created_at`` (ms since the epoch), ``checkpoint`` (the Megatron checkpoint it was exported from), ``source`` (the imported Hugging Face
  folder), ``steps``/``samples``/``tokens`` since the parent, ``files`` (each covered file's sha256 and size),
  ``sha256`` (the content hash) and ``sha256_definition``.

**The content hash** is defined in :mod:`client.fleet` (the fleet checks it with the same code, or with coreutils):
the sha256 of the ``sha256sum`` lines (``<hex>  <name>\\n``) of every file of the folder but ``rtrl.json``, sorted by
name. It covers the weights, the config and the tokenizer; the metadata is not part of it (it holds the hash).

**Atomic**: the export is written to a hidden ``.tmp-v<N>-<random>`` folder next to the final one, hashed, its files
and folder fsynced, then renamed to ``v<N>``: a reader sees the whole export or none. Replacing another model under
the same version (below) moves the old folder aside first, so for that moment ``v<N>`` is absent (never partial).
Leftovers of a crash are removed by the next export of that version.

**Idempotent**: exporting a version again (a replay after a crash between the export and the announcement) writes
the export afresh to a temporary folder; when ``v<N>`` already holds the same content hash the new copy is dropped
and the existing export (and its ``rtrl.json``, ``created_at`` included) is kept - same path, same hash, no error.
When ``v<N>`` holds another model (an earlier run's, in a registry that outlived its data folder) or a damaged
export, it is replaced (one warning line naming both hashes).

**Which models**: only a model whose architecture came from a Hugging Face checkpoint (``model.hf_path``:
``cfg.hf_config`` is set) can be exported - :func:`trainer.hf.export.export_hf` writes that family's tensor names and the
imported ``config.json``. The simulator's default tiny model (LayerNorm, GELU, learned biases: no Hugging Face
family) is not exported: :func:`export_checkpoint` logs one line and announces empty ``export_path`` and
``export_sha256``; the Megatron checkpoint's ``path`` is all a fleet gets for it.

:func:`load_export` is the other end, for a server holding a megatron model (:mod:`simulator.openai_server`): it
loads an export's weights in place, refusing another architecture and restoring the old weights if loading fails.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from client.fleet import METADATA, content_sha256, file_digests, manifest_sha256, read_metadata
from rtrl.errors import ConfigError
from rtrl.files import private_dir
from rtrl.sections.trainer import ModelSettings
from schemas.records import Checkpoint
from trainer.checkpoint import fsync_path
from trainer.hf.config import config_from_hf
from trainer.hf.export import export_hf
from trainer.hf.load import load_hf

log = logging.getLogger(__name__)

FORMAT = "rtrl-export/1"
HASH_DEFINITION = (
    "sha256 of the lines '<hex sha256 of the file>  <name>\\n' (sha256sum's output) of every regular file of the "
    "folder except rtrl.json, sorted by the bytes of the names"
)
#: the fields of a ModelSettings that make two models the same architecture (what a reload may not change)
ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "ffn_hidden_size",
    "vocab_size",
    "normalization",
    "norm_eps",
    "activation",
    "position_embedding_type",
    "rope_base",
    "rope_scaling",
    "rope_scaling_factor",
    "qkv_bias",
    "linear_bias",
    "qk_layernorm",
    "tie_embeddings",
)


@dataclass(frozen=True)
class Export:
    """One version's export: its folder, content hash, and whether an identical one was there already."""

    path: str
    sha256: str
    reused: bool = False


def registry_dir(settings) -> Path:
    """``serving.registry_dir``, or ``<data_dir>/registry`` when it is empty (absolute)."""
    d = settings.serving.registry_dir
    return Path(d).expanduser().resolve() if d else settings.data_path / "registry"


def exportable(cfg: ModelSettings) -> bool:
    """Whether ``cfg`` is a Hugging Face family (built from ``model.hf_path``), which :func:`export_hf` can write."""
    return cfg.hf_config is not None


def _from_rank0(obj: Any) -> Any:
    """``obj`` as rank 0 has it, on every rank (itself without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def export_version(
    model, cfg: ModelSettings, root: str | os.PathLike, version: int, metadata: dict[str, Any]
) -> Export:
    """Export ``model`` as version ``version`` to ``root/v<version>`` atomically and idempotently (the module
    docstring says how), with ``metadata`` in ``rtrl.json``. Collective like :func:`export_hf`: every rank calls
    it; rank 0 hashes, writes the metadata and renames. ``root`` must be storage every writing rank sees."""
    import torch.distributed as dist

    if not exportable(cfg):
        raise ConfigError(
            "only a Hugging Face model (model.hf_path: Llama, Qwen2, Qwen3) can be exported to the registry; this "
            "one was built from the model settings"
        )
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp_name = None
    if rank == 0:
        if not root.exists():
            private_dir(root)  # a new registry is owner-only; an existing one keeps the mode its operator gave it
        for stale in [*root.glob(f".tmp-v{version}-*"), *root.glob(f".old-v{version}-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # a crashed export of this version, or a replaced one
        tmp_name = f".tmp-v{version}-{uuid.uuid4().hex[:12]}"
        (root / tmp_name).mkdir(mode=root.stat().st_mode & 0o777)  # readable by whom the registry is
    tmp = root / _from_rank0(tmp_name)
    try:
        export_hf(model, cfg, tmp)
        outcome: tuple[Export | None, str | None] = (None, None)
        if rank == 0:
            try:
                outcome = (_finish(tmp, root, version, metadata), None)
            except OSError as e:
                outcome = (None, f"registry {root}: the export of v{version} could not be completed ({e})")
        done, err = _from_rank0(outcome)
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if err:
        raise ConfigError(err)
    return done


def _finish(tmp: Path, root: Path, version: int, metadata: dict[str, Any]) -> Export:
    final = root / f"v{version}"
    digests = file_digests(tmp)
    sha = manifest_sha256(digests)
    if final.exists():
        try:
            old = read_metadata(final)
            old_sha = content_sha256(final)
        except Exception:  # noqa: BLE001 - damaged or foreign: whatever it is, it is replaced below
            old, old_sha = {}, "(unreadable)"
        if old_sha == sha and old.get("sha256") == sha:
            return Export(str(final), sha, reused=True)  # a replay: the same export is there already
        log.warning(
            "registry: %s held another export of v%s (content sha256 %s); replaced by this one (%s)",
            final,
            version,
            old.get("sha256") or old_sha,
            sha,
        )
    meta = (
        {"format": FORMAT, "version": version}
        | metadata
        | {"files": digests, "sha256": sha, "sha256_definition": HASH_DEFINITION}
    )
    (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():
        trash = root / f".old-v{version}-{uuid.uuid4().hex[:12]}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(root)
    return Export(str(final), sha)


def export_checkpoint(settings, model, cfg: ModelSettings, ck: Checkpoint) -> Checkpoint:
    """What a promotion does (:class:`app.loop.Loop` calls it before announcing one): export ``model`` (the
    promoted weights) as version ``ck.version`` to the registry (:func:`registry_dir`) and return ``ck`` naming
    the export (``export_path``, ``export_sha256``). A model that is not a Hugging Face family is not exported:
    one log line, and ``ck`` with both fields empty."""
    if not exportable(cfg):
        log.info(
            "registry: v%s not exported: the model is not a Hugging Face family (model.hf_path is empty); "
            "rtrl.deployments names its Megatron checkpoint %s only",
            ck.version,
            ck.path,
        )
        return msgspec.structs.replace(ck, export_path="", export_sha256="")
    t = time.monotonic()
    metadata = {
        "parent": ck.parent,
        "reward_version": ck.reward_version or settings.rewards.train_version,  # what the cycle trained on
        "reward_checksum": ck.reward_checksum,
        "eval_results": dict(ck.eval_results),
        "created_at": ck.created_at,
        "checkpoint": ck.path,
        "source": cfg.hf_path,
        "steps": ck.steps,
        "samples": ck.samples,
        "tokens": ck.tokens,
    }
    ex = export_version(model, cfg, registry_dir(settings), ck.version, metadata)
    log.info(
        "registry: v%s %s %s (sha256 %s) in %.1fs",
        ck.version,
        "already exported to" if ex.reused else "exported to",
        ex.path,
        ex.sha256[:12],
        time.monotonic() - t,
    )
    return msgspec.structs.replace(ck, export_path=ex.path, export_sha256=ex.sha256)


def load_export(model, cfg: ModelSettings, path: str | os.PathLike) -> None:
    """Load the weights of the export (any Hugging Face folder of the same architecture) ``path`` into ``model``
    in place, for a server that keeps serving the same model object. Refused (ConfigError, ``model`` unchanged):
    a model that is not a Hugging Face family, an export of another architecture (the fields that differ are
    named), missing or misshapen tensors. Anything failing halfway restores the weights it had."""
    if not exportable(cfg):
        raise ConfigError(
            "this model is not a Hugging Face family (built from the model settings, not model.hf_path): it cannot "
            "load a Hugging Face export"
        )
    new = config_from_hf(path, parallel=cfg.parallel, seq_length=cfg.seq_length)
    diff = [
        f"{f} {getattr(new, f)!r} (serving {getattr(cfg, f)!r})"
        for f in ARCHITECTURE
        if getattr(new, f) != getattr(cfg, f)
    ]
    if diff:
        raise ConfigError(
            f"export {path} is another architecture than the served model: {'; '.join(diff[:4])}; a reload "
            "changes weights only (restart the server for another model)"
        )
    params = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    backup = {k: v.detach().clone() for k, v in params.items()}
    try:
        load_hf(model, cfg, path)
    except BaseException:
        with torch.no_grad():
            for k, v in backup.items():
                params[k].copy_(v)
        raise


def adapters_dir(settings) -> Path:
    """Where promoted adapters are exported: ``<registry>/adapters/<org>/a<N>``."""
    return registry_dir(settings) / "adapters"


def export_adapter(settings, model, cfg: ModelSettings, name: str, ck: Checkpoint) -> Checkpoint:
    """What an adapter's promotion does: export adapter ``name`` of ``model`` in PEFT format
    (:func:`trainer.lora.export_peft`: what vLLM's multi-LoRA serving loads) to ``<registry>/adapters/<org>/a<N>``,
    written to a hidden folder and renamed into place, and return ``ck`` naming it with its content hash (the same
    definition as a model export's). An adapter of a model that is not a Hugging Face family is not exported (one
    log line; ``ck`` with empty ``export_path`` and ``export_sha256``): its adapter checkpoint ``path`` is what the
    project's own completions server loads."""
    from trainer.lora import export_peft

    if not exportable(cfg):
        log.info("registry: adapter %s a%s not exported: the model is not a Hugging Face family", ck.org, ck.version)
        return msgspec.structs.replace(ck, export_path="", export_sha256="")
    root = adapters_dir(settings) / ck.org
    if not root.exists():
        private_dir(root)
    final = root / f"a{ck.version}"
    for stale in root.glob(f".tmp-a{ck.version}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-a{ck.version}-{uuid.uuid4().hex[:12]}"
    try:
        export_peft(model, cfg, name, tmp, base_model_name_or_path=cfg.hf_path or "")
        sha = manifest_sha256(file_digests(tmp))
        if final.exists() and content_sha256(final) == sha:
            return msgspec.structs.replace(ck, export_path=str(final), export_sha256=sha)  # a replay
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return msgspec.structs.replace(ck, export_path=str(final), export_sha256=sha)
