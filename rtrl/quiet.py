"""The few third-party warnings nobody running rtrl can act on, silenced one by one.

Each entry names the category, the module that warns (a regex on its ``__name__``) and the start of the
message; nothing else is filtered, so a new or different warning still shows. Installed by every process
entry point (``rtrl``, ``python -m app.parts``, ``python -m trainer``) through :func:`quiet_known_warnings`.

Why each is harmless here:

- megatron-core on a machine without Transformer Engine or Apex falls back to its local fused-op and
  norm implementations and says so once per module (the CPU path and the CI machine never have them;
  on a GPU, ``precision.fp8`` without TE is refused with its own error, so nothing is hidden there);
- megatron's ``dist_checkpointing`` still calls torch's ``load_state_dict`` and uses ``ShardedTensor``,
  which torch marks deprecated: megatron's choice, not a setting of ours.
"""

from __future__ import annotations

import warnings

#: (category, module regex, message regex) of each silenced warning
KNOWN: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"megatron\.core(\.|$)", r"Transformer Engine and Apex are not installed\. Falling back"),
    (UserWarning, r"megatron\.core(\.|$)", r"Apex is not installed\. Falling back to Torch Norm"),
    (FutureWarning, r"megatron\.core\.dist_checkpointing(\.|$)", r"`load_state_dict` is deprecated"),
    (FutureWarning, r"torch\.distributed\.checkpoint(\.|$)", r"Please use DTensor instead and we are deprecating"),
    (DeprecationWarning, r"megatron\.core(\.|$)", r"Warning: tp_group is None, using default tp group"),
)


def quiet_known_warnings() -> None:
    """Ignore exactly the warnings in :data:`KNOWN` (by category, module and message); idempotent."""
    for category, module, message in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
