"""LoRA adapters on megatron-core's ``GPTModel``: several named adapters per base model, tensor-parallel aware.

An adapter adds ``scale * B(A(dropout(x)))`` (``scale = alpha / rank``) to the output of each targeted linear
of every ``TransformerLayer`` (local layer spec): ``self_attention.linear_qkv`` and ``mlp.linear_fc1``
(``ColumnParallelLinear``), ``self_attention.linear_proj`` and ``mlp.linear_fc2`` (``RowParallelLinear``); and
of the model's ``output_layer`` (column-parallel over the vocabulary; Hugging Face's ``lm_head``). Without the
output layer an adapter can only move the final hidden state, which raises every token whose output row lies
near the one it wants (in the per-org bench, its org's tool and the malformed calls beside it).
Each targeted linear gets one child module, ``lora_adapters`` (a :class:`LoraSlot`), holding every adapter
by name (one per org, say); at most one adapter is active at a time (:func:`activate`), none = the base model.
The linear itself stays in place: a forward hook adds the active adapter's term to the first element of its
``(output, bias)`` tuple, so ``skip_bias_add`` keeps returning the bias apart, and parameter names, types and
``isinstance`` checks of the base are unchanged. Adapters are invisible to the base model's ``state_dict``,
``load_state_dict`` and ``sharded_state_dict`` (base checkpoints and :func:`trainer.hf.export.export_hf` work with
adapters attached); they are saved by :func:`save_adapter` and exported by :func:`export_peft`.

Tensor-parallel layout (``tp`` ranks, rank ``t``; ``r`` = LoRA rank):

- column-parallel target (``linear_qkv``, ``linear_fc1``): ``A`` ``[r, in]`` is replicated (every rank holds
  the same full tensor), then ``copy_to_tensor_model_parallel_region`` on the ``[.., r]`` activation
  (identity forward, all-reduce backward, so A's gradient and the input's gradient are whole on every rank),
  then ``B`` ``[out / tp, r]``: the same output rows as this rank's shard of the base weight. For
  ``linear_qkv`` those rows are whole query groups in megatron's per-group ``[q heads, k, v]`` layout; for a
  gated ``linear_fc1`` (SwiGLU) rank ``t`` holds ``[gate rows of t; up rows of t]``, like the base weight.
- row-parallel target (``linear_proj``, ``linear_fc2``): ``A`` ``[r, in / tp]`` holds the same input columns
  as this rank's base shard, then ``reduce_from_tensor_model_parallel_region`` sums the partial ``[.., r]``
  activations, then ``B`` ``[out, r]`` replicated (its gradient is equal on every rank: no extra reduction).
- The *full* tensors (:func:`adapter_state_dict`, checkpoints, init) use the tp = 1 layout, so they do not
  depend on tp: gated ``linear_fc1``'s B is ``[all gate rows; all up rows]`` and rank ``t`` takes its gate and
  up rows; everything else is split into ``tp`` contiguous blocks along the sharded dimension.
- Init: ``A`` uniform in ``±1/sqrt(in)`` (what kaiming-uniform with ``a = sqrt(5)`` gives), the full tensor
  drawn from a ``torch.Generator`` seeded from ``(seed, adapter name, layer, target)`` and then sliced, so
  every tp gives the same global adapter and nothing needs syncing; ``B`` zeros, so a new adapter leaves
  the logits exactly unchanged.
- ``parallel.sequence_parallel`` is refused (the activations would be split along the sequence), and so is
  pipeline parallelism (pp > 1) for now. Dropout (``adapters.dropout``) uses the default torch generator;
  only dropout 0 gives tp-independent numbers.

Adapter checkpoints (:func:`save_adapter`, :func:`load_adapter`, :func:`latest_adapter`) hold the full
(tp-independent) adapter tensors, the AdamW moments over only the adapter's parameters (also full), the
step, the caller's ``extra`` dict (Kafka offsets ...), the name of the base model they were trained on,
and each rank's RNG states; a checkpoint saved at one tp loads at any other. Folders follow
:mod:`trainer.checkpoint`'s conventions: written under a hidden temporary name, renamed into place, then
marked ``COMPLETE``; :func:`latest_adapter` skips anything unmarked, so a kill -9 at any point leaves the
previous checkpoint the one to resume from.

:func:`export_peft` writes a Hugging Face PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``)
for Llama/Qwen2/Qwen3 models (what :mod:`trainer.hf` converts): ``linear_qkv`` becomes ``q_proj``, ``k_proj``,
``v_proj`` (each a copy of the shared ``A`` and its rows of ``B``, taken apart with :func:`trainer.hf.layout.split_qkv`),
``linear_fc1`` ``gate_proj`` and ``up_proj``, ``linear_proj`` ``o_proj``, ``linear_fc2`` ``down_proj``,
``output_layer`` ``lm_head`` (``B`` without the padded vocabulary rows, which :func:`load_peft` fills with zeros).
It is exact: each HF delta ``B_x @ A`` is the rows of the fused ``B @ A``. :func:`load_peft` fuses such a folder back
(q, k and v, and gate and up, must share one ``A``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

from rtrl.errors import ConfigError
from trainer import checkpoint
from trainer.checkpoint import unwrap
from trainer.config import ModelConfig

#: the linears an adapter may target -> (their path in a TransformerLayer, or in the model for
#: :data:`MODEL_TARGETS`; column or row parallel)
TARGETS: dict[str, tuple[str, Literal["column", "row"]]] = {
    "linear_qkv": ("self_attention.linear_qkv", "column"),
    "linear_proj": ("self_attention.linear_proj", "row"),
    "linear_fc1": ("mlp.linear_fc1", "column"),
    "linear_fc2": ("mlp.linear_fc2", "row"),
    "output_layer": ("output_layer", "column"),
}
MODEL_TARGETS = ("output_layer",)
"""Targets the model has once (not in every layer): the output layer (Hugging Face's ``lm_head``), whose
vocabulary-parallel rows an adapter's ``B`` follows like any column-parallel target's."""
#: the Hugging Face modules each target becomes in a PEFT export (under ``model.layers.{i}.``; a model target's
#: at the top)
HF_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
    "output_layer": ("lm_head",),
}
SLOT = "lora_adapters"
"""The attribute (child module) of a targeted linear that holds its adapters."""
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LoraConfig:
    """One adapter's shape (the ``adapters`` settings section: ``adapters.rank`` ...)."""

    rank: int = 8
    """``r``: the inner width of ``B @ A``."""
    alpha: float = 16.0
    """The term added is ``alpha / rank * B(A(x))``."""
    targets: tuple[str, ...] = tuple(TARGETS)
    """Which linears get the adapter (megatron names: linear_qkv, linear_proj, linear_fc1, linear_fc2 of every layer;
    output_layer, the model's)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 = none: tp-independent, deterministic)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ConfigError(f"adapters.rank = {self.rank!r} must be a positive integer (e.g. 8); fix: set it so")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ConfigError(
                f"adapters.alpha = {self.alpha!r} must be a number > 0; fix: set it, e.g. to 2 * adapters.rank"
            )
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ConfigError(
                f"adapters.targets = {list(targets)!r}: "
                + (f"unknown {', '.join(map(repr, unknown))}; " if unknown else "")
                + f"fix: a non-empty list without repeats of {', '.join(TARGETS)}"
            )
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"adapters.dropout = {self.dropout!r} must be in [0, 1) (0 = off); fix: set it so")
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank


# --------------------------------------------------------------------------- modules


class LoraPair(nn.Module):
    """One adapter on one linear: this rank's shards of ``lora_A`` ``[r, in(/tp)]`` and ``lora_B`` ``[out(/tp), r]``."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, cfg: LoraConfig):
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.cfg = cfg


class LoraSlot(nn.Module):
    """The adapters of one targeted megatron linear, by name, and which one is active (None = none)."""

    def __init__(self, target: str, layer: int, gated: bool, tp: int, tp_rank: int):
        super().__init__()
        self.target, self.layer, self.gated, self.tp, self.tp_rank = target, layer, gated, tp, tp_rank
        self.kind = TARGETS[target][1]
        self.adapters = nn.ModuleDict()
        self.active: str | None = None

    def key(self, which: str) -> str:
        """The tp-independent name of one of this slot's tensors (``which`` = lora_A or lora_B)."""
        if self.target in MODEL_TARGETS:
            return f"{TARGETS[self.target][0]}.{which}"
        return f"decoder.layers.{self.layer}.{TARGETS[self.target][0]}.{which}"

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The active adapter's term for input ``x`` (this rank's share of the linear's output), or None."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.active is None or self.active not in self.adapters:
            return None
        pair = cast(LoraPair, self.adapters[self.active])
        if pair.cfg.dropout:
            x = nn.functional.dropout(x, pair.cfg.dropout, self.training)
        h = nn.functional.linear(x, pair.lora_A)
        group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
        if self.kind == "column":
            h = copy_to_tensor_model_parallel_region(h, group)  # forward: identity; backward: sum A's input grads
        else:
            h = reduce_from_tensor_model_parallel_region(h, group)  # sum the partial products of the input shards
        return nn.functional.linear(h, pair.lora_B) * pair.cfg.scale

    # full (tp = 1 layout) <-> this rank's shard
    def sharded_dim(self, which: str) -> int | None:
        """The dimension of ``which`` split over tp ranks (None = replicated)."""
        if self.kind == "column":
            return 0 if which == "lora_B" else None
        return 1 if which == "lora_A" else None

    def local(self, which: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full tensor."""
        dim = self.sharded_dim(which)
        if dim is None or self.tp == 1:
            return full
        if self.gated:  # [gate; up] -> [gate rows of this rank; up rows of this rank]
            return torch.cat([half.chunk(self.tp, dim)[self.tp_rank] for half in full.chunk(2, dim)], dim)
        return full.chunk(self.tp, dim)[self.tp_rank]

    def full(self, which: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (rank order)."""
        dim = self.sharded_dim(which)
        if dim is None or len(shards) == 1:
            return shards[0]
        if self.gated:
            halves = [s.chunk(2, dim) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
        return torch.cat(shards, dim)


def _hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    slot: LoraSlot = getattr(module, SLOT)
    delta = slot(args[0] if args else kwargs["input_"])
    if delta is None:
        return None
    out, bias = output
    return out + delta, bias


def _hide_from_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + SLOT + ".")]:
        del state_dict[key]


def _not_missing(module: nn.Module, incompatible: Any) -> None:
    marker = f"{SLOT}."
    keep = [k for k in incompatible.missing_keys if not (k.startswith(marker) or f".{marker}" in k)]
    incompatible.missing_keys[:] = keep


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"adapter name {name!r} must be 1-64 letters, digits, '_' or '-' (e.g. an org id); fix: rename it"
        )


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _layers(model: nn.Module) -> list[Any]:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no decoder.layers: LoRA adapters need a megatron GPTModel")
    return list(layers)


def _slots(model: nn.Module) -> list[LoraSlot]:
    """Every slot of the model, in layer then target order, then the model's own (:data:`MODEL_TARGETS`)."""
    model = unwrap(model)
    out = []
    for layer in _layers(model):
        for target, (path, _) in TARGETS.items():
            if target not in MODEL_TARGETS and isinstance(
                slot := getattr(layer.get_submodule(path), SLOT, None), LoraSlot
            ):
                out.append(slot)
    for target in MODEL_TARGETS:
        linear = getattr(model, TARGETS[target][0], None)
        if isinstance(slot := getattr(linear, SLOT, None), LoraSlot):
            out.append(slot)
    return out


def _slot(linear: nn.Module, target: str, layer: int, gated: bool) -> LoraSlot:
    slot = getattr(linear, SLOT, None)
    if isinstance(slot, LoraSlot):
        return slot
    tp, r = _tp()
    slot = LoraSlot(target, layer, gated, tp, r)
    linear.add_module(SLOT, slot)
    # first among the linear's hooks: the output layer's padded-vocabulary mask (trainer.model.mask_padded_vocab)
    # then applies to the adapter's term too
    linear.register_forward_hook(_hook, with_kwargs=True, prepend=True)
    linear.register_state_dict_post_hook(_hide_from_state_dict)
    linear.register_load_state_dict_post_hook(_not_missing)
    return slot


def _seed(seed: int, name: str, layer: int, target: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{layer}/{target}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# --------------------------------------------------------------------------- adapters


def add_adapter(model: nn.Module, name: str, cfg: LoraConfig | None = None, seed: int = 0) -> None:
    """Add adapter ``name`` (``A`` seeded from ``seed``, ``B`` zeros) to every targeted linear of ``model``.

    The adapter starts inactive and trainable (``requires_grad``); see :func:`activate` and :func:`train_only`
    (call that before wrapping the model in megatron's DistributedDataParallel, which sizes its gradient buffers
    by ``requires_grad`` at wrap time).
    Its tensors have the base weights' dtype and device. The same ``(seed, name)`` gives the same adapter at
    any tp. Raises ConfigError for an existing or malformed name, sequence parallelism or pp > 1."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    cfg = cfg or LoraConfig()
    _check_name(name)
    model = unwrap(model)
    if name in adapter_names(model):
        raise ConfigError(f"adapter {name!r} already exists on this model; remove_adapter() it first or rename it")
    config = getattr(model, "config", None)
    if getattr(config, "sequence_parallel", False):
        raise ConfigError(
            "parallel.sequence_parallel = true is not supported with LoRA adapters (their activations would be "
            "split along the sequence); fix: set parallel.sequence_parallel = false"
        )
    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ConfigError("LoRA adapters support parallel.pp = 1 only; fix: set parallel.pp = 1")
    tp, _ = _tp()
    places: list[tuple[str, int, Any]] = [  # (target, layer index or -1 for the model's own, the linear)
        (target, layer.layer_number - 1, layer.get_submodule(TARGETS[target][0]))
        for layer in _layers(model)
        for target in cfg.targets
        if target not in MODEL_TARGETS
    ]
    for target in (t for t in cfg.targets if t in MODEL_TARGETS):
        linear = getattr(model, TARGETS[target][0], None)
        if linear is None:
            raise ConfigError(f"adapters.targets names {target!r}, which this model has not; fix: leave it out")
        if tp > 1 and getattr(linear, "gather_output", False):
            raise ConfigError(
                f"adapters.targets names {target!r}, whose logits this model gathers over tensor-parallel ranks "
                "(parallel_output = False); fix: leave it out, or build the model with vocabulary-parallel logits"
            )
        places.append((target, -1, linear))
    for target, index, linear in places:
        kind = TARGETS[target][1]
        # the output layer of a model with tied embeddings has no weight of its own: the embedding's
        weight = linear.weight if linear.weight is not None else cast(Any, model).shared_embedding_or_output_weight()
        gated = target == "linear_fc1" and bool(getattr(linear.config, "gated_linear_unit", False))
        slot = _slot(linear, target, index, gated)
        in_full, out_full = linear.input_size, linear.output_size
        g = torch.Generator().manual_seed(_seed(seed, name, index, target))
        bound = 1.0 / math.sqrt(in_full)
        a_full = (torch.rand(cfg.rank, in_full, generator=g, dtype=torch.float64) * 2 - 1) * bound
        a = slot.local("lora_A", a_full.to(torch.float32))
        b = torch.zeros(out_full // tp if kind == "column" else out_full, cfg.rank)
        pair = LoraPair(a.to(weight.device, weight.dtype).contiguous(), b.to(weight.device, weight.dtype), cfg)
        pair.train(linear.training)
        for which in ("lora_A", "lora_B"):  # what trainer.train.clip_grad_norm reads to sum shard norms
            dim = slot.sharded_dim(which)
            set_tensor_model_parallel_attributes(getattr(pair, which), dim is not None, dim or 0, 1)
        slot.adapters[name] = pair


def remove_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name`` (it must exist); if it was active, no adapter is active afterwards."""
    slots = [s for s in _slots(model) if name in s.adapters]
    if not slots:
        raise KeyError(f"no adapter {name!r} on this model (have: {', '.join(adapter_names(model)) or 'none'})")
    for slot in _slots(model):
        if name in slot.adapters:
            del slot.adapters[name]
        if slot.active == name:
            slot.active = None


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the adapters on ``model``, sorted."""
    return sorted({n for s in _slots(model) for n in s.adapters})


def adapter_config(model: nn.Module, name: str) -> LoraConfig:
    """The :class:`LoraConfig` adapter ``name`` was added with."""
    for slot in _slots(model):
        if name in slot.adapters:
            return cast(LoraPair, slot.adapters[name]).cfg
    raise KeyError(f"no adapter {name!r} on this model (have: {', '.join(adapter_names(model)) or 'none'})")


def active_adapter(model: nn.Module) -> str | None:
    """The active adapter's name, None when the model computes the base alone."""
    actives = {s.active for s in _slots(model)}
    return next(iter(actives)) if len(actives) == 1 else None


class Activation:
    """What :func:`activate` returns: already applied; as a context manager it restores the previous adapter."""

    def __init__(self, model: nn.Module, previous: str | None):
        self.model, self.previous = model, previous

    def __enter__(self) -> Activation:
        return self

    def __exit__(self, *exc: object) -> None:
        _set_active(self.model, self.previous)


def _set_active(model: nn.Module, name: str | None) -> None:
    for slot in _slots(model):
        slot.active = name


def activate(model: nn.Module, name: str | None) -> Activation:
    """Make adapter ``name`` the one the forward pass adds (None: the base model alone). Applied at once;
    ``with activate(model, "org"):`` restores the previously active adapter on exit."""
    if name is not None and name not in adapter_names(model):
        raise KeyError(f"no adapter {name!r} on this model (have: {', '.join(adapter_names(model)) or 'none'})")
    previous = active_adapter(model)
    _set_active(model, name)
    return Activation(model, previous)


def _pairs(model: nn.Module, name: str) -> Iterator[tuple[LoraSlot, LoraPair]]:
    found = False
    for slot in _slots(model):
        if name in slot.adapters:
            found = True
            yield slot, cast(LoraPair, slot.adapters[name])
    if not found:
        raise KeyError(f"no adapter {name!r} on this model (have: {', '.join(adapter_names(model)) or 'none'})")


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """This rank's parameters of adapter ``name`` (layer, target, A before B): what its optimizer steps."""
    return [p for _, pair in _pairs(model, name) for p in (pair.lora_A, pair.lora_B)]


def base_parameters(model: nn.Module) -> list[nn.Parameter]:
    """This rank's parameters of the base: the model's own, every adapter's left out (what the shared policy's
    optimizer steps and its checkpoints hold)."""
    adapters = {id(p) for name in adapter_names(model) for p in adapter_parameters(model, name)}
    return [p for p in unwrap(model).parameters() if id(p) not in adapters]


def scale_adapter(model: nn.Module, name: str, factor: float) -> None:
    """Multiply adapter ``name``'s effect by ``factor``: every ``lora_B`` (this rank's shards) in place, so each
    targeted linear's adapter term ``B A x * alpha / r`` becomes ``factor`` times what it was (exactly: the term
    is linear in B). Not collective."""
    with torch.no_grad():
        for _, pair in _pairs(model, name):
            pair.lora_B.mul_(factor)


def train_only(model: nn.Module, name: str) -> list[nn.Parameter]:
    """Freeze everything but adapter ``name``: ``requires_grad = False`` on every base parameter and every other
    adapter's, True on this one's, which are returned (:func:`adapter_parameters`). Does not activate it."""
    mine = adapter_parameters(model, name)
    ids = {id(p) for p in mine}
    for p in unwrap(model).parameters():
        p.requires_grad_(id(p) in ids)
    return mine


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` from every tensor-parallel rank, in rank order, on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, _ = _tp()
    if tp == 1:
        return [t]
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(out, t, group=ps.get_tensor_model_parallel_group())
    return out


def _full_tensors(model: nn.Module, name: str, of: Any) -> dict[str, torch.Tensor]:
    """``of(param)`` for each of the adapter's parameters, gathered to full tensors (collective over tp)."""
    out: dict[str, torch.Tensor] = {}
    for slot, pair in _pairs(model, name):
        for which in ("lora_A", "lora_B"):
            local = of(getattr(pair, which)).detach()
            shards = [local] if slot.sharded_dim(which) is None else _gather(local)
            out[slot.key(which)] = slot.full(which, shards).clone()  # never a view of a live parameter
    return out


def adapter_state_dict(model: nn.Module, name: str, grads: bool = False) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s full tensors (the tp = 1 layout, so the same at any tp), keyed
    ``decoder.layers.{i}.{self_attention|mlp}.{target}.lora_A|lora_B`` (and ``output_layer.lora_A|lora_B``, its
    ``B`` with the padded vocabulary rows); with ``grads`` their gradients
    (zeros where None). Collective over the tensor-parallel group: every rank calls it and gets the whole."""

    def of(p: torch.Tensor) -> torch.Tensor:
        if not grads:
            return p.detach()
        return p.grad.detach() if p.grad is not None else torch.zeros_like(p)

    return _full_tensors(model, name, of)


def load_adapter_state_dict(model: nn.Module, name: str, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (as :func:`adapter_state_dict` gives) into adapter ``name``; each rank takes its slice.
    The keys must be exactly the adapter's and the shapes full ones (else ValueError, nothing copied)."""
    pairs = list(_pairs(model, name))
    want = {slot.key(w) for slot, _ in pairs for w in ("lora_A", "lora_B")}
    if set(state) != want:
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        raise ValueError(f"adapter {name!r} state does not fit: missing {missing[:4]}, unexpected {extra[:4]}")
    updates = []
    for slot, pair in pairs:
        for which in ("lora_A", "lora_B"):
            param = getattr(pair, which)
            local = slot.local(which, state[slot.key(which)])
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(
                    f"{slot.key(which)}: full shape {tuple(state[slot.key(which)].shape)} gives {tuple(local.shape)} "
                    f"on tensor-parallel rank {slot.tp_rank}, the adapter has {tuple(param.shape)}"
                )
            updates.append((param, local))
    with torch.no_grad():
        for param, local in updates:
            param.copy_(local)


# --------------------------------------------------------------------------- checkpoints


@dataclass
class AdapterCheckpoint:
    """What :func:`load_adapter` restored."""

    path: Path
    step: int
    base: str
    """The base model (name/version) the adapter was trained on."""
    extra: dict[str, Any] = field(default_factory=dict)
    config: LoraConfig = field(default_factory=LoraConfig)


def _opt_entries(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"adapter checkpoints support torch.optim.Adam/AdamW, got {type(optimizer).__name__}")
    have = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if have != {id(p) for p in params}:
        raise ValueError("the optimizer must hold exactly the adapter's parameters (adapter_parameters(model, name))")


def _moment_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")


def _jsonable_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for g in optimizer.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            d[k] = list(v) if isinstance(v, tuple) else v
        out.append(d)
    return out


def save_adapter(
    root: str | os.PathLike,
    model: nn.Module,
    name: str,
    step: int,
    base: str,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save adapter ``name`` (and ``optimizer``'s state over exactly its parameters) as ``root/step_<step>``.

    Collective (every rank of the model calls it; rank 0 writes the tensors, every rank its RNG state).
    ``base`` names the base model the adapter is trained on; ``extra`` must be JSON (Kafka offsets ...).
    Written under a hidden name, renamed into place, then marked complete; an incomplete folder of the same
    step (an interrupted save) is replaced, a complete one is refused (FileExistsError). Hidden folders that
    interrupted saves left under ``root`` are removed: one training process saves under a ``root``."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    model = unwrap(model)
    extra = dict(extra or {})
    extra_text = json.dumps(extra, sort_keys=True)  # fail before touching the disk
    cfg = adapter_config(model, name)
    params = adapter_parameters(model, name)
    if optimizer is not None:
        _opt_entries(optimizer, params)
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    root = Path(root).absolute()
    final = checkpoint.step_dir(root, step)

    tensors = {k: v.cpu().contiguous() for k, v in adapter_state_dict(model, name).items()}
    moments: dict[str, torch.Tensor] = {}
    opt_meta: dict[str, Any] | None = None
    if optimizer is not None:
        steps = {float(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state[p]}
        for key in _moment_keys(optimizer):

            def of(p: torch.Tensor, key: str = key) -> torch.Tensor:
                st = optimizer.state.get(p, {})
                return st[key].detach() if key in st else torch.zeros_like(p)

            for k, v in _full_tensors(model, name, of).items():
                moments[f"{k}/{key}"] = v.cpu().contiguous()
        opt_meta = {
            "type": type(optimizer).__name__,
            "step": max(steps, default=0.0),
            "param_groups": _jsonable_groups(optimizer),
        }

    tmp = None
    err = None
    if rank == 0:
        if checkpoint.is_complete(final):
            err = f"adapter checkpoint {final} already exists and is complete; save another step"
        else:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-step_*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
            (tmp / checkpoint.RNG_DIR).mkdir(parents=True)
    shared = [err, str(tmp) if tmp else None]
    if initialized:
        dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise FileExistsError(shared[0])
    tmp = Path(str(shared[1]))
    layout = {"world_size": dist.get_world_size() if initialized else 1, "tp": _tp()[0]}
    rng = json.dumps({"layout": layout, "rng": checkpoint.rng_state()})
    checkpoint._write_atomic(tmp / checkpoint.RNG_DIR / f"rank{rank}.json", rng)
    if rank == 0:
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        if moments:
            save_file(moments, str(tmp / OPTIMIZER_FILE), metadata={"format": "pt"})
        state = {
            "format": FORMAT_VERSION,
            "adapter": name,
            "config": asdict(cfg),
            "base": base,
            "step": step,
            "optimizer": opt_meta,
            "layout": layout,
            "extra": json.loads(extra_text),
        }
        checkpoint._write_atomic(tmp / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))
        for f in (ADAPTER_FILE, OPTIMIZER_FILE):
            if (tmp / f).exists():
                checkpoint.fsync_path(tmp / f)
    if initialized:
        dist.barrier()  # every rank's RNG file is in the folder
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)  # an interrupted save of this step (no marker: checked above)
        os.replace(tmp, final)
        checkpoint.fsync_path(root)
        marker = {"format": FORMAT_VERSION, "step": step, "saved_at": time.time(), "adapter": name, "base": base}
        checkpoint._write_atomic(final / checkpoint.MARKER, json.dumps(marker, sort_keys=True))
    if initialized:
        dist.barrier()
    return final


def latest_adapter(root: str | os.PathLike) -> Path | None:
    """The newest complete adapter checkpoint under ``root`` (highest step), None if there is none.
    Hidden temporary folders and folders without the ``COMPLETE`` marker are skipped."""
    return checkpoint.latest(root)


def read_adapter_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The ``state.json`` of a complete adapter checkpoint (step, base, config, extra ...), no tensors."""
    path = Path(path)
    if not checkpoint.is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete adapter checkpoint (no {checkpoint.MARKER} marker)")
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
    return state


def load_adapter(
    path: str | os.PathLike,
    model: nn.Module,
    name: str,
    optimizer: torch.optim.Optimizer | None = None,
    base: str | None = None,
    restore_rng: bool = True,
) -> AdapterCheckpoint:
    """Load the adapter checkpoint ``path`` into adapter ``name`` of ``model`` (added with the checkpoint's config
    if absent; an existing one must have that config) and its optimizer state into ``optimizer`` (holding exactly
    the adapter's parameters). Any tp: every rank takes its slices. ``base``, when given, must equal the base
    the checkpoint was trained on (ConfigError otherwise). RNG states are restored when the layout is the same.
    Not collective (reads only)."""
    from safetensors.torch import load_file

    path = Path(path)
    state = read_adapter_checkpoint(path)
    if base is not None and state["base"] != base:
        raise ConfigError(
            f"adapter checkpoint {path} was trained on base {state['base']!r}, this model is {base!r}; "
            "fix: load it on that base, or start the adapter afresh"
        )
    saved = state["config"]
    cfg = LoraConfig(
        rank=saved["rank"], alpha=saved["alpha"], targets=tuple(saved["targets"]), dropout=saved["dropout"]
    )
    if name not in adapter_names(model):
        add_adapter(model, name, cfg)
    elif adapter_config(model, name) != cfg:
        raise ConfigError(f"adapter {name!r} has {adapter_config(model, name)}, checkpoint {path} holds {cfg}")
    load_adapter_state_dict(model, name, load_file(str(path / ADAPTER_FILE)))
    if optimizer is not None:
        meta = state.get("optimizer")
        if not meta:
            raise ValueError(f"adapter checkpoint {path} holds no optimizer state; load it with optimizer=None")
        params = adapter_parameters(model, name)
        _opt_entries(optimizer, params)
        moments = load_file(str(path / OPTIMIZER_FILE))
        keys = _moment_keys(optimizer)
        for slot, pair in _pairs(model, name):
            for which in ("lora_A", "lora_B"):
                p = getattr(pair, which)
                st: dict[str, Any] = {"step": torch.tensor(float(meta["step"]), dtype=torch.float32)}
                for key in keys:
                    full = moments.get(f"{slot.key(which)}/{key}")
                    if full is None:
                        raise ValueError(f"adapter checkpoint {path} has no {key} for {slot.key(which)}")
                    st[key] = slot.local(which, full).to(p.device, p.dtype).clone()
                optimizer.state[p] = st
        groups = meta.get("param_groups") or []
        if len(groups) == len(optimizer.param_groups):
            for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
                for k, v in saved_group.items():
                    if k in group and not isinstance(group[k], torch.Tensor):
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v
    if restore_rng:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        rng_file = path / checkpoint.RNG_DIR / f"rank{rank}.json"
        if rng_file.is_file():
            rng = json.loads(rng_file.read_text())
            world = dist.get_world_size() if dist.is_initialized() else 1
            if rng["layout"] == {"world_size": world, "tp": _tp()[0]}:
                checkpoint.set_rng_state(rng["rng"])
    return AdapterCheckpoint(path=path, step=int(state["step"]), base=state["base"], extra=state["extra"], config=cfg)


# --------------------------------------------------------------------------- PEFT


def _hf_modules(target: str, layer: int) -> tuple[str, ...]:
    if target in MODEL_TARGETS:
        return HF_MODULES[target]
    return tuple(f"model.layers.{layer}.{m}" for m in HF_MODULES[target])


def _check_hf(model_cfg: ModelConfig) -> None:
    from trainer.hf.layout import name_table

    name_table(model_cfg)  # RMSNorm + SwiGLU + RoPE (Llama, Qwen2, Qwen3) or ConfigError


def export_peft(
    model: nn.Module, model_cfg: ModelConfig, name: str, out_dir: str | os.PathLike, base_model_name_or_path: str = ""
) -> Path:
    """Write adapter ``name`` as a Hugging Face PEFT LoRA folder ``out_dir`` (collective over tp; rank 0 writes).

    ``adapter_config.json`` (``peft_type`` LORA, ``task_type`` CAUSAL_LM, r, lora_alpha, lora_dropout, the HF
    ``target_modules``) and ``adapter_model.safetensors`` with keys
    ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` / ``.lora_B.weight`` (and
    ``base_model.model.lm_head.lora_A.weight`` / ``.lora_B.weight``, the real vocabulary's rows), in the
    base weights' dtype: what ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loader read. For models
    :mod:`trainer.hf` converts (Llama, Qwen2, Qwen3). ``out_dir`` must be absent or empty."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from trainer.hf.layout import split_qkv

    _check_hf(model_cfg)
    cfg = adapter_config(model, name)
    out = Path(out_dir)
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    err = None
    if rank == 0 and out.exists() and (not out.is_dir() or any(out.iterdir())):
        err = f"PEFT export folder {out} exists and is not empty; export to a new folder"
    flag = [err]
    if initialized:
        dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        raise FileExistsError(flag[0])
    full = adapter_state_dict(model, name)
    tensors: dict[str, torch.Tensor] = {}
    for slot, _ in _pairs(model, name):
        a, b = full[slot.key("lora_A")], full[slot.key("lora_B")]
        modules = _hf_modules(slot.target, slot.layer)
        if slot.target == "linear_qkv":
            bs: tuple[torch.Tensor, ...] = split_qkv(b, model_cfg)
        elif slot.target == "linear_fc1":
            bs = tuple(b.chunk(2))  # [gate; up], as trainer.hf takes the weight apart
        elif slot.target == "output_layer":
            bs = (b[: model_cfg.vocab_size],)  # the padded vocabulary rows are cut off, as export_hf does
        else:
            bs = (b,)
        for module, b_part in zip(modules, bs, strict=True):
            # own storage per tensor: q, k and v rows of one B are views, and A is shared
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.cpu().clone(memory_format=torch.contiguous_format)
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.cpu().clone(memory_format=torch.contiguous_format)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path or None,
            "r": cfg.rank,
            "lora_alpha": int(cfg.alpha) if cfg.alpha.is_integer() else cfg.alpha,  # PEFT and vLLM type it int
            "lora_dropout": cfg.dropout,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for t in cfg.targets for m in HF_MODULES[t]}),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "lora_bias": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": None,
        }
        save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
        (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if initialized:
        dist.barrier()
    return out


def _peft_refuse(folder: Path, what: str) -> ConfigError:
    return ConfigError(f"PEFT adapter {folder}: {what}")


def load_peft(model: nn.Module, model_cfg: ModelConfig, name: str, folder: str | os.PathLike) -> LoraConfig:
    """Add adapter ``name`` to ``model`` from a PEFT LoRA folder (as :func:`export_peft` writes), re-fusing
    q/k/v into ``linear_qkv`` (with :func:`trainer.hf.layout.interleave_qkv`) and gate/up into ``linear_fc1``; each
    rank takes its slices. Fused modules share one ``A`` here, so their HF ``lora_A`` must be equal, and all of
    q/k/v (gate/up) must be targeted or none; anything else PEFT-specific (DoRA, rsLoRA, LoRA biases, rank or
    alpha patterns, modules_to_save, a subset of layers) is refused with a ConfigError. Returns the config."""
    from safetensors.torch import load_file

    from trainer.hf.layout import interleave_qkv, qkv_geometry

    _check_hf(model_cfg)
    folder = Path(folder)
    if not (folder / PEFT_CONFIG).is_file() or not (folder / PEFT_WEIGHTS).is_file():
        raise _peft_refuse(folder, f"needs {PEFT_CONFIG} and {PEFT_WEIGHTS}")
    c = json.loads((folder / PEFT_CONFIG).read_text())
    if c.get("peft_type") != "LORA":
        raise _peft_refuse(folder, f"peft_type = {c.get('peft_type')!r}, only LORA is supported")
    for key, ok in (
        ("bias", "none"),
        ("use_rslora", False),
        ("use_dora", False),
        ("lora_bias", False),
        ("fan_in_fan_out", False),
    ):
        if c.get(key, ok) != ok:
            raise _peft_refuse(folder, f"{key} = {c.get(key)!r} is not supported (only {ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "target_parameters"):
        if c.get(key):
            raise _peft_refuse(folder, f"{key} = {c.get(key)!r} is not supported")
    modules = c.get("target_modules")
    if not isinstance(modules, list):
        raise _peft_refuse(folder, f"target_modules = {modules!r} must be a list of module names")
    short = {t: {m.rsplit(".", 1)[-1] for m in ms} for t, ms in HF_MODULES.items()}
    allowed = set().union(*short.values())
    if unknown := sorted(set(modules) - allowed):
        raise _peft_refuse(folder, f"target_modules {unknown} have no megatron counterpart here")
    targets = []
    for target, names in short.items():
        have = names & set(modules)
        if have and have != names:
            raise _peft_refuse(
                folder,
                f"targets {sorted(have)} but not {sorted(names - have)}: megatron fuses them into {target}; "
                "fix: train the adapter on all of them or none",
            )
        if have:
            targets.append(target)
    cfg = LoraConfig(
        rank=int(c["r"]), alpha=float(c["lora_alpha"]), targets=tuple(targets), dropout=float(c.get("lora_dropout", 0))
    )
    raw = load_file(str(folder / PEFT_WEIGHTS))
    if bad := sorted(k for k in raw if not k.startswith(PEFT_PREFIX)):
        raise _peft_refuse(folder, f"tensor names without the {PEFT_PREFIX!r} prefix: {bad[:3]}")
    weights = {k[len(PEFT_PREFIX) :]: v for k, v in raw.items()}
    used: set[str] = set()

    def get(module: str, which: str) -> torch.Tensor:
        key = f"{module}.{which}.weight"
        if key not in weights:
            raise _peft_refuse(folder, f"tensor {PEFT_PREFIX}{key} is missing")
        used.add(key)
        return weights[key]

    state: dict[str, torch.Tensor] = {}
    for target in (t for t in targets if t in MODEL_TARGETS):  # lm_head: zero rows for the padded vocabulary
        (module,) = _hf_modules(target, -1)
        b = get(module, "lora_B")
        if b.shape[0] != model_cfg.vocab_size:
            raise _peft_refuse(
                folder,
                f"{module}.lora_B has {b.shape[0]} rows, this model's vocabulary {model_cfg.vocab_size}: an adapter "
                "of another vocabulary",
            )
        state[f"{TARGETS[target][0]}.lora_A"] = get(module, "lora_A")
        pad = model_cfg.padded_vocab_size - b.shape[0]
        state[f"{TARGETS[target][0]}.lora_B"] = torch.cat([b, b.new_zeros(pad, b.shape[1])]) if pad > 0 else b
    for layer in range(model_cfg.num_layers):
        for target in (t for t in targets if t not in MODEL_TARGETS):
            mods = _hf_modules(target, layer)
            a_s = [get(m, "lora_A") for m in mods]
            b_s = [get(m, "lora_B") for m in mods]
            if any(not torch.equal(a, a_s[0]) for a in a_s[1:]):
                raise _peft_refuse(
                    folder,
                    f"{', '.join(mods)} have different lora_A: megatron's fused {target} shares one A, so this adapter "
                    "cannot be fused exactly; fix: train it with one A for them (export_peft does) or merge it",
                )
            key = f"decoder.layers.{layer}.{TARGETS[target][0]}"
            state[f"{key}.lora_A"] = a_s[0]
            if target == "linear_qkv":
                state[f"{key}.lora_B"] = interleave_qkv(b_s[0], b_s[1], b_s[2], qkv_geometry(model_cfg)[0])
            else:
                state[f"{key}.lora_B"] = torch.cat(b_s)
    if extra := sorted(set(weights) - used):
        raise _peft_refuse(folder, f"tensors with no place in this model: {extra[:4]}")
    add_adapter(model, name, cfg)
    try:
        load_adapter_state_dict(model, name, state)
    except ValueError as e:
        remove_adapter(model, name)
        raise _peft_refuse(folder, str(e)) from None
    return cfg
