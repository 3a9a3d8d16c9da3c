"""mtp-moe-router on the real path: the zoo HybridModel (and Bridge's NemotronH) through Megatron's own step.

The zoo (``tiny_hybrid.build_zoo``: the Super recipe's MTP ``"*E"`` at 2 depths, one repeated layer)
with the MoE aux loss on (``parity``'s "zoo, aux loss"), one step of ``MegatronStep(aux_loss_only=True)``
(only ``MoEAuxLossAutoScaler`` puts gradient anywhere), three ways on the same ranks and batch:
stock (built and stepped without the overlay), flagged (stock, ``is_mtp_layer`` set by hand on the
MTP block's MoE layers: `bed.steps.moe`'s reference semantics, what Megatron-LM PR #6748 builds) and
the overlay (built and stepped with mtp-moe-router). At TP1, EP2 and TP2+SP (shared pools, one rank
run per layout):

* stock's MTP router aux-loss gradient is ``mtp_num_layers`` x the flagged one; the overlay's equals
  the flagged one (relative error <= 1e-6), at every layout TP1's, and so do the backbone routers';
* logging: the overlay's backbone slots are the flagged ones and the MTP router's loss sits in the
  MTP depth's slot (``num_layers + 1``); stock logs it in the slot of its place in the MTP pattern;
* the flags sit on the instances (the MoE layer, the layer holding it, the router), ``layer_number``
  keeps upstream's value, and during the step the only overlay code that runs is the router's
  logging wrapper, once per router application and logging function (a profiler says which
  functions of the fix ran): nothing per token.

``"*E*E/*E"`` (one depth; backbone MoE at layers 2 and 4) runs with the overlay where the flag alone
crashes: on a copy of megatron-core edited the way PR #6748 edits ``HybridStack``, stock raises
``IndexError`` at ``moe_logging.py:125`` and the overlay trains exactly as it does on the pinned
release. Router replay (the pin's ``router_replay.py:26-112``) lists the routers in creation order, the
MTP router last; its ``layer_number`` (2) is backbone layer 2's with or without the fix.
"""

import numpy as np
import pytest
from moe_router_cases import FIX, VARIANTS, aux_step, facts_on, router_classes, two_backbone_moe

from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.models.tiny_hybrid import ZOO_PATTERN

RELERR = 1e-6
MAIN, MTP = ZOO_PATTERN.split("/")[:2]
DEPTHS = ZOO_PATTERN.count("/")
BACKBONE_MOE = [index for index, symbol in enumerate(MAIN) if symbol == "E"]  # slot - 1
MTP_MOE = [index for index, symbol in enumerate(MTP) if symbol == "E"]  # place in the MTP pattern - 1
needs_bridge = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)


def relerr(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def tp1_plan():
    return dict(zoo=aux_step("zoo, aux loss", False), two=two_backbone_moe(()), two_fixed=two_backbone_moe((FIX,)),
                replay_stock=two_backbone_moe((), replay=True), replay=two_backbone_moe((FIX,), replay=True),
                classes=router_classes())


# ---------------------------------------------------------------- layout runs


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(tp1_plan, 1, fixes=[], timeout=900)[0]


@pytest.fixture(scope="module")
def ep2():
    return run_ranks_checked(aux_step, 2, ep=2, args=("zoo, aux loss", False), fixes=[], timeout=900)[0]


@pytest.fixture(scope="module")
def tp2_sp():
    return run_ranks_checked(aux_step, 2, tp=2, args=("zoo, aux loss", True), fixes=[], timeout=900)[0]


@pytest.fixture(scope="module")
def bridge_tp1():
    return run_ranks_checked(aux_step, 1, args=("bridge zoo, aux loss", False), fixes=[], timeout=900)[0]


def zoo_of(request, name):
    found = request.getfixturevalue(name)
    return found["zoo"] if name == "tp1" else found


LAYOUTS = ["tp1", "ep2", "tp2_sp"]


# ---------------------------------------------------------------- the aux-loss gradient


def check_gradients(measured):
    """Stock's MTP router gradient is DEPTHS x the flagged one; the overlay's is the flagged one, and so
    are the backbone routers' and the losses."""
    stock, flagged, overlay = (measured[variant] for variant in VARIANTS)
    assert stock["mtp"].keys() == flagged["mtp"].keys() == overlay["mtp"].keys() and len(stock["mtp"]) == len(MTP_MOE)
    for name, reference in flagged["mtp"].items():
        assert np.linalg.norm(reference) > 0
        assert relerr(stock["mtp"][name], DEPTHS * reference) <= RELERR, name
        assert relerr(overlay["mtp"][name], reference) <= RELERR, name
        assert relerr(stock["mtp"][name], reference) > 0.5, name  # the defect, well above the tolerance
    for name, reference in flagged["backbone"].items():
        assert relerr(overlay["backbone"][name], reference) <= RELERR, name
    assert overlay["losses"] == flagged["losses"] == stock["losses"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_stock_counts_the_mtp_router_aux_loss_twice_and_the_overlay_once(request, name):
    check_gradients(zoo_of(request, name))


@pytest.mark.parametrize("name", LAYOUTS[1:])
def test_the_overlay_gives_tp1s_gradient_at_every_layout(request, tp1, name):
    measured, reference = zoo_of(request, name)["overlay"], tp1["zoo"]["flagged"]
    for part in ("mtp", "backbone"):
        for key, grad in reference[part].items():
            assert relerr(measured[part][key], grad) <= RELERR, (part, key)


@pytest.mark.slow
@needs_bridge
def test_bridge_built_nemotron_h_with_the_super_recipes_mtp(bridge_tp1):
    """Bridge's NemotronH provider (its router: sigmoid, expert bias, sequence aux loss; a shared expert)."""
    check_gradients(bridge_tp1)
    check_slots(bridge_tp1)


# ---------------------------------------------------------------- logging slots, flags, identity


def check_slots(measured):
    """Backbone slots as flagged; the MTP router's loss in slot num_layers + depth (1) with the value
    flagged logs at num_layers + its place in the MTP pattern; stock's in its place's slot."""
    stock, flagged, overlay = (measured[variant] for variant in VARIANTS)
    (metric, slots), = overlay["slots"].items()
    reference, on_stock = flagged["slots"][metric], stock["slots"][metric]
    assert len(slots) == len(reference) == len(MAIN) + DEPTHS
    depth_slot = len(MAIN)  # index of slot num_layers + 1
    (place,) = MTP_MOE
    expected = list(reference)
    expected[depth_slot], expected[len(MAIN) + place] = reference[len(MAIN) + place], 0.0
    assert reference[len(MAIN) + place] > 0 and slots == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert all(slots[index] == reference[index] for index in BACKBONE_MOE)
    assert on_stock[place] > 0 and on_stock[depth_slot] == 0  # stock: the place's slot (a backbone layer's)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_mtp_router_logs_in_its_depths_slot(request, name):
    check_slots(zoo_of(request, name))


def test_flags_sit_on_the_instances_and_layer_number_keeps_upstreams_value(tp1):
    zoo = tp1["zoo"]
    for variant, flags in (("stock", False), ("flagged", True), ("overlay", True)):
        for layer in zoo[variant]["layers"]:
            assert layer["flags"] == [flags] * 3, variant
    assert [layer["depth"] for layer in zoo["overlay"]["layers"]] == [1] * len(MTP_MOE)
    assert [layer["number"] for layer in zoo["overlay"]["layers"]] == [layer["number"] for layer in
                                                                       zoo["stock"]["layers"]]
    assert [layer["number"] for layer in zoo["stock"]["layers"]] == [place + 1 for place in MTP_MOE]


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_hook_runs_at_build_time_and_in_logging_only(request, name):
    """While building: the MTP layer's hook once per MTP layer (one: the repeated layer). While
    stepping: only the router's logging wrapper, once per router application and logging function
    (attach_and_log_load_balancing_loss, apply_z_loss): the backbone's MoE layers once, the repeated
    MTP layer's once per depth. Stock and flagged run none of the fix."""
    measured = zoo_of(request, name)
    assert measured["overlay"]["build"] == {"mtp_layer_built": 1, "flag_moe_layers": 1, "logs_by_depth": 1}
    applications = len(BACKBONE_MOE) + DEPTHS * len(MTP_MOE)
    assert measured["overlay"]["step"] == {"log_at_depth": 2 * applications}
    for variant in ("stock", "flagged"):
        assert measured[variant]["build"] == measured[variant]["step"] == {}, variant


def test_a_router_that_overrides_the_logging_is_left_as_built_and_said_so(tp1):
    """The build hook flags a router only where its logging goes through the fix's wrapper (or reads
    mtp_depth itself): with the flag alone its slot could overflow the tracker. A router class that
    overrides attach_and_log_load_balancing_loss is left unflagged, with a warning naming it."""
    facts = tp1["classes"]
    assert (facts["stock"], facts["hooked"], facts["own"]) == (False, True, False)
    assert facts["own_flagged"] == 0 and facts["own_flags"] == [False, False]
    assert len(facts["warned"]) == 1 and "OwnLogging" in facts["warned"][0] and FIX in facts["warned"][0]
    assert facts["flagged"] == 1 and facts["flags"] == [True, True]


# ---------------------------------------------------------------- "*E*E/*E": where the flag alone crashes


def test_two_backbone_moe_layers_and_one_depth_run_with_the_overlay(tp1):
    """On the pinned release stock runs (the MTP router unflagged: its loss in backbone layer 2's slot,
    counted as its own); the overlay logs it in slot 5 of 5, the MTP depth's."""
    stock, fixed = tp1["two"], tp1["two_fixed"]
    assert stock["error"] is None and fixed["error"] is None
    for metric in ("load_balancing_loss", "z_loss"):
        slots, on_stock = fixed["slots"][metric], stock["slots"][metric]
        assert len(slots) == len(on_stock) == 5
        assert [value > 0 for value in slots] == [False, True, False, True, True], (metric, slots)
        assert [value > 0 for value in on_stock] == [False, True, False, True, False], (metric, on_stock)
        assert on_stock[1] == pytest.approx(slots[1] + slots[4], rel=1e-6)  # backbone 2 + MTP, in one slot
    (name,) = fixed["mtp"]
    assert relerr(stock["mtp"][name], fixed["mtp"][name]) <= RELERR  # one depth: nothing counted twice


def test_router_replay_keeps_creation_order_and_layer_numbers(tp1):
    """The pinned release's RouterReplay lists routers in creation order (the MTP block after the decoder): the MTP
    router is last; its layer_number is its place in the MTP pattern, the same as backbone layer 2's,
    with and without the fix. The fix adds what tells it apart: is_mtp_layer and mtp_depth."""
    stock, fixed = tp1["replay_stock"]["replay"], tp1["replay"]["replay"]
    assert [entry["layer_number"] for entry in fixed] == [entry["layer_number"] for entry in stock] == [2, 4, 2]
    assert [entry["name"] for entry in fixed] == [entry["name"] for entry in stock]
    assert fixed[-1]["name"].startswith("mtp.") and not any(entry["name"].startswith("mtp.") for entry in fixed[:-1])
    assert [entry["is_mtp_layer"] for entry in stock] == [False] * 3
    assert [(entry["is_mtp_layer"], entry["depth"]) for entry in fixed] == [(False, None), (False, None), (True, 1)]


PR_6748 = (  # the edit of Megatron-LM PR #6748: HybridStack's MOE branch passes the flag
    "                        submodules.moe_layer,\n                        config=self.config,\n"
    "                        layer_number=layer_number,\n                        pg_collection=pg_collection,\n"
)
ON_COPY = """
import json, sys
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
sys.path.insert(0, {tests!r})
from moe_router_cases import two_backbone_moe

if __name__ == "__main__":
    import mtp_overlay, megatron.core
    from mtp_overlay import registry

    out = dict(file=megatron.core.__file__, check=[(r.verdict, r.reason) for r in registry.check([{fix!r}])])
    out["stock"] = run_ranks_checked(two_backbone_moe, 1, args=((),), fixes=[], timeout=600)[0]
    out["overlay"] = run_ranks_checked(two_backbone_moe, 1, args=(({fix!r},),), fixes=[], timeout=600)[0]
    for run in ("stock", "overlay"):
        out[run]["mtp"] = {{k: v.tolist() for k, v in (out[run].get("mtp") or {{}}).items()}}
    print("FACTS " + json.dumps(out))
"""


@pytest.mark.slow
def test_upstreams_flag_alone_crashes_where_the_overlay_trains(tmp_path, tp1):
    """A copy of the pinned megatron-core with PR #6748's edit (as Megatron-LM main has it): the probe
    says needed for the slot half (#7172); stock raises IndexError in the tracker, moe_logging.py:125;
    the overlay gives the pinned release's overlay step exactly."""
    from pins import MEGATRON_CORE

    from mtp_overlay.bed.runtime.releases import release_copy

    site = release_copy("megatron-core", MEGATRON_CORE, tmp_path / "site")
    path = site / "megatron/core/models/hybrid/hybrid_block.py"
    source = path.read_text()
    assert source.count(PR_6748) == 1
    path.write_text(source.replace(PR_6748, PR_6748 + "                        is_mtp_layer=is_mtp_layer,\n"))
    facts = facts_on(site, ON_COPY, tmp_path / "on_copy.py")
    assert facts["file"].startswith(str(site))
    ((verdict, reason),) = facts["check"]
    assert verdict == "needed" and "passes is_mtp_layer (PR #6748)" in reason and "#7172" in reason
    stock, overlay = facts["stock"], facts["overlay"]
    assert stock["error"] == "IndexError: index 5 is out of bounds for dimension 0 with size 5", stock["error"]
    assert stock["where"] == "core/transformer/moe/moe_logging.py:125"
    pinned = tp1["two_fixed"]
    assert overlay["error"] is None
    assert {metric: tuple(slots) for metric, slots in overlay["slots"].items()} == pinned["slots"]
    for name, grad in pinned["mtp"].items():
        assert np.array_equal(np.asarray(overlay["mtp"][name], dtype=grad.dtype), grad), name


def test_the_reproducer_shows_the_bug_on_the_pinned_release():
    """The stock path `check --run` and the support matrix run: the MTP block built by the release's
    own MultiTokenPredictionBlock, its MoE layer once per depth."""
    from mtp_overlay.bed.fixes import reproduce

    shows, evidence = reproduce(FIX)
    assert shows, evidence
    assert "is_mtp_layer=False" in evidence and "2.000x the flagged reference's" in evidence
    assert "logged in slot [2] of 4 (the MTP depth's: 3)" in evidence
