"""Re-validating an org's serving adapter on a new base (issue 17): rescaled before it is retired.

A serving adapter the gate refuses on a new base is judged again at each of ``adapters.revalidate_scales`` of
its effect (its lora_B times the factor), in the per-org experiment (app.per_org) and in the main job
(app.adapters.OrgAdapters); the first that passes serves as a new version, and when none does the org is retired.
"""

from __future__ import annotations

import msgspec
import pytest


def _b_norm(state: dict) -> float:
    return float(sum(v.pow(2).sum() for k, v in state.items() if k.endswith("lora_B")) ** 0.5)


def test_the_experiment_rescales_a_refused_revalidation_before_it_retires_the_adapter():
    """The experiment's re-validation on a new base (as the main job's): a serving adapter the gate refuses is
    judged again at each of ``adapters.revalidate_scales`` of its effect (its lora_B times the factor); the first
    that passes serves as a new ledger version ("rescaled"), in the serving slot and as the org's next candidate's
    start. When none passes the org is retired and its slot keeps the weights it served with. (The gate stands in
    here as a rule on the judged adapter's lora_B norm: what is checked is which weights are judged and kept.)"""
    import torch

    from app.per_org import Experiment, _Adapters, _serving_slot, _settings, arm_settings
    from app.serving import loop_model_config
    from evalgate.gate import Decision
    from tests.test_adapters import randomize_b
    from trainer import lora
    from trainer.model import build_model, init_parallel

    exp = Experiment(eval_tasks=8, repeats=1, revalidate_scales=(0.5, 0.25))
    s = arm_settings(_settings(None), exp)
    assert s.adapters.revalidate_scales == [0.5, 0.25]
    cfg = loop_model_config(s)[0]
    init_parallel(cfg)
    torch.manual_seed(0)
    ad = _Adapters(build_model(cfg), s, exp, exp.conventions)
    org, slot = ad.orgs[0], _serving_slot(ad.orgs[0])
    randomize_b(ad.model, slot, seed=3)
    trained = lora.adapter_state_dict(ad.model, slot)
    lora.load_adapter_state_dict(ad.model, org, trained)
    v = ad.ledger.add(org, 1, "memory:test")
    ad.ledger.decide(org, v.version, True)
    ad.weights[org] = 1
    limit = {"norm": 0.6 * _b_norm(trained)}
    judged: list[float] = []

    def decide(org_: str, candidate: str, serving: str, version: int, training: list) -> Decision:
        n = _b_norm(lora.adapter_state_dict(ad.model, slot))
        judged.append(round(n / _b_norm(trained), 4))
        return Decision(n <= limit["norm"], f"norm {n:.3f}")

    ad.decide = decide  # type: ignore[method-assign]
    said = ad.revalidate(2)[org]
    assert judged == [1.0, 0.5] and len(said) == 2, said
    assert (
        said[0].startswith("v2 refused at re-validation on base v2")
        and said[1] == "v1 -> v3 rescaled to 0.5 on base v2"
    )
    now = ad.ledger.serving(org)
    assert now is not None and (now.version, now.base_version, now.parent) == (3, 2, 1)  # each try: a1's child
    half = {k: v * 0.5 if k.endswith("lora_B") else v for k, v in trained.items()}
    for name in (slot, org):  # served, and where the next candidate trains on from
        assert all(torch.equal(t, half[k]) for k, t in lora.adapter_state_dict(ad.model, name).items())
    assert ad.serving(org) == slot

    limit["norm"] = 0.1 * _b_norm(trained)  # the next base: no fraction passes
    judged.clear()
    said = ad.revalidate(3)[org]
    assert judged == [0.5, 0.25, 0.125] and said[-1] == "v3 retired on base v3", said
    assert [x.split(" (")[0] for x in said[:-1]] == [
        "v4 refused at re-validation on base v3",
        "v5 refused at re-validation at 0.5 times its effect on base v3",
        "v6 refused at re-validation at 0.25 times its effect on base v3",
    ]
    assert ad.ledger.serving(org) is None and ad.ledger.retired[org] == 3 and ad.serving(org) is None
    assert all(torch.equal(t, half[k]) for k, t in lora.adapter_state_dict(ad.model, slot).items())


def test_the_main_job_rescales_a_refused_revalidation_saves_it_and_announces_every_try(tmp_path):
    """``OrgAdapters.revalidate`` (the main job): a serving adapter refused on the new base is judged again at each
    of ``adapters.revalidate_scales`` of its effect; each try is a version announced with its decision (candidate,
    then rejected or promoted, with ``org``, version and ``base_version``). The passing one is saved with the
    scaled weights (loadable, its path its own), becomes what serves the org and the weights its next candidate
    starts from; the samples its unscaled parent served are then another policy's (the delayed path). When none
    passes, the org is retired and the serving version announced rolled back; a restart after a kill mid-way goes
    on with the next fraction. (The gate stands in as a rule on the judged adapter's lora_B norm.)"""
    import torch

    from app.adapters import OrgAdapters
    from app.loop import loop_gate_rules
    from app.loop_config import loop_settings
    from app.serving import loop_model_config
    from evalgate.adapters import AdapterLedger
    from evalgate.gate import Decision
    from rtrl.settings import load_settings
    from simulator.tasks import conventions_for
    from tests.test_adapters import randomize_b
    from trainer import lora

    s = loop_settings(
        load_settings(
            env={
                "RTRL_ADAPTERS__ORGS": "org-2",
                "RTRL_ADAPTERS__REVALIDATE_SCALES": "0.5,0.25",
                "RTRL_LOOP__EVAL_TASKS": "8",
                "RTRL_DATA_DIR": str(tmp_path),
            }
        )
    )
    cfg, precision = loop_model_config(s)
    announced = []
    ad = OrgAdapters(
        s, "", None, cfg, precision, tmp_path / "adapters", conventions_for(4, 2), loop_gate_rules(s),
        announced.append, lambda cks: None, lambda st: None,
    )  # fmt: skip
    ad.base_version = 1
    lora.add_adapter(ad.model, "org-2", ad.lora, seed=0)
    randomize_b(ad.model, "org-2", seed=3)
    trained = lora.adapter_state_dict(ad.model, "org-2")
    path = lora.save_adapter(tmp_path / "adapters" / "org-2" / "a1", ad.model, "org-2", 1, "v1")
    v1 = ad.ledger.add("org-2", 1, str(path))
    ad.ledger.decide("org-2", v1.version, True)
    limit = {"norm": 0.6 * _b_norm(trained)}

    def judge(org: str, name: str, serving: dict, training: list) -> tuple[dict, Decision]:
        n = _b_norm(lora.adapter_state_dict(ad.model, name))
        return {"solve_rate": n}, Decision(n <= limit["norm"], f"norm {n:.3f}")

    ad._judge = judge  # type: ignore[method-assign]
    ad.base_version = 2
    out = ad.revalidate()
    assert [(d.version, d.status) for d in out] == [(2, "rejected"), (3, "promoted")], out
    assert all(d.revalidation and d.org == "org-2" and d.base_version == 2 for d in out)
    assert "next: 0.5 times its effect" in out[0].reason and "at 0.5 times a1's effect" in out[1].reason
    a3 = ad.ledger.serving("org-2")
    assert a3 is not None and a3.version == 3 and a3.parent == 1 and a3.path != v1.path
    lora.load_adapter(a3.path, ad.model, "check", restore_rng=False)  # saved with the scaled weights
    half = {k: v * 0.5 if k.endswith("lora_B") else v for k, v in trained.items()}
    assert all(torch.equal(t, half[k]) for k, t in lora.adapter_state_dict(ad.model, "check").items())
    assert ad.ledger.start("org-2", 2) is a3
    assert not ad.ledger.same_weights("org-2", 1, a3) and ad.ledger.same_weights("org-2", 3, a3)
    by_version = {}
    for ck in announced:
        by_version.setdefault(ck.version, []).append(ck.status)
        assert ck.org == "org-2" and ck.base_version == 2
    assert by_version == {2: ["candidate", "rejected"], 3: ["candidate", "promoted"]}

    # the next base: no fraction passes; a kill after the first try, and a restart from the saved ledger, go on
    # with the next fraction (the first try is not judged again)
    announced.clear()
    limit["norm"] = 0.1 * _b_norm(trained)
    ad.base_version = 3
    judged: list[float] = []

    class Killed(Exception):
        pass

    def judge_then_die(org: str, name: str, serving: dict, training: list) -> tuple[dict, Decision]:
        judged.append(round(_b_norm(lora.adapter_state_dict(ad.model, name)) / _b_norm(trained), 4))
        if len(judged) == 2:
            raise Killed
        return judge(org, name, serving, training)

    ad._judge = judge_then_die  # type: ignore[method-assign]
    with pytest.raises(Killed):
        ad.revalidate()
    ad.ledger = AdapterLedger.from_state(msgspec.json.decode(msgspec.json.encode(ad.ledger.state())))
    ad._judge = judge  # type: ignore[method-assign]
    out = ad.revalidate()
    assert judged == [0.5, 0.25]  # before the kill: a3 as it was, then half of it (not recorded)
    assert [(d.version, d.status) for d in out] == [(5, "rejected"), (6, "rejected")], out
    assert "at 0.25 times a3's effect" in out[-1].reason
    assert ad.ledger.serving("org-2") is None and ad.ledger.retired == {"org-2": 3}
    assert [(ck.version, ck.status) for ck in announced if ck.status == "rolled_back"] == [(3, "rolled_back")]
    assert [ck.version for ck in announced if ck.status == "rejected"] == [4, 5, 6]
