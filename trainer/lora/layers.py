"""The LoRA modules on megatron's linears: an adapter's shape, its tensors, the slot and hook that apply it.

:class:`rtrl.sections.trainer.LoraConfig` is an adapter's shape, :class:`LoraPair` its tensors on one linear,
:class:`LoraSlot` the child module of a targeted linear that holds its adapters by name, and a forward hook adds
the active adapter's term to the linear's output; :func:`_slot` attaches them.

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
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from torch import nn

from rtrl.sections.trainer import LORA_TARGETS, LoraConfig
from trainer.checkpoint import unwrap

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
assert tuple(TARGETS) == LORA_TARGETS, "rtrl.sections.trainer.LORA_TARGETS names the targets, in this order"
SLOT = "lora_adapters"
"""The attribute (child module) of a targeted linear that holds its adapters."""


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
