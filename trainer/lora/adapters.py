"""The adapters on a model: add, remove and activate them, their parameters and their full state dicts.

The full tensors (:func:`adapter_state_dict`) use the tp = 1 layout (the tensor-parallel layout of each rank's
shards: :mod:`trainer.lora.layers`). How :func:`add_adapter` makes an adapter, and what it refuses:

- Init: ``A`` uniform in ``±1/sqrt(in)`` (what kaiming-uniform with ``a = sqrt(5)`` gives), the full tensor
  drawn from a ``torch.Generator`` seeded from ``(seed, adapter name, layer, target)`` and then sliced, so
  every tp gives the same global adapter and nothing needs syncing; ``B`` zeros, so a new adapter leaves
  the logits exactly unchanged.
- ``parallel.sequence_parallel`` is refused (the activations would be split along the sequence), and so is
  pipeline parallelism (pp > 1) for now. Dropout (``adapters.dropout``) uses the default torch generator;
  only dropout 0 gives tp-independent numbers.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from rtrl.errors import ConfigError
from rtrl.sections.trainer import LoraConfig
from trainer.checkpoint import unwrap
from trainer.lora.layers import MODEL_TARGETS, TARGETS, LoraPair, LoraSlot, _layers, _slot, _slots, _tp

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"adapter name {name!r} must be 1-64 letters, digits, '_' or '-' (e.g. an org id); fix: rename it"
        )


def _seed(seed: int, name: str, layer: int, target: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{layer}/{target}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


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
