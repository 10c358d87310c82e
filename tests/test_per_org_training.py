"""Per-org adapter training (issue 17): the samples an org's adapter trains on, and how it trains on them.

Contracts checked here:

* **The serving adapter version on the wire.** A rollout records the adapter version that served it and a
  micro-batch each sample's, through their codecs to the trainer's batch; payloads from before these fields (and
  before ``adapter``) decode as the base alone's.
* **The delayed path.** A sample whose serving version holds other weights than those the org's candidate starts
  from (``AdapterLedger.start``: the serving adapter, a retired one's weights, or fresh) is trained as delayed:
  truncated importance weights, no clip; so is an org the base alone served while its kept adapter trains on.
* **The trainers.** An adapter run trains its org's batches only, the base and the other adapters frozen, with
  the ``adapters`` section's learning rate, KL weight and updates per step; the shared trainer trains a batch
  through the adapter version that served it (``ServedThrough``, ``Hooks.served_by``).

The routing that makes these batches: tests/test_per_org.py.
"""

from __future__ import annotations

import msgspec
import pytest

from flows.adapters import OrgRouter
from flows.batching import Sample, pack
from rtrl.errors import ConfigError
from rtrl.settings import load_settings
from schemas.records import MicroBatch
from tests.test_batching import ro
from tests.test_per_org import batch


def test_a_rollout_records_its_serving_adapter_version_and_old_rollouts_decode_as_the_base():
    """A rollout's ``adapter_version`` (0 = the shared policy alone) round-trips through its JSON codec and its
    Arrow/ClickHouse columns; a producer's rollout from before the field (no key) decodes with 0, a negative one
    is Invalid."""
    from schemas.codec import Invalid, JsonCodec
    from schemas.types import columns, from_arrow, to_arrow

    r = msgspec.structs.replace(ro("t1", "g1", org="o0"), adapter_version=3)
    codec = JsonCodec(type(r))
    assert codec.decode(codec.encode(r)) == r and r.adapter_version == 3
    assert from_arrow(to_arrow([r], type(r)), type(r)) == [r]
    assert {c.name: c.clickhouse for c in columns(type(r))}["adapter_version"] == "Int64"
    raw = msgspec.json.decode(codec.encode(r))
    del raw["adapter_version"]
    assert codec.decode(msgspec.json.encode(raw)) == msgspec.structs.replace(r, adapter_version=0)
    with pytest.raises(Invalid, match="adapter_version"):
        codec.decode(msgspec.json.encode(raw | {"adapter_version": -1}))


def test_a_micro_batch_carries_each_samples_serving_adapter_version_to_the_trainer():
    """``pack`` puts each sample's ``Rollout.adapter_version`` in ``MicroBatch.adapter_versions`` (sample order;
    empty when every sample was served by the base alone); it survives the Arrow wire format and reaches
    ``trainer.batch.Batch`` as an int64 array (None for all 0). A wrong length is refused, and a batch from a
    producer before the field (no column) decodes as served by the base alone."""
    import numpy as np
    import pyarrow as pa

    from schemas.codec import decode_batch, encode_batch
    from trainer.batch import to_batch

    def sample(tid: str, served: int) -> Sample:
        return Sample(msgspec.structs.replace(ro(tid, "g", org="o0"), adapter_version=served), 1.0, 0, advantage=0.5)

    mixed = pack([sample("a", 2), sample("b", 0), sample("c", 3)], seq_len=16, created_at=1)
    assert mixed.adapter_versions == [2, 0, 3]
    assert decode_batch(encode_batch(mixed)) == mixed
    b = to_batch(encode_batch(mixed), 0, 0)
    assert b.adapter_versions is not None and b.adapter_versions.dtype == np.int64
    assert b.adapter_versions.tolist() == [2, 0, 3]
    base = pack([sample("a", 0), sample("b", 0)], seq_len=16, created_at=1)
    assert base.adapter_versions == [] and to_batch(encode_batch(base), 0, 0).adapter_versions is None
    assert pack([sample("a", 2), sample("b", 0)], seq_len=16, created_at=1).batch_id == base.batch_id  # same ids
    with pytest.raises(ValueError, match="adapter_versions"):
        msgspec.structs.replace(mixed, adapter_versions=[1])
    from trainer.dedup import drop_samples

    assert drop_samples(b, [True, False, True]).adapter_versions.tolist() == [2, 3]  # stays one per sample
    table = pa.ipc.open_stream(encode_batch(mixed)).read_all().drop_columns(["adapter_versions", "served_org"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    old = decode_batch(sink.getvalue().to_pybytes())
    assert old.adapter_versions == [] and old.served_org == "" and old.sample_ids == mixed.sample_ids
    assert mixed.served_org == "o0" and base.served_org == ""
    with pytest.raises(ValueError, match="served_org"):
        msgspec.structs.replace(mixed, served_org="")


def test_a_retired_orgs_next_candidate_starts_from_the_retired_weights_and_a_rollback_starts_fresh():
    """``AdapterLedger.start``: an org's next candidate trains from the adapter serving it (when valid on the
    base); after a refused re-validation retired it, from the retired version's weights (until a new promotion);
    after a rollback by hand to the base alone, from a fresh adapter. The retired version survives the ledger's
    state, and an older state without it loads."""
    from evalgate.adapters import AdapterLedger

    ledger = AdapterLedger()
    a1 = ledger.add("o0", 0, "p1")
    assert ledger.start("o0", 0) is None  # nothing promoted: fresh
    ledger.decide("o0", 1, True)
    assert ledger.start("o0", 0) is a1 and ledger.start("o0", 1) is None  # not valid on another base
    a2 = ledger.revalidate(a1, 1)
    ledger.decide("o0", a2.version, False)
    assert ledger.retire("o0") is a1 and ledger.serving("o0") is None
    assert ledger.start("o0", 1) is a1 and ledger.start("o0", 1).path == a2.path == "p1"
    again = AdapterLedger.from_state(msgspec.json.decode(msgspec.json.encode(ledger.state())))
    assert again.retired == {"o0": 1} and again.start("o0", 1).path == "p1"
    a3 = ledger.add("o0", 1, "p3", parent=a1.version)
    ledger.decide("o0", a3.version, True)
    assert ledger.retired == {} and ledger.start("o0", 1) is a3
    ledger.add("o1", 0, "q1")
    ledger.decide("o1", 1, True)
    ledger.rollback("o1")
    assert ledger.start("o1", 0) is None  # rolled back by hand: those weights are not wanted
    old = {k: v for k, v in ledger.state().items() if k != "retired"}
    assert AdapterLedger.from_state(old).retired == {}


def test_an_adapter_trains_the_samples_another_policy_served_on_the_delayed_path():
    """A sample whose serving adapter version (``Batch.adapter_versions``) holds other weights than those the
    org's candidate starts from is marked delayed, so ``trainer.train.prepare`` gives the loss its tokens as
    delayed (truncated importance weights, no clip): the base alone's samples for a candidate starting from
    trained weights, another adapter's; a re-validated version holds its parent's weights (on-policy). A fresh
    adapter is on-policy for the base alone's samples only. A sample the batch flow already marked stays marked."""
    import numpy as np

    from app.adapters import off_policy_delayed
    from evalgate.adapters import AdapterLedger
    from schemas.codec import encode_batch
    from trainer.batch import to_batch
    from trainer.train import prepare

    ledger = AdapterLedger()
    a1 = ledger.add("o0", 0, "p1")
    ledger.decide("o0", 1, True)
    a2 = ledger.revalidate(a1, 1)  # a1's weights on base 1
    ledger.decide("o0", a2.version, True)
    a3 = ledger.add("o0", 1, "p3", parent=2)  # retrained: other weights
    ledger.decide("o0", a3.version, False)
    served = [0, 1, 2, 3, 9]  # 9: a version this ledger does not know

    def make(delayed: list[bool] | None = None):
        samples = [
            Sample(msgspec.structs.replace(ro(f"t{i}", "g", org="o0"), adapter_version=a), 1.0, 0, advantage=0.5)
            for i, a in enumerate(served)
        ]
        for s, d in zip(samples, delayed or []):
            s.delayed = d
        return to_batch(encode_batch(pack(samples, seq_len=32, created_at=1)), 0, 0)

    b = make()
    from_a2 = off_policy_delayed(b, ledger, "o0", a2)
    assert from_a2.delayed.tolist() == [True, False, False, True, True]
    assert off_policy_delayed(b, ledger, "o0", None).delayed.tolist() == [False, True, True, True, True]
    assert off_policy_delayed(make([False, True]), ledger, "o0", a1).delayed.tolist() == [True, True, False, True, True]
    p = prepare(from_a2, policy_version=1, max_policy_lag=1, max_delayed_lag=4)
    seg = from_a2.segment_ids[:, 1:]
    expected = np.isin(seg, [0, 3, 4]) & (p.loss_mask.numpy() > 0)
    assert p.delayed is not None and np.array_equal(p.delayed.numpy() & (p.loss_mask.numpy() > 0), expected)
    assert expected.any() and (p.loss_mask.numpy()[np.isin(seg, [1, 2])] > 0).any()
    on = pack([Sample(ro("u", "g", org="o0"), 1.0, 0)], seq_len=32, created_at=1)
    batch_on = to_batch(encode_batch(on), 0, 0)
    assert off_policy_delayed(batch_on, ledger, "o0", None) is batch_on  # nothing to mark


def test_the_shared_trainer_loads_each_serving_adapter_version_and_names_the_one_that_served_a_batch(tmp_path, caplog):
    """``app.adapters.ServedThrough`` (the main job's ``served_by`` under ``shared_traffic = "served"``) loads, into
    the shared trainer's model, every adapter version that served on a base within the lag window (promoted, or
    rolled back since; a re-validated version shares its parent's weights and name), with the saved weights;
    unloads those out of the window; names the one that served a micro-batch (None: the base alone, or a version
    it does not hold); and trains a batch that several versions served through the base alone, with a warning."""
    import torch

    from app.adapters import ServedThrough
    from evalgate.adapters import AdapterLedger
    from rtrl.sections.trainer import ModelSettings
    from schemas.codec import encode_batch
    from simulator.tasks import VOCAB
    from trainer import lora
    from trainer.batch import to_batch
    from trainer.model import build_model, init_parallel

    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=64)
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    saved = {}
    for i, tag in enumerate(("w1", "w3")):  # two trained adapters' weights (non-zero B)
        lora.add_adapter(model, tag, lora.LoraConfig(rank=4), seed=i)
        with torch.no_grad():
            for p in lora.adapter_parameters(model, tag):
                p.copy_(torch.randn(p.shape) * 0.1)
        saved[tag] = (str(lora.save_adapter(tmp_path / tag, model, tag, 1, "v0")), lora.adapter_state_dict(model, tag))
        lora.remove_adapter(model, tag)
    ledger = AdapterLedger()
    a1 = ledger.add("o1", 0, saved["w1"][0])
    ledger.decide("o1", 1, True)
    a2 = ledger.revalidate(a1, 1)
    ledger.decide("o1", a2.version, True)
    ledger.add("o1", 1, saved["w3"][0], parent=2)
    ledger.decide("o1", 3, False)  # rejected: never served
    served = ServedThrough(model)
    served.sync(ledger, oldest_base=0)
    w1 = ServedThrough.name(saved["w1"][0])
    assert lora.adapter_names(model) == [w1] and served.names == {("o1", 1): w1, ("o1", 2): w1}
    assert all(torch.equal(v, saved["w1"][1][k]) for k, v in lora.adapter_state_dict(model, w1).items())

    def wire(*versions: int):
        samples = [
            Sample(msgspec.structs.replace(ro(f"t{i}", "g", org="o1"), adapter_version=v), 1.0, 0)
            for i, v in enumerate(versions)
        ]
        return to_batch(encode_batch(pack(samples, 16, 1)), 0, 0)

    assert served(wire(2, 2)) == w1 and served(wire(1)) == w1 and served(wire(0, 0)) is None
    assert served(wire(3)) is None  # rejected, never loaded: the base alone (with a warning)
    with caplog.at_level("WARNING", logger="app.adapters"):
        assert served(wire(0, 2)) is None  # several versions (not split by the flow): the base alone, never a stop
    assert "several adapter versions of org 'o1' served (a0, a2;" in caplog.text
    served.sync(ledger, oldest_base=2)  # both versions' bases are out of the lag window
    assert lora.adapter_names(model) == [] and served(wire(2)) is None


def test_old_payloads_without_the_adapter_field_still_decode():
    """A micro-batch from a producer before this field (no adapter column) decodes with adapter ""; so do a
    TrainStep's JSON without the key and a batch of another era's column set (a required column still missing
    is Invalid)."""
    import pyarrow as pa

    from schemas.codec import Invalid, JsonCodec, decode_batch, encode_batch
    from schemas.records import TrainStep

    b = msgspec.structs.replace(batch("o0", 2), adapter="o0")
    assert decode_batch(encode_batch(b)) == b
    table = pa.ipc.open_stream(encode_batch(b)).read_all()

    def ipc(t: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t)
        return sink.getvalue().to_pybytes()

    old = decode_batch(ipc(table.drop_columns(["adapter"])))
    assert old.adapter == "" and old.sample_ids == b.sample_ids
    with pytest.raises(Invalid, match="token_ids"):
        decode_batch(ipc(table.drop_columns(["token_ids"])))
    step = TrainStep(
        run_id="r",
        step=1,
        policy_version=0,
        loss=0.0,
        pg_loss=0.0,
        kl=0.0,
        clip_fraction=0.0,
        is_truncated_fraction=0.0,
        tokens=1,
        on_policy_fraction=1.0,
        lag_histogram={},
        tokens_per_s=1.0,
        batch_ids=["b"],
        at=1,
        adapter="o0",
    )
    codec = JsonCodec(TrainStep)
    raw = msgspec.json.decode(codec.encode(step))
    del raw["adapter"]
    assert codec.decode(msgspec.json.encode(raw)).adapter == "" and codec.decode(codec.encode(step)) == step


def test_an_adapter_runs_learning_rate_and_kl_weight_come_from_the_adapters_section():
    """adapters.lr, adapters.kl_coef and adapters.kl_estimator set an adapter run's learning rate, KL weight and
    KL estimator (to the base alone); 0 (or '') = train.lr, loss.kl_coef and loss.kl_estimator; the shared
    policy's run never takes them."""
    from rtrl.sections.trainer import TrainConfig

    s = load_settings(env={"RTRL_ADAPTERS__LR": "0.002", "RTRL_ADAPTERS__KL_COEF": "0.2", "RTRL_LOSS__KL_COEF": "0.03"})
    adapter, shared = TrainConfig.from_settings(s, adapter="org-1"), TrainConfig.from_settings(s)
    assert (adapter.lr, adapter.loss.kl_coef) == (0.002, 0.2)
    assert (shared.lr, shared.loss.kl_coef) == (s.train.lr, 0.03)
    assert (adapter.loss.kl_estimator, shared.loss.kl_estimator) == ("full", "k3")  # the defaults
    plain = TrainConfig.from_settings(load_settings(env={"RTRL_ADAPTERS__KL_COEF": "0"}), adapter="org-1")
    assert (plain.lr, plain.loss.kl_coef) == (load_settings(env={}).train.lr, load_settings(env={}).loss.kl_coef)
    k3 = load_settings(env={"RTRL_ADAPTERS__KL_ESTIMATOR": "", "RTRL_LOSS__KL_ESTIMATOR": "full"})
    assert TrainConfig.from_settings(k3, adapter="org-1").loss.kl_estimator == "full"  # '' = loss.kl_estimator
    k3 = load_settings(env={"RTRL_ADAPTERS__KL_ESTIMATOR": "k3"})
    assert TrainConfig.from_settings(k3, adapter="org-1").loss.kl_estimator == "k3"
    with pytest.raises(ConfigError, match="adapters.kl_estimator"):
        load_settings(env={"RTRL_ADAPTERS__KL_ESTIMATOR": "exact"})
    with pytest.raises(ConfigError, match="adapters.kl_coef"):
        load_settings(env={"RTRL_ADAPTERS__KL_COEF": "-1"})


def test_an_adapter_trains_on_its_orgs_batches_only_and_the_base_stays_frozen(tmp_path):
    """The trainer's adapter mode (``TrainConfig.adapter``) reads the adapter stream, which holds several orgs'
    batches, and trains one org's adapter on that org's batches only: the sample ids in its train_metrics rows are
    exactly that org's, the base and the other org's adapter are unchanged bit for bit, and its checkpoints are
    adapter checkpoints a second run resumes from. The shared run trains the shared batches only."""
    import torch

    from rtrl.sections.trainer import ModelSettings, TrainConfig
    from schemas.codec import encode_batch
    from simulator.tasks import VOCAB
    from trainer import lora
    from trainer.batch import to_batch
    from trainer.factory import Policy
    from trainer.model import build_model, init_parallel
    from trainer.train import MemorySource, train

    routers = {o: OrgRouter(o, 0) for o in ("o1", "o2")}
    routed: list[MicroBatch] = []
    for k in range(3):
        for org in ("o0", "o1", "o2"):
            b = batch(org, 4, first=4 * k)
            routed += routers[org].route(b) if org in routers else [b]
    wire = [to_batch(encode_batch(mb), 0, i) for i, mb in enumerate(routed)]
    assert {b.adapter for b in wire} == {"", "o1", "o2"}
    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=64)
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    for org in ("o1", "o2"):
        lora.add_adapter(model, org, lora.LoraConfig(rank=4))
    base = {k: v.clone() for k, v in model.state_dict().items() if v is not None}  # (megatron keeps None extra states)
    o2 = lora.adapter_state_dict(model, "o2")
    o1 = lora.adapter_state_dict(model, "o1")
    tc = TrainConfig(
        adapter="o1",
        adapter_base="v1",
        micro_batches_per_step=1,
        steps=2,
        idle_timeout_s=0.01,
        checkpoint_dir=str(tmp_path / "o1"),
        checkpoint_every=1,
        lr=1e-2,
        max_policy_lag=4,
        max_delayed_lag=0,
    )
    steps = train(Policy(model, None, version=1), lambda _: MemorySource(wire), tc)
    steps += train(
        Policy(model, None, version=1), lambda off: MemorySource(wire, off), tc.model_copy(update=dict(steps=10))
    )
    assert [st.step for st in steps] == [1, 2, 3] and {st.adapter for st in steps} == {"o1"}
    assert {s for st in steps for s in st.sample_ids} == {f"o1-{i}" for i in range(12)}
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items() if v is not None)
    assert all(torch.equal(v, o2[k]) for k, v in lora.adapter_state_dict(model, "o2").items())
    assert any(not torch.equal(v, o1[k]) for k, v in lora.adapter_state_dict(model, "o1").items())
    assert lora.active_adapter(model) is None  # train() leaves no adapter active
    assert lora.read_adapter_checkpoint(lora.latest_adapter(tmp_path / "o1"))["base"] == "v1"
    # the shared policy: the shared stream only (every org's samples, one policy served each), adapter ""
    shared, reference = build_model(cfg), build_model(cfg)
    tc = TrainConfig(
        micro_batches_per_step=1,
        steps=100,
        idle_timeout_s=0.01,
        max_policy_lag=4,
        max_delayed_lag=0,
        checkpoint_every=5,
    )
    steps = train(
        Policy(shared, reference, version=1), lambda _: MemorySource(wire), tc.model_copy(update=dict(resume=False))
    )
    assert {st.adapter for st in steps} == {""} and len(steps) == 9
    ids = [s for st in steps for s in st.sample_ids]
    assert sorted(ids) == sorted(f"{o}-{i}" for o in ("o0", "o1", "o2") for i in range(12))


def test_updates_per_step_reuse_a_step_and_the_base_can_train_through_the_serving_adapter(tmp_path):
    """``train.updates_per_step`` (``adapters.updates_per_step`` for adapter runs, 4 by default) takes several
    optimizer updates on each step's micro-batches: the step's figures are its first update's (what one update
    gives), its samples are recorded once, and the weights move on. ``Hooks.served_by`` trains the shared
    policy on a micro-batch through the adapter that served it, frozen: the base then ends exactly where a run
    with that adapter active throughout ends, not where the base alone would, and the adapter is unchanged."""
    import torch

    from rtrl.sections.trainer import ModelSettings, TrainConfig
    from schemas.codec import encode_batch
    from simulator.tasks import VOCAB
    from trainer import lora
    from trainer.batch import to_batch
    from trainer.factory import Policy
    from trainer.model import build_model, init_parallel
    from trainer.train import Hooks, MemorySource, train

    s = load_settings(env={"RTRL_TRAIN__UPDATES_PER_STEP": "2"})
    assert TrainConfig.from_settings(s).updates_per_step == 2
    assert TrainConfig.from_settings(s, adapter="o1").updates_per_step == 4  # adapters.updates_per_step's default
    s = load_settings(env={"RTRL_TRAIN__UPDATES_PER_STEP": "2", "RTRL_ADAPTERS__UPDATES_PER_STEP": "0"})
    assert TrainConfig.from_settings(s, adapter="o1").updates_per_step == 2  # 0 = train.updates_per_step
    with pytest.raises(ConfigError, match="train.updates_per_step"):
        load_settings(env={"RTRL_TRAIN__UPDATES_PER_STEP": "0"})

    wire = [to_batch(encode_batch(batch("o1", 4, first=4 * k)), 0, k) for k in range(2)]
    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=64)
    init_parallel(cfg)

    def fresh() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        model, reference = build_model(cfg), build_model(cfg)
        lora.add_adapter(model, "o1", lora.LoraConfig(rank=4), seed=1)
        state = lora.adapter_state_dict(model, "o1")
        g = torch.Generator().manual_seed(2)
        lora.load_adapter_state_dict(
            model,
            "o1",
            {k: 0.2 * torch.randn(v.shape, generator=g) if k.endswith("B") else v for k, v in state.items()},
        )
        for p in lora.adapter_parameters(model, "o1"):
            p.requires_grad_(False)
        return model, reference

    def base(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in model.state_dict().items() if v is not None}

    tc = TrainConfig(
        micro_batches_per_step=1,
        steps=10,
        idle_timeout_s=0.01,
        lr=1e-2,
        max_policy_lag=4,
        max_delayed_lag=0,
        checkpoint_every=5,
    )
    start, _ = fresh()
    runs = {}
    for k in (1, 3):
        model, reference = fresh()
        steps = train(
            Policy(model, reference, version=1),
            lambda _: MemorySource(wire),
            tc.model_copy(update=dict(updates_per_step=k, resume=False)),
        )
        runs[k] = (steps, base(model))
    (one, w1), (three, w3) = runs[1], runs[3]
    assert len(one) == len(three) == 2 and [s.sample_ids for s in one] == [s.sample_ids for s in three]
    assert one[0].loss == three[0].loss and one[0].kl == three[0].kl  # the first update: the same weights
    moved = {k: (w1[k] - base(start)[k]).norm() for k in w1}, {k: (w3[k] - base(start)[k]).norm() for k in w3}
    assert sum(moved[1].values()) > sum(moved[0].values())  # three updates a step move the weights further

    adapter0 = lora.adapter_state_dict(start, "o1")
    through, reference = fresh()
    via = train(
        Policy(through, reference, version=1),
        lambda _: MemorySource(wire),
        tc.model_copy(update=dict(resume=False)),
        Hooks(served_by=lambda b: "o1"),
    )
    # train_metrics says so: every trained token of these steps went through the serving adapter, none without it
    assert [s.served_through_tokens for s in via] == [s.tokens for s in via] and all(s.tokens for s in via)
    assert all(s.served_through_tokens == 0 for s in one)
    active, reference = fresh()
    with lora.activate(active, "o1"):
        train(
            Policy(active, reference, version=1), lambda _: MemorySource(wire), tc.model_copy(update=dict(resume=False))
        )
    alone, reference = fresh()
    train(Policy(alone, reference, version=1), lambda _: MemorySource(wire), tc.model_copy(update=dict(resume=False)))
    assert lora.active_adapter(through) is None  # train() leaves no adapter active
    assert all(torch.equal(v, base(active)[k]) for k, v in base(through).items())
    assert any(not torch.equal(v, base(alone)[k]) for k, v in base(through).items())
    assert all(torch.equal(v, adapter0[k]) for k, v in lora.adapter_state_dict(through, "o1").items())
    # None from served_by: the base alone, whatever adapter the caller left active
    none, reference = fresh()
    with lora.activate(none, "o1"):
        plain = train(
            Policy(none, reference, version=1),
            lambda _: MemorySource(wire),
            tc.model_copy(update=dict(resume=False)),
            Hooks(served_by=lambda b: None),
        )
    assert all(torch.equal(v, base(alone)[k]) for k, v in base(none).items())
    assert all(s.served_through_tokens == 0 for s in plain)
    with pytest.raises(ValueError, match="shared policy"):
        train(
            Policy(through, None, version=1),
            lambda _: MemorySource(wire),
            tc.model_copy(update=dict(adapter="o1")),
            Hooks(served_by=lambda b: "o1"),
        )
    # with checkpoints (the trainer as a process of its own): the serving adapters on the model are not the
    # base's, so neither its optimizer nor its checkpoints hold them, and a resumed run goes on from the checkpoint
    saved, reference = fresh()
    ck = tc.model_copy(update=dict(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, steps=1))
    first = train(
        Policy(saved, reference, version=1), lambda _: MemorySource(wire), ck, Hooks(served_by=lambda b: "o1")
    )
    resumed, reference = fresh()
    more = train(
        Policy(resumed, reference, version=1),
        lambda _: MemorySource(wire),
        ck.model_copy(update=dict(steps=2)),
        Hooks(served_by=lambda b: "o1"),
    )
    assert [s.step for s in first] == [1] and [s.step for s in more] == [2]
    assert [s.sample_ids for s in first + more] == [s.sample_ids for s in one]  # each batch once, in order
    assert all(torch.equal(v, base(through)[k]) for k, v in base(resumed).items())  # as the uninterrupted run


def test_an_org_the_base_alone_served_trains_its_kept_adapter_weights_on_the_delayed_path():
    """The experiment's adapters arm keeps a retired org's last promoted weights for its next candidate, while the
    base alone serves the org: its samples then come from another policy than the adapter that trains on them. Such
    batches are marked delayed (truncated importance weights, no PPO clip: the clip would drop every
    negative-advantage token the adapter already made rarer, the base's habit on the org's convention tasks, and
    the adapter would drift back to the base). An org its adapter serves, or whose adapter never trained, stays on
    the PPO path; the shared copies never change."""
    import torch

    from app.per_org import Experiment, _Adapters, _settings, arm_settings
    from app.serving import loop_model_config
    from trainer.model import build_model, init_parallel

    exp = Experiment(eval_tasks=8, repeats=1)
    s = arm_settings(_settings(None), exp)
    cfg = loop_model_config(s)[0]
    init_parallel(cfg)
    torch.manual_seed(0)
    ad = _Adapters(build_model(cfg), s, exp, exp.conventions)
    org = ad.orgs[0]
    ad.routers = {o: OrgRouter(o, 0) for o in ad.orgs}  # adapted from the first sample
    first = iter(range(0, 1000, 4))

    def routed() -> tuple[list[MicroBatch], list[MicroBatch]]:
        shared, streams = ad.route([(org, batch(org, 4, first=next(first))), ("org-0", batch("org-0", 4, first=0))])
        return shared, streams[org]

    def delayed(bs: list[MicroBatch]) -> list[list[bool]]:
        return [list(b.delayed) for b in bs]

    shared, mine = routed()  # no adapter trained yet: the base alone served, and the adapter is the base
    assert delayed(mine) == [[]] and delayed(shared) == [[], []]
    v = ad.ledger.add(org, 1, "memory:test", None)
    ad.ledger.decide(org, v.version, True)
    ad.weights[org] = 1
    shared, mine = routed()  # its adapter served the org: on-policy for the adapter
    assert ad.serving(org) is not None and delayed(mine) == [[]] and delayed(shared) == [[], []]
    ad.ledger.retire(org)
    shared, mine = routed()  # retired: the base alone served, the adapter trains on from its promoted weights
    assert ad.serving(org) is None and delayed(mine) == [[True] * 4] and delayed(shared) == [[], []]
    assert mine[0].adapter == org and mine[0].sample_ids == shared[0].sample_ids
