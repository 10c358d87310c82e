"""One micro-batch as the trainer uses it: validated arrays decoded from the Arrow IPC payload (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.codec import decode_batch


@dataclass(frozen=True)
class Batch:
    """One validated micro-batch as arrays (rows x seq_len) plus where it came from."""

    batch_id: str
    tokens: np.ndarray  # int64
    loss_mask: np.ndarray  # float32
    advantages: np.ndarray  # float32
    behaviour_logprobs: np.ndarray  # float32
    segment_ids: np.ndarray  # int64, -1 = padding
    sample_ids: list[str]
    policy_versions: np.ndarray  # int64, per sample
    partition: int
    offset: int


def to_batch(data: bytes, partition: int, offset: int) -> Batch:
    """Decode and validate one Arrow IPC micro-batch (raises Invalid with the reason)."""
    mb = decode_batch(data)  # full validation: schema, shapes, segment ids
    seq, rows = mb.seq_len, len(mb.token_ids)
    return Batch(
        batch_id=mb.batch_id,
        tokens=np.asarray(mb.token_ids, dtype=np.int64).reshape(rows, seq),
        loss_mask=np.asarray(mb.loss_mask, dtype=np.float32).reshape(rows, seq),
        advantages=np.asarray(mb.advantages, dtype=np.float32).reshape(rows, seq),
        behaviour_logprobs=np.asarray(mb.behaviour_logprobs, dtype=np.float32).reshape(rows, seq),
        segment_ids=np.asarray(mb.segment_ids, dtype=np.int64).reshape(rows, seq),
        sample_ids=list(mb.sample_ids),
        policy_versions=np.asarray(mb.policy_versions, dtype=np.int64),
        partition=partition,
        offset=offset,
    )
