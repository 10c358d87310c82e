"""Hypothesis strategies for every record, derived from the annotations in schemas.records.

Constraints come from the same ``msgspec.Meta`` the codec enforces, so generated records are
valid by construction; float32 fields get float32-representable values (what Arrow stores).
Records with cross-field rules (Rollout, MicroBatch) have hand-written strategies.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Literal, Union, get_args, get_origin

import msgspec
from hypothesis import strategies as st

from schemas.fields import Kind
from schemas.records import EVENT_TYPES, MicroBatch, Rollout

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


def _meta(tp):
    kind, metas = None, []
    while get_origin(tp) is Annotated:
        base, *extra = get_args(tp)
        for m in extra:
            if isinstance(m, Kind):
                kind = m.name
            elif isinstance(m, msgspec.Meta):
                metas.append(m)
        tp = base
    return tp, kind, metas


def _get(metas, name):
    for m in metas:
        if getattr(m, name, None) is not None:
            return getattr(m, name)
    return None


def for_type(tp) -> st.SearchStrategy:
    tp, kind, metas = _meta(tp)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)][0]
        return st.none() | for_type(inner)
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if origin is list:
        return st.lists(for_type(get_args(tp)[0]), max_size=5)
    if origin is dict:
        return st.dictionaries(for_type(get_args(tp)[0]), for_type(get_args(tp)[1]), max_size=4)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(_get(metas, "ge"), _get(metas, "le"))
    if tp is float:
        width = 32 if kind == "float32" else 64
        return st.floats(_get(metas, "ge"), _get(metas, "le"), allow_nan=False, allow_infinity=False, width=width)
    if tp is str:
        pattern = _get(metas, "pattern")
        if pattern:
            return st.from_regex(pattern, fullmatch=True)
        lo, hi = _get(metas, "min_length") or 0, _get(metas, "max_length") or 30
        return st.text(st.characters(blacklist_categories=("Cs",)), min_size=lo, max_size=min(hi, 30))
    raise TypeError(tp)


def records(cls) -> st.SearchStrategy:
    """Valid instances of a record class (any event type for ``EventBase``)."""
    if cls is Rollout:
        return rollouts()
    if cls is MicroBatch:
        return micro_batches()
    if cls.__name__ == "EventBase":
        return st.one_of([records(c) for c in EVENT_TYPES])
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{name: for_type(hints[name]) for name in cls.__struct_fields__})


_i32 = st.integers(-(2**31), 2**31 - 1)
_f32 = st.floats(-100, 0, width=32)


@st.composite
def rollouts(draw) -> Rollout:
    hints = typing.get_type_hints(Rollout, include_extras=True)
    n = draw(st.integers(0, 12))
    return Rollout(
        trajectory_id=draw(for_type(hints["trajectory_id"])),
        policy_version=draw(for_type(hints["policy_version"])),
        group_id=draw(for_type(hints["group_id"])),
        group_size=draw(st.integers(1, 16)),
        org_id=draw(for_type(hints["org_id"])),
        task_kind=draw(for_type(hints["task_kind"])),
        prompt_ids=draw(st.lists(_i32, max_size=12)),
        completion_ids=draw(st.lists(_i32, min_size=n, max_size=n)),
        behaviour_logprobs=draw(st.lists(_f32, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        created_at=draw(for_type(hints["created_at"])),
    )


@st.composite
def micro_batches(draw) -> MicroBatch:
    hints = typing.get_type_hints(MicroBatch, include_extras=True)
    rows, seq = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    samples = draw(st.lists(for_type(hints["batch_id"]), min_size=1, max_size=4))

    def grid(elem):
        return draw(st.lists(st.lists(elem, min_size=seq, max_size=seq), min_size=rows, max_size=rows))

    return MicroBatch(
        batch_id=draw(for_type(hints["batch_id"])),
        created_at=draw(for_type(hints["created_at"])),
        seq_len=seq,
        token_ids=grid(_i32),
        loss_mask=grid(st.integers(0, 1)),
        advantages=grid(st.floats(-10, 10, width=32)),
        behaviour_logprobs=grid(_f32),
        segment_ids=grid(st.integers(-1, len(samples) - 1)),
        sample_ids=samples,
        policy_versions=draw(st.lists(st.integers(0, 10**6), min_size=len(samples), max_size=len(samples))),
        delayed=draw(st.just([]) | st.lists(st.booleans(), min_size=len(samples), max_size=len(samples))),
    )
