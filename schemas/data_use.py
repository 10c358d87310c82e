"""Data-use classes: what rtrl may do with one trajectory's data, from the most to the least permissive.

A trajectory's class is the stricter of the product's choice (``start_trajectory(..., data_use=...)``) and its
organisation's policy (settings ``governance.default`` and ``governance.orgs.NAME``). Every hop applies it again:

- ``train``: trains the shared policy and its organisation's adapter;
- ``adapter_only``: trains only its own organisation's adapter, never the shared policy;
- ``monitor_only``: events and rewards serve monitoring, the gate and A/B; no token is stored or trained;
- ``none``: nothing leaves the SDK.
"""

from __future__ import annotations

from typing import Literal, get_args

DataUse = Literal["train", "adapter_only", "monitor_only", "none"]

#: the classes from the most to the least permissive
DATA_USES: tuple[DataUse, ...] = get_args(DataUse)


def stricter(*classes: DataUse) -> DataUse:
    """The strictest of ``classes`` (``train`` for none given)."""
    return max(classes, key=DATA_USES.index, default="train")


def trains_shared(data_use: str) -> bool:
    """Whether a sample of this class may train the shared policy."""
    return data_use == "train"


def trains_adapter(data_use: str) -> bool:
    """Whether a sample of this class may train its own organisation's adapter."""
    return data_use in ("train", "adapter_only")


def keeps_tokens(data_use: str) -> bool:
    """Whether a trajectory of this class may have its prompt and completion tokens stored."""
    return trains_adapter(data_use)
