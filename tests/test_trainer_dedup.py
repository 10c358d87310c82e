"""No micro-batch and no sample trained twice (trainer.dedup), as pure functions: replayed ids,
micro-batches packed differently on replay, abandoned steps, state through a checkpoint."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.batch import Batch
from trainer.dedup import TrainedSet, drop_samples


def packed(batch_id: str, samples: list[tuple[str, int]], tokens_each: int = 3, seq: int = 12) -> Batch:
    """One row; each sample ``tokens_each`` tokens, trained on all but its first."""
    rows = max(1, -(-len(samples) * tokens_each // seq))
    seg = np.full((rows, seq), -1, np.int64)
    for i in range(len(samples)):
        flat = seg.reshape(-1)
        flat[i * tokens_each : (i + 1) * tokens_each] = i
    mask = np.where(seg >= 0, 1.0, 0.0).astype(np.float32)
    tokens = np.where(seg >= 0, seg + 10, 0)
    return Batch(
        batch_id,
        tokens,
        mask,
        np.ones_like(mask),
        np.zeros_like(mask),
        seg,
        [s for s, _ in samples],
        np.array([v for _, v in samples], np.int64),
        0,
        0,
    )


def test_drop_samples_turns_them_into_padding_and_renumbers():
    b = packed("b", [("x", 1), ("y", 1), ("z", 2)])
    out = drop_samples(b, [True, False, True])
    assert out.sample_ids == ["x", "z"] and out.policy_versions.tolist() == [1, 2]
    assert out.segment_ids[0].tolist() == [0, 0, 0, -1, -1, -1, 1, 1, 1, -1, -1, -1]
    assert out.loss_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert out.tokens.tolist() == b.tokens.tolist()  # tokens stay; the mask and segments decide
    assert drop_samples(b, [True, True, True]) is b


def test_replayed_and_repacked_batches_are_trained_once():
    t = TrainedSet()
    first = t.take(packed("a", [("x", 1), ("y", 1)]))
    assert first is not None and first.sample_ids == ["x", "y"]
    assert t.take(packed("a", [("x", 1), ("y", 1)])) is None  # the same id again within the step
    t.commit()
    assert t.take(packed("a", [("x", 1), ("y", 1)])) is None  # a replay with the same id
    repacked = t.take(packed("b", [("y", 1), ("z", 1)]))  # packed differently on replay: y is a repeat
    assert repacked is not None and repacked.sample_ids == ["z"]
    assert t.take(packed("c", [("z", 1)])) is None  # z was taken in this (uncommitted) step
    t.commit()
    assert (t.repeated_batches, t.repeated_samples) == (2, 2)


def test_an_abandoned_step_is_forgotten_and_read_again():
    t = TrainedSet()
    assert t.take(packed("a", [("x", 0)])) is not None
    t.discard()  # a partial step is not trained
    assert t.take(packed("a", [("x", 0)])) is not None
    t.commit()
    assert t.take(packed("a", [("x", 0)])) is None


def test_state_survives_a_checkpoint_and_prune_forgets_stale_versions():
    t = TrainedSet()
    for i, v in enumerate([0, 1, 2]):
        t.take(packed(f"b{i}", [(f"s{i}", v)]))
    t.commit()
    u = TrainedSet(t.state())
    assert u.state() == t.state()
    assert u.take(packed("b1", [("s1", 1)])) is None and u.take(packed("n", [("s2", 2)])) is None
    u.discard()
    u.prune(oldest_version=2)
    assert sorted(u.samples) == [2] and sorted(u.batches) == [2]
    assert u.take(packed("b0", [("s0", 0)])) is not None  # forgotten: version 0 is too stale to matter


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_replay_pattern_trains_each_sample_at_most_once(data):
    """A stream where batches are replayed verbatim or repacked (new ids, overlapping samples), with steps
    committed or abandoned at random: committed samples are unique and are exactly what the set holds."""
    samples = [(f"s{i}", i % 3) for i in range(12)]
    t, trained = TrainedSet(), []
    for k in range(data.draw(st.integers(5, 25))):
        chosen = data.draw(st.lists(st.sampled_from(samples), min_size=1, max_size=4, unique=True))
        bid = data.draw(st.sampled_from([f"b{k}", "b0", "b1"]))  # sometimes a replayed id
        out = t.take(packed(bid, chosen))
        if data.draw(st.booleans()):
            t.commit()
            if out is not None:
                trained += out.sample_ids
        else:
            t.discard()
    assert len(trained) == len(set(trained))
    assert {s for v, ids in t.samples.items() for s in ids} == set(trained)


def test_only_samples_within_the_policy_lag_count_as_trained():
    """A replay arriving after the trainer moved on: its stale samples stay for the trainer to mask (and
    count) but are not remembered, and a micro-batch with nothing trainable is not remembered either."""
    t = TrainedSet()
    late = t.take(packed("old", [("x", 1), ("y", 3)]), trainable=(2, 3))
    assert late is not None and late.sample_ids == ["x", "y"]  # x (version 1) left for masking
    all_stale = t.take(packed("stale", [("z", 0)]), trainable=(2, 3))
    assert all_stale is not None and all_stale.sample_ids == ["z"]
    t.commit()
    assert t.samples == {3: {"y"}} and t.batches == {3: {"old"}}
    again = t.take(packed("stale", [("z", 0)]), trainable=(2, 3))  # not remembered: comes through, trains nothing
    assert again is not None
    assert t.take(packed("old2", [("x", 1), ("y", 3)]), trainable=(2, 3)).sample_ids == ["x"]  # y is a repeat


def test_step_ids_are_what_the_step_trains():
    t = TrainedSet()
    t.take(packed("a", [("x", 1), ("y", 3)]), trainable=(2, 3))
    t.take(packed("b", [("z", 0)]), trainable=(2, 3))  # nothing trainable: not listed
    t.take(packed("c", [("y", 3), ("w", 2)]), trainable=(2, 3))  # y repeats within the step
    assert t.step_ids() == (["a", "c"], ["y", "w"])
    t.commit()
    assert t.step_ids() == ([], [])
