"""The per-org adapter gate and ledger (``evalgate/adapters.py``), pure.

- An adapter is promoted only when it is not worse than what serves its org on the org's held-out tasks, has not
  drifted from the base alone there, and the global guard finds no regression against the base; the reason names
  the side that refused.
- The ledger keeps each org's versions apart: promotions, a rollback per org (to the previous promoted version, or
  the base alone) that leaves other orgs untouched, and the adapters a base promotion leaves stale (re-validated
  as new versions whose parent is the old one, or retired); its state round-trips through JSON.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evalgate.adapters import AdapterLedger, decide_adapter
from evalgate.gate import GateRules

GOOD = {"solve_rate": 0.6, "broken_tool_call_rate": 0.05, "clarify_rate": 0.05, "edit_rate": 0.9}
RULES = GateRules(alpha=None)


def _with(**kw: float) -> dict[str, float]:
    return GOOD | kw


def test_an_adapter_better_on_its_org_and_harmless_globally_is_promoted():
    d = decide_adapter(_with(solve_rate=0.8), GOOD, GOOD, 400, GOOD, GOOD, 400, RULES)
    assert d.promote, d.reason
    assert d.reason.startswith("org: solve rate 0.800 (serving 0.600)") and "global guard:" in d.reason


def test_a_drop_on_the_org_refuses_it_naming_the_org_side():
    d = decide_adapter(_with(solve_rate=0.4), GOOD, GOOD, 400, GOOD, GOOD, 400, RULES)
    assert not d.promote
    assert d.problems and all(p.startswith("org: ") for p in d.problems)


def test_a_global_regression_refuses_it_even_when_the_org_gains():
    broken = _with(broken_tool_call_rate=0.2)
    d = decide_adapter(_with(solve_rate=0.9), GOOD, GOOD, 400, broken, GOOD, 400, RULES)
    assert not d.promote
    assert [p.split(":")[0] for p in d.problems] == ["global guard"]
    assert "broken_tool_call_rate" in d.reason


def test_slow_drift_from_the_base_alone_is_caught_on_the_org_side():
    """Each step within its parent's limits, but far from the base alone: the first-version comparison refuses."""
    serving = _with(clarify_rate=0.09)  # the previous adapter version already drifted a little
    d = decide_adapter(_with(clarify_rate=0.12), serving, GOOD, 400, GOOD, GOOD, 400, RULES)
    assert not d.promote and "vs first" in d.reason


def test_ledger_promotes_and_rolls_back_per_org():
    led = AdapterLedger()
    a1 = led.add("org-1", base_version=3, path="/a/org-1/1")
    led.decide("org-1", a1.version, True, {"solve_rate": 0.7})
    a2 = led.add("org-1", base_version=3, path="/a/org-1/2", parent=a1.version)
    led.decide("org-1", a2.version, True)
    b1 = led.add("org-2", base_version=3, path="/a/org-2/1")
    led.decide("org-2", b1.version, True)
    assert (a1.version, a2.version, b1.version) == (1, 2, 1)
    gone, now = led.rollback("org-1")
    assert gone.version == 2 and gone.status == "rolled_back"
    assert now is not None and now.version == 1
    assert led.serving("org-2") is b1  # the other org is untouched
    gone, now = led.rollback("org-1")
    assert gone.version == 1 and now is None  # back to the base alone
    with pytest.raises(ValueError, match="nothing to roll back"):
        led.rollback("org-1")


def test_a_rejected_version_never_serves():
    led = AdapterLedger()
    v = led.add("org-1", 0, "/x")
    led.decide("org-1", v.version, False)
    assert led.serving("org-1") is None and led.versions["org-1"][1].status == "rejected"
    assert led.next_version("org-1") == 2  # numbers are never reused


def test_base_promotion_makes_serving_adapters_stale_and_revalidation_is_a_new_version():
    led = AdapterLedger()
    for org in ("org-1", "org-2"):
        v = led.add(org, base_version=2, path=f"/a/{org}/1")
        led.decide(org, v.version, True)
    assert [v.org for v in led.stale(2)] == []
    stale = led.stale(3)
    assert [v.org for v in stale] == ["org-1", "org-2"]
    again = led.revalidate(stale[0], 3)
    assert (again.version, again.parent, again.base_version, again.path) == (2, 1, 3, "/a/org-1/1")
    led.decide("org-1", again.version, True)
    assert led.retire("org-2") is not None  # failed on the new base: the base alone serves org-2
    assert led.serving("org-2") is None and led.serving("org-1") is again
    assert led.stale(3) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["org-1", "org-2", "org-3"]), st.sampled_from(["add_ok", "add_bad", "rollback"])),
        max_size=30,
    )
)
def test_ledger_state_round_trips_and_orgs_never_mix(ops):
    led = AdapterLedger()
    for org, op in ops:
        if op == "rollback":
            if led.serving(org) is not None:
                gone, _ = led.rollback(org)
                assert gone.org == org
            continue
        v = led.add(org, 1, f"/a/{org}/{led.next_version(org)}")
        led.decide(org, v.version, op == "add_ok")
    back = AdapterLedger.from_state(json.loads(json.dumps(led.state())))
    assert back.state() == led.state()
    for org, vs in back.versions.items():
        assert all(v.org == org and v.path.startswith(f"/a/{org}/") for v in vs.values())
        s = back.serving(org)
        assert s is None or (s.org == org and s.status == "promoted")
