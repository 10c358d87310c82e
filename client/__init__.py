"""rtrl client instrumentation SDK: what a product backend calls to record a trajectory.

from client import RtrlClient
with RtrlClient(bootstrap="localhost:9092", salt=SECRET) as rtrl:
    t = rtrl.start_trajectory(org_id="acme", user_id="u-42", task_kind="bugfix", policy_version=7)
    t.tool_call("grep", valid=True)
    edit = t.edit_proposed(lines=12)
    t.edit_accepted(edit)
    t.end("completed")

A secured cluster (TLS, SASL PLAIN/SCRAM, OAUTHBEARER): ``RtrlClient.from_settings(load_settings())`` takes
the ``kafka`` settings from ``RTRL_KAFKA__*`` (docs/production.md), or pass librdkafka's properties,
``RtrlClient(bootstrap=..., salt=SECRET, security={"security.protocol": "SASL_SSL", ...})``.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client.hashing import hash_user
    from client.sdk import ClientStats, InvalidEvent, RtrlClient, Trajectory

#: the module each name lives in: it loads on first use, so importing the package loads no Kafka client
_HOME = {
    "hash_user": "client.hashing",
    "ClientStats": "client.sdk",
    "InvalidEvent": "client.sdk",
    "RtrlClient": "client.sdk",
    "Trajectory": "client.sdk",
}
__all__ = ["ClientStats", "InvalidEvent", "RtrlClient", "Trajectory", "hash_user"]


def __getattr__(name: str) -> object:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
