"""The SDK's section and the data governance it applies first (:mod:`client.sdk`, docs/governance.md)."""

from __future__ import annotations

from pydantic import Field

from rtrl.section import Section, setting
from schemas.data_use import DataUse, stricter

#: the SDK's salt when none is set: public (it is in this file), so refused outside local mode
DEFAULT_SALT = "rtrl-local-dev-salt"


class SdkSettings(Section):
    salt: str = setting(
        DEFAULT_SALT,
        "secret salt for hashing user ids; the default is public and refused outside local mode (services "
        "not on loopback): set your own, e.g. with RTRL_SDK__SALT",
        min_length=8,
        repr=False,
    )
    queue_size: int = setting(100_000, "events the SDK buffers before it drops (and counts) new ones", gt=0)
    linger_ms: int = setting(5, "producer linger: how long to wait to fill a batch", ge=0)
    delivery_timeout_s: float = setting(
        300.0, "how long the producer retries an event before reporting it failed", gt=0
    )
    max_event_bytes: int = setting(64 * 1024, "largest encoded event accepted anywhere in rtrl", gt=0)
    max_future_s: float = setting(
        600.0, "the SDK refuses an event stamped further ahead of its clock (clock skew allowed)", gt=0
    )
    max_past_s: float = setting(
        7 * 86400.0,
        "the SDK refuses an event stamped further behind its clock (older than the events topic keeps)",
        gt=0,
    )


class GovernanceSettings(Section):
    """What rtrl may do with each organisation's data (issue 38, docs/governance.md).

    A trajectory's data-use class is the stricter of the product's choice (``start_trajectory(..., data_use=...)``)
    and its org's policy here. The SDK, the batch flow and the trainer each apply it again. A change of policy
    applies to what is handled after it; erasure handles the past.
    """

    default: DataUse = setting(
        "train",
        "data-use class of every org not in governance.orgs: train (the shared policy and the org's adapter), "
        "adapter_only (only the org's own adapter), monitor_only (events and rewards for monitoring; no token "
        "stored or trained) or none (nothing leaves the SDK)",
    )
    orgs: dict[str, DataUse] = Field(
        default_factory=dict,
        description="data-use class per organisation [governance.orgs] (org = class); the stricter of it and the "
        "product's choice wins",
    )
    secret_scanner: str = setting(
        "detect-secrets",
        "what screens each rollout's decoded text for secrets before the SDK sends it: detect-secrets, "
        "'package.module:Class' (a scan(text) method), or '' for none; a rollout with a secret is kept back and its "
        "trajectory is monitor_only (client/screening.py)",
    )
    deny_refresh_s: float = setting(
        10.0,
        "seconds between each consumer's reads of the erased subjects (the deny list of `rtrl erase`); "
        "`rtrl erase` waits this long after listing a subject before it deletes, so no consumer writes it back",
        gt=0,
    )

    def policy(self, org: str) -> DataUse:
        """The org's data-use class under these settings."""
        return self.orgs.get(org, self.default)

    def effective(self, org: str, *requested: DataUse) -> DataUse:
        """The class a trajectory of ``org`` gets: the strictest of its org's policy and ``requested``."""
        return stricter(self.policy(org), *requested)
