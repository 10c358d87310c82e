"""Per-organisation routing of micro-batches (issue 17), free of Bytewax and I/O: which stream trains on each batch.

The batch flow packs micro-batches per cohort ``(org_id, task_kind)`` as before; every batch holds one org's
samples. A batch of an org the ``adapters`` settings do not want (:meth:`rtrl.sections.trainer.AdapterSettings.wants`)
goes to the shared policy's stream, ``<prefix>batches``, unchanged (under ``shared_traffic = "served"`` split
per serving adapter version when several served it: :func:`unrouted`). The batches of a wanted org pass one
:class:`OrgRouter` per org (a stateful step keyed by org in the flow) that counts the org's samples:

* until the org has sent ``adapters.min_samples`` samples (counted over the batches routed before this one, of
  the trained reward version only: the other versions' batches carry the same samples again), its batches go to
  the shared stream only, as they are (``adapter=""``; split as above under "served"): too little traffic to
  specialise on;
* from then on each batch goes to the org's adapter stream, ``<prefix>adapter-batches`` (``adapter=org``, its
  own ``batch_id``; keyed by org, so one org's batches stay in order on one partition), and

  - with ``adapters.shared_traffic = "all"`` also a copy to the shared stream (``adapter=""``,
    ``batch_id`` :func:`shared_copy_id` of the original): **the shared policy trains on all traffic**, so what
    every org has in common keeps improving the base the adapters sit on, and an org that loses its adapter
    falls back to a base that has seen its traffic;
  - with ``"unadapted"`` nothing goes to the shared stream: the shared policy trains only on the orgs without an
    adapter (an adapted org's convention cannot pull the base away from everyone else's).
  - with ``"served"`` (the default) the shared stream gets the copies as with ``"all"``, and the main job's shared-policy
    trainer trains each through the adapter version that served its samples (``MicroBatch.adapter_versions``,
    frozen), so its importance ratio compares against the real behaviour policy: a batch whose samples several
    adapter versions served (the org's adapter changed while its cohort filled) is **split** into one copy per
    version (:func:`split_by_adapter_version`; the other versions' samples made padding, ids
    :func:`shared_copy_id` of the original's id and the version). So is such a batch of an org the flow does not
    route to an adapter (:func:`split_mixed`: not in ``adapters.orgs`` any more, or under ``min_samples``).

A batch of ``adapter_only`` samples (:mod:`schemas.data_use`) goes to the org's adapter stream alone, from the org's
first sample on, and never to the shared stream. An org's samples therefore only ever reach its own adapter. Every id is a function of the batch alone: a batch
redelivered after a crash routes to the same ids, which the trainers' dedup (``batch_id``) drops. The router's
state is one counter per org (:meth:`OrgRouter.snapshot`); a resumed router takes the current settings'
threshold and traffic policy with the snapshot's count. Which batches cross the threshold depends on the order
in which an org's cohorts deliver theirs (several cohorts feed one org's router), like the batches' contents
depend on arrival order.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from schemas.data_use import trains_shared
from schemas.records import MicroBatch

SharedTraffic = Literal["all", "unadapted", "served"]


def shared_copy_id(batch_id: str) -> str:
    """The ``batch_id`` of the shared stream's copy of an adapter batch: a hash of the original's, so the same
    batch always makes the same copy, and the copy never shares an id with a batch of its own."""
    return hashlib.sha1(f"{batch_id}\nshared-copy".encode()).hexdigest()[:32]


def split_by_adapter_version(batch: MicroBatch) -> list[MicroBatch]:
    """The shared stream's copies of ``batch`` (``adapter=""``) under ``shared_traffic = "served"``: one, id
    :func:`shared_copy_id` of ``batch_id``, when one policy served every sample; else one per serving adapter
    version (0 = the base alone), in version order, each with the other versions' samples made padding (segment
    -1, no loss; the shape stays) and id :func:`shared_copy_id` of ``batch_id`` and the version."""
    versions = batch.adapter_versions or [0] * len(batch.sample_ids)
    if len(set(versions)) <= 1:
        return [msgspec.structs.replace(batch, batch_id=shared_copy_id(batch.batch_id), adapter="")]
    out = []
    rows = range(len(batch.token_ids))
    d = batch.delayed
    for v in sorted(set(versions)):
        kept = [i for i, a in enumerate(versions) if a == v]
        remap = {i: n for n, i in enumerate(kept)}

        def row(r: int, values: list, pad: object, remap: dict[int, int] = remap) -> list:
            return [x if g in remap else pad for x, g in zip(values, batch.segment_ids[r])]

        out.append(
            msgspec.structs.replace(
                batch,
                batch_id=shared_copy_id(f"{batch.batch_id}\na{v}"),
                adapter="",
                token_ids=[row(r, batch.token_ids[r], 0) for r in rows],
                loss_mask=[row(r, batch.loss_mask[r], 0) for r in rows],
                advantages=[row(r, batch.advantages[r], 0.0) for r in rows],
                behaviour_logprobs=[row(r, batch.behaviour_logprobs[r], 0.0) for r in rows],
                segment_ids=[[remap.get(g, -1) for g in batch.segment_ids[r]] for r in rows],
                sample_ids=[batch.sample_ids[i] for i in kept],
                policy_versions=[batch.policy_versions[i] for i in kept],
                delayed=[d[i] for i in kept] if d and any(d[i] for i in kept) else [],
                adapter_versions=[v] * len(kept) if v else [],
                served_org=batch.served_org if v else "",
            )
        )
    return out


def unrouted(batch: MicroBatch, shared_traffic: SharedTraffic) -> list[MicroBatch]:
    """What the shared stream gets for a batch of an org not routed to an adapter (not wanted, or under
    ``min_samples``): the batch, split per serving version under ``"served"`` (:func:`split_mixed`)."""
    return split_mixed(batch) if shared_traffic == "served" else [batch]


def split_mixed(batch: MicroBatch) -> list[MicroBatch]:
    """``batch`` as it is when one policy served all its samples; else its per-version copies
    (:func:`split_by_adapter_version`). What the shared stream gets under ``shared_traffic = "served"`` from an org
    the flow does not route to an adapter (not in ``adapters.orgs``, or under ``min_samples``): such an org may
    still hold samples an adapter served (dropped from ``adapters.orgs`` while its adapter served; a restart that
    lowered ``min_samples``), and the shared trainer trains a batch through one serving version only."""
    if len(set(batch.adapter_versions or [0])) <= 1:
        return [batch]
    return split_by_adapter_version(batch)


class OrgRouter:
    """One org's routing (see the module docstring): ``route`` a batch of the org's samples to the streams that
    train on it. ``reward_version``: only batches of this version count toward ``min_samples`` (empty: all)."""

    def __init__(
        self,
        org: str,
        min_samples: int,
        shared_traffic: SharedTraffic = "all",
        reward_version: str = "",
        samples: int = 0,
    ):
        if min_samples < 0:
            raise ValueError(f"min_samples must be >= 0, got {min_samples!r}")
        if shared_traffic not in ("all", "unadapted", "served"):
            raise ValueError(f"shared_traffic must be 'all', 'unadapted' or 'served', got {shared_traffic!r}")
        if not org:
            raise ValueError("an org router needs the org's id")
        self.org, self.min_samples, self.shared_traffic = org, min_samples, shared_traffic
        self.reward_version = reward_version
        self.samples = samples  # the org's samples routed so far (of the counted reward version)

    @property
    def adapted(self) -> bool:
        """Whether the org's batches go to its adapter stream now (it passed the traffic threshold)."""
        return self.samples >= self.min_samples

    def route(self, batch: MicroBatch) -> list[MicroBatch]:
        """The batches to send for ``batch`` (one of this org's): ``adapter=org`` ones for the adapter stream,
        ``adapter=""`` ones for the shared stream."""
        adapted = self.adapted
        if not self.reward_version or batch.reward_version == self.reward_version:
            self.samples += len(batch.sample_ids)
        if batch.data_use and not all(trains_shared(u) for u in batch.data_use):
            # adapter_only samples (schemas.data_use): the org's adapter only, from its first sample on, as the
            # shared policy may never train them (min_samples guards the shared policy's share of an org's traffic)
            return [msgspec.structs.replace(batch, adapter=self.org)]
        if not adapted:
            return unrouted(batch, self.shared_traffic)
        out = [msgspec.structs.replace(batch, adapter=self.org)]
        if self.shared_traffic == "all":
            out.append(msgspec.structs.replace(batch, batch_id=shared_copy_id(batch.batch_id), adapter=""))
        elif self.shared_traffic == "served":
            out += split_by_adapter_version(batch)
        return out

    def snapshot(self) -> dict:
        """The state a restart resumes from: the org and its count (the settings come from the restart's)."""
        return {"org": self.org, "samples": self.samples}

    @classmethod
    def resume(
        cls,
        state: dict | None,
        org: str,
        min_samples: int,
        shared_traffic: SharedTraffic = "all",
        reward_version: str = "",
    ) -> OrgRouter:
        """A router for ``org`` under the current settings, with the count of ``state`` (None: a new org)."""
        return cls(org, min_samples, shared_traffic, reward_version, samples=int((state or {}).get("samples", 0)))
