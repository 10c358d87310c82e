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

The package re-exports every public name of its modules, one concern each:

- :class:`rtrl.sections.trainer.LoraConfig`: an adapter's shape (beside the ``adapters`` section that makes it).
- :mod:`trainer.lora.layers`: the modules on a targeted linear (:class:`LoraPair`, :class:`LoraSlot`), the forward
  hook, and the tensor-parallel layout of an adapter's tensors.
- :mod:`trainer.lora.adapters`: the adapters on a model: :func:`add_adapter`, :func:`remove_adapter`,
  :func:`activate`, their parameters (:func:`train_only`) and full state dicts (:func:`adapter_state_dict`).
- :mod:`trainer.lora.checkpoint`: adapter checkpoints (:func:`save_adapter`, :func:`load_adapter`,
  :func:`latest_adapter`).
- :mod:`trainer.lora.peft`: Hugging Face PEFT export and import (:func:`export_peft`, :func:`load_peft`).
"""

from __future__ import annotations

from rtrl.sections.trainer import LoraConfig
from trainer.lora.adapters import (
    Activation,
    activate,
    active_adapter,
    adapter_config,
    adapter_names,
    adapter_parameters,
    adapter_state_dict,
    add_adapter,
    base_parameters,
    load_adapter_state_dict,
    remove_adapter,
    scale_adapter,
    train_only,
)
from trainer.lora.checkpoint import (
    ADAPTER_FILE,
    FORMAT_VERSION,
    OPTIMIZER_FILE,
    STATE_FILE,
    AdapterCheckpoint,
    latest_adapter,
    load_adapter,
    read_adapter_checkpoint,
    save_adapter,
)
from trainer.lora.layers import MODEL_TARGETS, SLOT, TARGETS, LoraPair, LoraSlot
from trainer.lora.peft import HF_MODULES, PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, export_peft, load_peft

__all__ = [
    # layers
    "MODEL_TARGETS",
    "SLOT",
    "TARGETS",
    "LoraConfig",
    "LoraPair",
    "LoraSlot",
    # adapters on a model
    "Activation",
    "activate",
    "active_adapter",
    "adapter_config",
    "adapter_names",
    "adapter_parameters",
    "adapter_state_dict",
    "add_adapter",
    "base_parameters",
    "load_adapter_state_dict",
    "remove_adapter",
    "scale_adapter",
    "train_only",
    # checkpoints
    "ADAPTER_FILE",
    "FORMAT_VERSION",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "AdapterCheckpoint",
    "latest_adapter",
    "load_adapter",
    "read_adapter_checkpoint",
    "save_adapter",
    # PEFT
    "HF_MODULES",
    "PEFT_CONFIG",
    "PEFT_PREFIX",
    "PEFT_WEIGHTS",
    "export_peft",
    "load_peft",
]
