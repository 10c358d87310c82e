"""No micro-batch and no sample is trained twice, even when the batch flow replays after a crash.

The batch flow is at-least-once: after a kill -9 it resumes from its last snapshot and sends the
micro-batches since then again - usually with the same ids, but a cohort flushed by its wall-clock
idle timer before the crash may be packed differently on replay, so the same samples can come back
inside a micro-batch with a new id. :class:`TrainedSet` remembers the ids of the micro-batches and
samples the trainer has taken (per policy version, only as far back as ``max_policy_lag`` - or, for
delayed samples, ``max_delayed_lag`` - can reach: older samples are dropped as stale anyway), skips a micro-batch it has seen, and turns
samples it has seen into padding (:func:`drop_samples`). Its :meth:`state` goes into every
checkpoint, so a resumed trainer knows exactly what its weights have seen.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from trainer.batch import Batch


def drop_samples(batch: Batch, keep: list[bool]) -> Batch:
    """``batch`` with the samples where ``keep`` is False turned into padding (segment -1, no loss),
    ``sample_ids``/``policy_versions`` (and the per-sample ``delayed``/``adapter_versions``) reduced to the kept
    ones and segment ids renumbered."""
    if all(keep):
        return batch
    remap = np.full(len(keep) + 1, -1, dtype=np.int64)  # index -1 (padding) maps to the last slot: -1
    kept = [i for i, k in enumerate(keep) if k]
    remap[kept] = np.arange(len(kept))
    seg = remap[batch.segment_ids]
    return replace(
        batch,
        segment_ids=seg,
        loss_mask=np.where(seg >= 0, batch.loss_mask, 0).astype(np.float32),
        sample_ids=[batch.sample_ids[i] for i in kept],
        policy_versions=batch.policy_versions[kept],
        delayed=None if batch.delayed is None else batch.delayed[kept],
        adapter_versions=None if batch.adapter_versions is None else batch.adapter_versions[kept],
    )


class TrainedSet:
    """Micro-batch and sample ids already trained on, per policy version of the sample.

    :meth:`take` checks a micro-batch against what is trained and what the current step has taken;
    :meth:`commit` after the optimizer step makes the step's batches trained, :meth:`discard` forgets
    them when the step is abandoned (they will be read again)."""

    def __init__(self, state: dict | None = None):
        self.restore(state or {})

    def restore(self, state: dict) -> None:
        self.batches: dict[int, set[str]] = {int(v): set(ids) for v, ids in state.get("batches", {}).items()}
        self.samples: dict[int, set[str]] = {int(v): set(ids) for v, ids in state.get("samples", {}).items()}
        self.repeated_batches = int(state.get("repeated_batches", 0))
        self.repeated_samples = int(state.get("repeated_samples", 0))
        self._pending: list[tuple[int, str, list[tuple[int, str]]]] = []
        self._pending_repeats = (0, 0)

    def _seen(self, d: dict[int, set[str]], version: int, key: str) -> bool:
        return key in d.get(version, ())

    def take(
        self,
        batch: Batch,
        trainable: tuple[int, int] | None = None,
        delayed_trainable: tuple[int, int] | None = None,
    ) -> Batch | None:
        """What of ``batch`` is new: None for a micro-batch already taken or one whose samples all were,
        else the batch with already-trained samples made padding.

        ``trainable`` = (oldest, newest) policy version the trainer learns from now: only those samples
        count as trained; the others stay in the batch for the trainer to mask and count as stale, and a
        micro-batch with none of them is not remembered (a replay that arrives too late trains nothing).
        ``delayed_trainable`` is that window for the batch's delayed samples (None = ``trainable``)."""
        everything = (-(2**62), 2**62)
        window = trainable if trainable is not None else everything
        delayed_window = delayed_trainable if delayed_trainable is not None else window
        flags = batch.delayed if batch.delayed is not None else [False] * len(batch.sample_ids)
        windows = [delayed_window if d else window for d in flags]
        pending_batches = {b for _, b, _ in self._pending}
        pending_samples = {s for _, _, ss in self._pending for s in ss}
        rb, rs = self._pending_repeats
        if batch.batch_id in pending_batches or any(batch.batch_id in ids for ids in self.batches.values()):
            self._pending_repeats = (rb + 1, rs)
            return None
        keep = [
            not (lo <= int(v) <= hi and (self._seen(self.samples, int(v), sid) or (int(v), sid) in pending_samples))
            for sid, v, (lo, hi) in zip(batch.sample_ids, batch.policy_versions, windows)
        ]
        self._pending_repeats = (rb, rs + keep.count(False))
        out = drop_samples(batch, keep) if any(keep) else None
        kept_windows = [w for w, k in zip(windows, keep) if k]
        fresh = (
            []
            if out is None
            else [
                (int(v), s)
                for s, v, (lo, hi) in zip(out.sample_ids, out.policy_versions, kept_windows)
                if lo <= int(v) <= hi
            ]
        )
        if fresh:
            self._pending.append((max(v for v, _ in fresh), batch.batch_id, fresh))
        return out

    def step_ids(self) -> tuple[list[str], list[str]]:
        """The micro-batch ids and sample ids the current step trains on (taken, not yet committed)."""
        return [b for _, b, _ in self._pending], [sid for _, _, ss in self._pending for _, sid in ss]

    def commit(self) -> None:
        for newest, batch_id, samples in self._pending:
            self.batches.setdefault(newest, set()).add(batch_id)
            for v, sid in samples:
                self.samples.setdefault(v, set()).add(sid)
        self.repeated_batches += self._pending_repeats[0]
        self.repeated_samples += self._pending_repeats[1]
        self.discard()

    def discard(self) -> None:
        self._pending, self._pending_repeats = [], (0, 0)

    def prune(self, oldest_version: int) -> None:
        """Forget versions below ``oldest_version`` (their samples are too stale to be trained again)."""
        for d in (self.batches, self.samples):
            for v in [v for v in d if v < oldest_version]:
                del d[v]

    def state(self) -> dict:
        """Plain JSON for a checkpoint's extra state."""
        return {
            "batches": {str(v): sorted(ids) for v, ids in sorted(self.batches.items())},
            "samples": {str(v): sorted(ids) for v, ids in sorted(self.samples.items())},
            "repeated_batches": self.repeated_batches,
            "repeated_samples": self.repeated_samples,
        }
