"""What every flow builder needs to wire its inputs and outputs: the broker address it may use, and a
check that injected sources or sinks name exactly the flow's inputs or outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtrl.errors import ConfigError
from rtrl.kafka import KafkaConnection, connection
from rtrl.settings import Settings


def require_bootstrap(settings: Settings, bootstrap: str | None) -> KafkaConnection:
    """``bootstrap`` or ``kafka.bootstrap``, with the ``kafka`` section's security (:func:`rtrl.kafka.connection`);
    a ConfigError with the fix when neither is set (a flow never starts a broker itself: that is the
    application's job, ``rtrl flow NAME``)."""
    bootstrap = connection(settings.kafka, bootstrap)
    if not bootstrap:
        raise ConfigError(
            "kafka.bootstrap is empty and no broker address was given; fix: set kafka.bootstrap "
            "(RTRL_KAFKA__BOOTSTRAP), or run the flow with `rtrl flow NAME`, which starts the local broker"
        )
    return bootstrap


def injected(given: Mapping[str, Any], names: tuple[str, ...], what: str) -> dict[str, Any]:
    """``given`` as a dict when it maps exactly ``names`` (a flow's inputs or outputs); else ValueError."""
    if set(given) != set(names):
        raise ValueError(f"{what} must map exactly {list(names)}, got {sorted(given)}")
    return dict(given)
