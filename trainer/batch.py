"""One micro-batch as the trainer uses it: validated arrays decoded from the Arrow IPC payload (pure).

:func:`to_batch` raises only :class:`schemas.codec.Invalid` (which the stream dead-letters), for any
bytes: beyond the record's own checks it refuses what would stop or poison a training step, namely no
rows, a loss-mask value other than 0 or 1, a negative token id, NaN or inf in the advantage or
behaviour log-prob of a trained token, and, given the model's :class:`BatchLimits`, token ids outside
the vocabulary and a shape the model was not built for (the attention mask alone is rows x seq_len^2).

It also refuses a micro-batch holding a sample its data-use class forbids it (:mod:`schemas.data_use`, dead-letter
kind ``data_use``): the shared policy's batches hold ``train`` samples only; an org's adapter batches hold ``train``
or ``adapter_only`` ones, under that org's policy in ``governance`` as this trainer's settings say it now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rtrl.sections.client import GovernanceSettings
from schemas.codec import Invalid, decode_batch
from schemas.data_use import stricter, trains_adapter, trains_shared

if TYPE_CHECKING:
    from rtrl.settings import Settings


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
    reward_version: str = ""  # the reward version whose rewards made the advantages ("" = not recorded)
    delayed: np.ndarray | None = None  # bool, per sample: a delayed sample (MicroBatch.delayed); None = none
    adapter: str = ""  # the org whose adapter trains on it (MicroBatch.adapter); "" = the shared policy
    #: int64, per sample: the org adapter version that sampled it (MicroBatch.adapter_versions); None = all 0 (the
    #: shared policy alone)
    adapter_versions: np.ndarray | None = None
    served_org: str = ""  # the org whose adapter versions adapter_versions counts (MicroBatch.served_org)


@dataclass(frozen=True)
class BatchLimits:
    """What the trainer's model takes; a micro-batch outside it is refused (None = not checked)."""

    max_seq_len: int | None = None  # tokens per row
    max_rows: int | None = None  # rows per micro-batch
    vocab_size: int | None = None  # token ids must lie below it
    seq_multiple: int = 1  # the model's positions per row (tokens - 1) must be a multiple of it (SP over tp)
    governance: GovernanceSettings = field(default_factory=GovernanceSettings)
    """Each org's data-use class (the ``governance`` section): what its samples may train."""

    @classmethod
    def from_settings(cls, settings: Settings) -> BatchLimits:
        """Rows as long as the packing's or the model's (the larger), as many as the packing's, token ids
        of the model's vocabulary: everything the settings let the batch flow send."""
        b, par = settings.batching, settings.parallel
        multiple = par.tp if par.sequence_parallel else 1
        return cls(
            max(b.seq_len, settings.model.seq_length), b.rows, settings.model.vocab_size, multiple, settings.governance
        )


def to_batch(data: bytes, partition: int, offset: int, limits: BatchLimits | None = None) -> Batch:
    """Decode and validate one Arrow IPC micro-batch (raises only Invalid, with the reason)."""
    mb = decode_batch(data)  # full validation: schema, shapes, segment ids
    seq, rows = mb.seq_len, len(mb.token_ids)
    lim = limits or BatchLimits()
    if rows == 0:
        raise Invalid("$.token_ids", "a micro-batch has at least one row")
    if lim.max_seq_len is not None and seq > lim.max_seq_len:
        raise Invalid("$.seq_len", f"{seq} tokens per row; this trainer takes at most {lim.max_seq_len}")
    if (seq - 1) % lim.seq_multiple:  # each row gives seq - 1 positions (a token predicts the next)
        raise Invalid(
            "$.seq_len",
            f"{seq} tokens per row; sequence parallelism splits the {seq - 1} positions over {lim.seq_multiple} "
            "ranks, so seq_len - 1 must be a multiple of parallel.tp",
        )
    _check_data_use(mb.data_use, mb.adapter, mb.sample_ids, lim)
    if lim.max_rows is not None and rows > lim.max_rows:
        raise Invalid("$.token_ids", f"{rows} rows; this trainer takes at most {lim.max_rows} (batching.rows)")
    b = Batch(
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
        reward_version=mb.reward_version,
        delayed=np.asarray(mb.delayed, dtype=bool) if any(mb.delayed) else None,
        adapter=mb.adapter,
        adapter_versions=np.asarray(mb.adapter_versions, dtype=np.int64) if any(mb.adapter_versions) else None,
        served_org=mb.served_org,
    )
    if not np.isin(b.loss_mask, (0.0, 1.0)).all():
        raise Invalid("$.loss_mask", "loss-mask values must be 0 or 1")
    if (b.tokens < 0).any():
        raise Invalid("$.token_ids", "negative token id")
    if lim.vocab_size is not None and (b.tokens >= lim.vocab_size).any():
        raise Invalid("$.token_ids", f"token id beyond the vocabulary of {lim.vocab_size} (model.vocab_size)")
    trained = b.loss_mask > 0
    for name, values in (("advantages", b.advantages), ("behaviour_logprobs", b.behaviour_logprobs)):
        if not np.isfinite(values[trained]).all():
            raise Invalid(f"$.{name}", "NaN or infinity on a trained token")
    return b


def _check_data_use(uses: list[str], adapter: str, sample_ids: list[str], lim: BatchLimits) -> None:
    """Refuse a batch holding a sample its data-use class forbids the stream it came on (raises Invalid)."""
    for i, use in enumerate(uses or ["train"] * len(sample_ids)):
        if adapter:
            use = stricter(lim.governance.policy(adapter), use)  # type: ignore[arg-type]  # unknown classes fail below
            ok, stream = trains_adapter(use), f"org {adapter}'s adapter"
        else:
            ok, stream = trains_shared(use), "the shared policy"
        if not ok:
            raise Invalid(
                f"$.data_use[{i}]",
                f"sample {sample_ids[i]} is {use}: it may not train {stream} (schemas.data_use, governance)",
                "data_use",
            )
