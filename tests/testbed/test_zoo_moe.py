"""The layer zoo's MoE half: 'E' layers, both token dispatchers, expert parallelism, the Super recipe's MTP.

The zoo model (``tiny_hybrid.build_zoo``, pattern ``ZOO_PATTERN``: attention, MoE and MLP layers; the
MTP block ``"*E"`` at 2 depths with ``mtp_use_repeated_layer``, as Megatron-Bridge's Nemotron 3 Super
recipe trains it) is megatron-core's own HybridModel with ``MoETransformerLayer`` + ``MoELayer``
(``SequentialMLP`` experts); Bridge's NemotronH provider builds the same layers from a tiny HF
``NemotronHConfig``. Everything goes through Megatron's own training step (DDP,
``get_forward_backward_func``, ``finalize_model_grads``) at TP1, EP2 (data parallel for the rest),
TP2+SP, TP2xEP2+SP (expert tensor parallel size 1 on the same ranks) and CP2, one rank run per
layout with every case of it batched:

* the zoo builds the layers its pattern names and refuses what the local spec cannot build;
* it trains (two Adam steps, the loss falls, every parameter, each rank's experts included, gets a
  gradient);
* its parity rows (``bed.engines.parity``) equal the per-sequence reference with the aux-loss
  coefficient 0 (BSHD and packed THD, both flavours): the overlay always, stock where no fix is
  needed, and stock differs where ``parity.row_needs`` names a fix. With the aux loss on (BSHD only:
  the load-balancing loss is a function of the whole batch's routing) stock at every layout equals
  TP1 stock on the same batch and misses the flagged-by-hand reference by the MTP-MoE-router defect
  (``parity.MTP_MOE_ROUTER``), and the overlay (mtp-moe-router among its fixes) equals it;
* the alltoall dispatcher's CPU stand-ins (``cpu_shims``) are checked against the allgather
  dispatcher (no stand-in) on the same model and batch, and each is shown needed;
* the aux-loss measurement the MoE-router fix needs (``bed.steps.moe``): stock's MTP router gradient
  from the aux loss alone is exactly ``mtp_num_layers`` times the gradient with ``is_mtp_layer`` set
  by hand on the instances, and stock logs the MTP aux loss in the backbone layer's slot.

The rank runs of TP1, EP2 and TP2+SP (shared pools) are the fast subset (~45 s on 2 loaded cores);
TP2xEP2+SP, CP2 (a fresh pool) and the Bridge-built zoo (Bridge's import) are ``slow`` (the whole
module ~100 s).
"""

import numpy as np
import pytest

from mtp_overlay.bed.engines import parity
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.models.tiny_hybrid import ZOO_PATTERN

EXACT = 1e-6  # max |Δgrad| of float32 gradients summed in another order (measured: <= 1e-7)
LOSS = 1e-5  # relative, losses
DIFFERS = 1e-4  # a missing fix moves the MTP gradient by >= 1e-3 here
DIRECT = ("zoo", "zoo, aux loss")
BRIDGE = ("bridge zoo", "bridge zoo, aux loss")
needs_bridge = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)
# what the zoo pattern says (so the tests follow it when a layer kind joins the zoo)
MAIN, MTP = ZOO_PATTERN.split("/")[:2]
DEPTHS = ZOO_PATTERN.count("/")  # mtp_num_layers: the repeated MTP layer's applications
LAYER_CLASSES = {"*": "TransformerLayer", "E": "MoETransformerLayer", "-": "MLPLayer", "M": "MambaLayer"}
BACKBONE_MOE = [index for index, symbol in enumerate(MAIN) if symbol == "E"]  # layer number - 1
MTP_MOE = [index for index, symbol in enumerate(MTP) if symbol == "E"]  # within the MTP pattern


# ---------------------------------------------------------------- rank workers


def zoo_plan(parallelism, cases, extras):
    """Rank worker: the parity ``cases`` (`parity.run_cases`), then the layout's own checks named in
    ``extras`` (keys of EXTRAS); rank 0's results (None elsewhere)."""
    import torch

    results = dict(rows=parity.run_cases(cases))
    sp = parity.PARALLELISMS[parallelism]["sp"]
    for name in extras:
        results[name] = EXTRAS[name](sp)
    return results if torch.distributed.get_rank() == 0 else None


def build_facts(sp):
    """What build_zoo and build_tiny_hybrid build and refuse; the host-tensor stand-in's behaviour."""
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from mtp_overlay.bed.runtime import cpu_shims
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid, build_zoo

    facts = dict(zoo=_layers(build_zoo()), allgather=_layers(build_zoo(moe_token_dispatcher_type="allgather")))
    refusals = {}
    for pattern, overrides in (("-D-E/-E", {}), ("*G*-", {}), ("*E", dict(moe_token_dispatcher_type="flex"))):
        try:
            build_tiny_hybrid(hybrid_layer_pattern=pattern, **overrides)
            refusals[pattern] = None
        except ValueError as error:
            refusals[pattern] = str(error)
    facts["refusals"] = refusals
    splits = torch.tensor([3, 1])
    stand_in, upstream = token_dispatcher.maybe_move_tensor_to_cpu, moe_utils.maybe_move_tensor_to_cpu
    facts["to_host"] = dict(
        stand_in_numpy=_kind(stand_in(splits, as_numpy=True)),
        stand_in_values=stand_in(splits, as_numpy=True).tolist(),
        upstream_numpy=_kind(upstream(splits, as_numpy=True)),
        stand_in_keeps=stand_in(splits) is splits and stand_in(None, as_numpy=True) is None,
        upstream_is_original=upstream is cpu_shims.original(token_dispatcher, "maybe_move_tensor_to_cpu"),
    )
    return facts


def bridge_facts(sp):
    """The NemotronH MoE provider's model: provider, config keys from the HF config, layers."""
    from mtp_overlay.bed.models.bridge import bridge_provider, build_bridge_model, own_attention_backend

    provider = bridge_provider("nemotron_h_zoo")
    with own_attention_backend():
        model = build_bridge_model("nemotron_h_zoo")
    keys = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "mtp_num_layers", "mtp_use_repeated_layer", "hybrid_layer_pattern", "moe_token_dispatcher_type",
            "moe_router_score_function", "moe_router_load_balancing_type", "moe_grouped_gemm")
    return dict(provider=type(provider).__name__, config={key: getattr(model.config, key) for key in keys},
                layers=_layers(model))


def _layers(model):
    moe = model.decoder.layers[BACKBONE_MOE[0]].mlp
    mtp = model.mtp.layers
    return dict(
        model=type(model).__name__,
        decoder=[type(layer).__name__ for layer in model.decoder.layers],
        mtp_layers=len(mtp),
        mtp_inner=[type(layer).__name__ for layer in mtp[0].mtp_model_layer.layers],
        moe=type(moe).__name__,
        experts=type(moe.experts).__name__,
        local_experts=len(moe.experts.local_experts),
        shared_experts=moe.shared_experts is not None,
        router=type(moe.router).__name__,
        dispatcher=type(moe.token_dispatcher).__name__,
        mtp_router_flag=mtp[0].mtp_model_layer.layers[MTP_MOE[0]].mlp.router.is_mtp_layer,
    )


def _kind(value):
    return type(value).__module__.split(".")[0] + "." + type(value).__name__


def train(sp):
    """Two steps of megatron-core's Adam through Megatron's step on one BSHD batch (SFT, aux loss on)."""
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.tiny_gpt import make_batch
    from mtp_overlay.bed.models.tiny_hybrid import build_zoo

    step = MegatronStep(build_zoo(sequence_parallel=sp), optimizer="megatron")
    first = step.step([make_batch()], loss="3-output")
    second = step.step([make_batch()], loss="3-output")
    return dict(losses=(first.lm_loss, second.lm_loss), mtp_losses=(first.mtp_losses, second.mtp_losses),
                update_norms=(first.update_norm, second.update_norm), zero_grad_params=first.zero_grad_params,
                aux_slots=first.moe_metrics)


def aux(sp, bridge=False):
    """The aux loss's gradient alone (`moe.aux_loss_gradients`), stock and with the MTP block's MoE
    layers flagged by hand, on the parity table's BSHD batch (RL forward, per-token loss)."""
    from mtp_overlay.bed.steps import moe
    from mtp_overlay.bed.steps.megatron_step import MegatronStep

    model = "bridge zoo, aux loss" if bridge else "zoo, aux loss"
    out = {}
    for flag in (False, True):
        step = MegatronStep(parity.build(model, sequence_parallel=sp, mtp_moe_flag=flag), optimizer=None)
        measured = moe.aux_loss_gradients(step, [parity.microbatch(parity.Case(model, "bshd"))], labels=False)
        out[flag] = dict(mtp=measured.mtp, backbone=measured.backbone, slots=measured.slots,
                         losses=(measured.step.lm_loss, measured.step.mtp_losses),
                         flags=[layer.router.is_mtp_layer for _, layer in moe.mtp_moe_layers(step.language_model)])
    return out


def bridge_aux(sp):
    return aux(sp, bridge=True)


def dispatchers(sp):
    """The zoo (aux loss on) with the allgather dispatcher (no stand-in) and the alltoall one (the
    stand-ins), one step each on a BSHD and a packed row; then each alltoall stand-in put back to
    upstream's object in turn: the error it gives."""
    from megatron.core.transformer.moe import token_dispatcher

    from mtp_overlay.bed.runtime import cpu_shims, shim
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.tiny_hybrid import build_zoo

    batches = [parity.microbatch(parity.Case("zoo", "bshd")),
               parity.microbatch(parity.Case("zoo", "padded", pad_multiple=parity.PARALLELISMS["TP1"]["pad_multiple"]))]

    def run(dispatcher):
        step = MegatronStep(build_zoo(moe_token_dispatcher_type=dispatcher, sequence_parallel=sp,
                                      calculate_per_token_loss=True), optimizer=None)
        return [step.step([batch], labels=False, update=False) for batch in batches]

    out = {dispatcher: run(dispatcher) for dispatcher in ("allgather", "alltoall")}
    owner = token_dispatcher.MoEAlltoAllTokenDispatcher
    for name, (where, attribute) in (("dtoh_stream", (owner, "cuda_dtoh_stream")),
                                     ("split_sizes", (token_dispatcher, "maybe_move_tensor_to_cpu"))):
        with shim.swapped([shim.Shim(where, attribute, cpu_shims.original(where, attribute))]):
            try:
                run("alltoall")
                out[name] = None
            except Exception as error:  # noqa: BLE001 - the failure is the result
                out[name] = f"{type(error).__name__}: {error}"
    return out


def upstream_experts(sp):
    """The zoo's BSHD parity case with each rank building only its own experts (upstream's expert
    builder called directly, not through `tiny_hybrid.experts_of_every_rank`)."""
    from mtp_overlay.bed.runtime import shim
    from mtp_overlay.bed.models import tiny_hybrid
    from mtp_overlay.bed.steps.megatron_step import MegatronStep

    def own_experts_only(build_experts, num_local_experts, config, *, pg_collection, name=None):
        return build_experts(num_local_experts, config, pg_collection=pg_collection, name=name)

    with shim.swapped([shim.Shim(tiny_hybrid, "experts_of_every_rank", own_experts_only)]):
        model = parity.build("zoo", sequence_parallel=sp)
    step = MegatronStep(model, optimizer=None)
    return step.step([parity.microbatch(parity.Case("zoo", "bshd"))], labels=False, update=False)


EXTRAS = dict(build=build_facts, bridge_build=bridge_facts, train=train, aux=aux, bridge_aux=bridge_aux,
              dispatch=dispatchers, upstream_experts=upstream_experts)


# ---------------------------------------------------------------- layout runs (one per layout)


def run_zoo(parallelism, models, extras=(), references=None):
    """One rank run of ``parallelism``: (with the references at TP1 first) the models' parity cases
    and ``extras``. A shared pool (the layout's stock paths exchange nothing out of step without CP)."""
    spec = parity.PARALLELISMS[parallelism]
    cases = (parity.reference_cases(models) if parallelism == "TP1" else []) + parity.table_cases(parallelism, models)
    layout = dict(tp=spec["tp"], cp=spec["cp"], ep=spec.get("ep", 1), etp=spec.get("etp"))
    results = run_ranks_checked(zoo_plan, spec["world_size"], args=(parallelism, cases, tuple(extras)), fixes=[],
                                timeout=900, **layout)[0]
    if parallelism == "TP1":
        count = len(parity.reference_cases(models))
        results["references"], results["rows"] = results["rows"][:count], results["rows"][count:]
    else:
        results["references"] = references
    results["table"] = parity.table_rows(results["references"], [(parallelism, o) for o in results["rows"]])
    return results


@pytest.fixture(scope="module")
def tp1():
    return run_zoo("TP1", DIRECT, ("build", "train", "aux"))


@pytest.fixture(scope="module")
def ep2(tp1):
    return run_zoo("EP2", DIRECT, ("train", "aux", "dispatch", "upstream_experts"), tp1["references"])


@pytest.fixture(scope="module")
def tp2_sp(tp1):
    return run_zoo("TP2+SP", DIRECT, ("train", "aux"), tp1["references"])


@pytest.fixture(scope="module")
def bridge_tp1():
    return run_zoo("TP1", BRIDGE, ("bridge_build", "bridge_aux"))


@pytest.fixture(scope="module")
def tp2_ep2(tp1):
    """TP2xEP2+SP on 2 ranks, expert tensor parallel size 1 (the Super recipe's layout)."""
    return run_zoo("TP2xEP2+SP", DIRECT, ("train", "aux", "dispatch"), tp1["references"])


@pytest.fixture(scope="module")
def bridge_tp2_ep2(bridge_tp1):
    return run_zoo("TP2xEP2+SP", BRIDGE, ("bridge_aux",), bridge_tp1["references"])


PARALLELISM = {"tp1": "TP1", "ep2": "EP2", "tp2_sp": "TP2+SP", "tp2_ep2": "TP2xEP2+SP"}
LAYOUTS = ["tp1", "ep2", "tp2_sp", pytest.param("tp2_ep2", marks=pytest.mark.slow)]


# ---------------------------------------------------------------- the model


def test_zoo_holds_the_layers_of_its_pattern(tp1):
    """ZOO_PATTERN's layers in order; one MTP layer (repeated at every depth) of the MTP pattern's
    layers; megatron-core's MoELayer, SequentialMLP experts, TopKRouter and the dispatcher asked for;
    stock builds the MTP block's router without is_mtp_layer."""
    zoo, allgather = tp1["build"]["zoo"], tp1["build"]["allgather"]
    assert zoo["model"] == "HybridModel"
    assert zoo["decoder"] == [LAYER_CLASSES[symbol] for symbol in MAIN]
    assert zoo["mtp_layers"] == 1 and zoo["mtp_inner"] == [LAYER_CLASSES[symbol] for symbol in MTP]
    assert (zoo["moe"], zoo["experts"], zoo["router"]) == ("MoELayer", "SequentialMLP", "TopKRouter")
    assert zoo["local_experts"] == 4 and not zoo["shared_experts"]
    assert zoo["dispatcher"] == "MoEAlltoAllTokenDispatcher"
    assert allgather["dispatcher"] == "MoEAllGatherTokenDispatcher"
    assert zoo["mtp_router_flag"] is False  # the open defect, on stock


def test_patterns_the_local_spec_cannot_build_are_refused(tp1):
    refusals = tp1["build"]["refusals"]
    assert "'D': DeepSeek sparse attention" in refusals["-D-E/-E"]
    assert "'G'" in refusals["*G*-"] and "hybrid_layer_pattern" in refusals["*G*-"]
    assert "moe_token_dispatcher_type must be one of ('allgather', 'alltoall')" in refusals["*E"]


@pytest.mark.slow
@needs_bridge
def test_bridge_builds_the_zoo_from_a_nemotron_h_config(bridge_tp1):
    """n_routed_experts / num_experts_per_tok / moe_intermediate_size / the shared expert and the MTP
    keys of the HF config reach megatron-core through NemotronHBridge; the layers are the zoo's."""
    facts = bridge_tp1["bridge_build"]
    assert facts["provider"] == "HybridModelProvider"
    assert facts["config"] == dict(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=64,
        mtp_num_layers=DEPTHS, mtp_use_repeated_layer=True, hybrid_layer_pattern=ZOO_PATTERN,
        moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
        moe_router_load_balancing_type="seq_aux_loss", moe_grouped_gemm=False,
    )
    layers = facts["layers"]
    assert layers["decoder"] == [LAYER_CLASSES[symbol] for symbol in MAIN]
    assert layers["mtp_layers"] == 1 and layers["mtp_inner"] == [LAYER_CLASSES[symbol] for symbol in MTP]
    assert layers["experts"] == "SequentialMLP" and layers["shared_experts"] and layers["local_experts"] == 4


# ---------------------------------------------------------------- training and parity


@pytest.mark.parametrize("name", LAYOUTS)
def test_zoo_trains_through_megatrons_step(request, name):
    """Adam through Megatron's step moves every parameter (each rank's own experts under EP) and lowers
    the loss; the aux loss is logged per layer."""
    train = request.getfixturevalue(name)["train"]
    assert train["zero_grad_params"] == ()
    assert all(norm > 0 for norm in train["update_norms"])
    assert train["losses"][1] < train["losses"][0]
    slots = train["aux_slots"]["load_balancing_loss"]
    # the backbone's MoE layers' slots (stock logs the MTP block's at its position in the MTP pattern)
    logged = set(BACKBONE_MOE) | set(MTP_MOE)
    assert len(slots) == len(MAIN) + DEPTHS
    assert all((value > 0) == (index in logged) for index, value in enumerate(slots)), slots


def check_rows(table):
    """Every row, stock and overlay: exact where nothing it needs (`parity.row_needs`) is missing (for
    the overlay: an open defect, `parity.open_defects`); the MTP-MoE-router defect alone (stock's, or
    the overlay's while no fix of its id is registered) moves the MTP and the rest's gradients and
    nothing else (the layout check: TP1 stock on the same batch);
    any missing fix moves the MTP gradient. Returns the number of rows."""
    for (model, layout, parallelism), row in table.items():
        name = (model, layout, parallelism)
        reference = row["reference"]
        assert reference.error is None, name
        needs = parity.row_needs(model, layout, parallelism)
        for variant, missing in (("stock", needs), ("overlay", set(parity.open_defects(model)))):
            outcome = row[variant]
            assert outcome.error is None, (name, variant, outcome.error)
            assert outcome.step.lm_loss == pytest.approx(reference.step.lm_loss, rel=LOSS), (name, variant)
            max_mtp, max_rest, *_ = outcome.compare(reference)
            if not missing:
                assert max(max_mtp, max_rest) <= EXACT, (name, variant, max_mtp, max_rest)
                assert outcome.step.mtp_losses == pytest.approx(reference.step.mtp_losses, rel=LOSS), (name, variant)
                # the tracker counts MTP positions over the data-parallel replicas, each fed the same batch
                spec = parity.PARALLELISMS[parallelism]
                replicas = spec["world_size"] // (spec["tp"] * spec["cp"])
                assert outcome.step.mtp_tokens == tuple(replicas * t for t in reference.step.mtp_tokens), name
            elif missing == {parity.MTP_MOE_ROUTER}:
                assert max_mtp > 10 * EXACT and max_rest > EXACT, (name, variant, max_mtp, max_rest)
                assert outcome.step.mtp_losses == pytest.approx(reference.step.mtp_losses, rel=LOSS), (name, variant)
                assert max(row["layout_reference"].compare(outcome)[:2]) <= EXACT, (name, variant)
            else:
                assert max_mtp > DIFFERS, (name, variant, max_mtp)
    return len(table)


def test_table_runs_expert_parallelism_on_the_moe_models_and_the_aux_loss_on_bshd():
    for parallelism in ("EP2", "TP2xEP2+SP"):
        assert {case.model for case in parity.table_cases(parallelism, parity.MODELS)} == set(parity.MOE_MODELS)
    aux = [case for case in parity.table_cases("TP1", parity.MODELS) if case.model in parity.AUX_LOSS_MODELS]
    assert aux and {case.layout for case in aux} == {"bshd"}
    assert [case.mtp_moe_flag for case in parity.reference_cases(["zoo, aux loss"])] == [True, False]
    with pytest.raises(ValueError, match="mtp_moe_flag=True needs a model with MoE layers"):
        parity.Case("hybrid", "bshd", mtp_moe_flag=True)


@pytest.mark.parametrize("name", LAYOUTS)
def test_zoo_rows_equal_the_per_sequence_reference(request, name):
    """The zoo's parity rows at this layout (BSHD, THD padded / unpadded with aux coefficient 0; BSHD
    with the aux loss): see the module docstring."""
    table = request.getfixturevalue(name)["table"]
    assert check_rows(table) == len(parity.LAYOUTS) + 1
    assert {parallelism for _, _, parallelism in table} == {PARALLELISM[name]}


@pytest.mark.slow
def test_zoo_rows_under_context_parallelism(tp1):
    """CP2 (a fresh pool: stock's packed rolls exchange out of step under CP): the overlay equals the
    reference, stock misses it by mtp-cp-loss-scale (and mtp-packed-roll on the unpadded flavour)."""
    outcomes = parity.run_layout("CP2", parity.table_cases("CP2", DIRECT))
    table = parity.table_rows(tp1["references"], [("CP2", outcome) for outcome in outcomes])
    assert check_rows(table) == len(parity.LAYOUTS) + 1


@pytest.mark.slow
@needs_bridge
def test_bridge_zoo_rows(bridge_tp1, bridge_tp2_ep2):
    """The Bridge-built zoo (its own router: sigmoid, expert bias, sequence aux loss) at TP1 and
    TP2xEP2+SP: the same relations as the direct zoo."""
    assert check_rows(bridge_tp1["table"]) == len(parity.LAYOUTS) + 1
    assert check_rows(bridge_tp2_ep2["table"]) == len(parity.LAYOUTS) + 1


def test_every_ep_size_holds_the_same_experts(tp1, ep2):
    """With CPU initialisation a rank that builds only its own experts gets the first experts' weights
    (and every later layer other draws): EP2 would not be TP1's model. The zoo's experts, built for
    every rank and sliced (`tiny_hybrid.experts_of_every_rank`), are: its rows above are exact."""
    reference = next(o for o in tp1["references"] if o.case.model == "zoo" and o.case.layout == "bshd")
    own_only = ep2["upstream_experts"]
    assert own_only.lm_loss != pytest.approx(reference.step.lm_loss, rel=LOSS)
    assert np.abs(own_only.grads["lm"] - reference.step.grads["lm"]).max() > DIFFERS
    assert max(ep2["table"]["zoo", "bshd", "EP2"]["stock"].compare(reference)[:2]) <= EXACT


# ---------------------------------------------------------------- the alltoall stand-ins


@pytest.mark.parametrize("name", ["ep2", pytest.param("tp2_ep2", marks=pytest.mark.slow)])
def test_alltoall_stand_ins_equal_the_allgather_dispatcher_and_each_is_needed(request, name):
    """The alltoall dispatcher's two CPU stand-ins against the allgather dispatcher, which needs none,
    on the same model and batches (aux loss on): same losses, MTP and rest gradients, router
    gradients, logged aux losses. Without the host stream (token_dispatcher.py:468-469) the
    dispatcher cannot be built; with upstream's maybe_move_tensor_to_cpu (moe_utils.py:1184-1187)
    the split sizes reach gloo's all_to_all_single as tensors."""
    out = request.getfixturevalue(name)["dispatch"]
    for gathered, exchanged in zip(out["allgather"], out["alltoall"]):
        assert exchanged.lm_loss == pytest.approx(gathered.lm_loss, rel=LOSS)
        assert exchanged.mtp_losses == pytest.approx(gathered.mtp_losses, rel=LOSS)
        for part in ("mtp", "lm"):
            assert np.abs(exchanged.grads[part] - gathered.grads[part]).max() <= EXACT, part
        assert exchanged.router_grads.keys() == gathered.router_grads.keys()
        for key, grad in gathered.router_grads.items():
            assert np.abs(exchanged.router_grads[key] - grad).max() <= EXACT, key
        assert exchanged.moe_metrics["load_balancing_loss"] == pytest.approx(
            gathered.moe_metrics["load_balancing_loss"], rel=LOSS)
    assert out["dtoh_stream"] is not None and "CUDA" in out["dtoh_stream"]
    assert out["split_sizes"] is not None and out["split_sizes"].startswith("TypeError: all_to_all_single()")


def test_host_split_sizes_become_numpy_as_device_ones_do_upstream(tp1):
    """moe_utils.maybe_move_tensor_to_cpu(as_numpy=True) leaves a host tensor a tensor; the stand-in
    the dispatcher calls turns it into the numpy array upstream makes of a device tensor, and leaves
    everything else to upstream's function."""
    facts = tp1["build"]["to_host"]
    assert facts["upstream_numpy"] == "torch.Tensor"
    assert facts["stand_in_numpy"] == "numpy.ndarray" and facts["stand_in_values"] == [3, 1]
    assert facts["stand_in_keeps"] and facts["upstream_is_original"]


def uneven_gather():
    """Rank worker (2 ranks, the TP group): ``mappings._gather_along_first_dim`` with split sizes (the
    stand-in, installed) and upstream's, of rank r's ``r + 1`` rows; without split sizes, of 4 rows."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from mtp_overlay.bed.runtime import cpu_shims

    group, rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
    rows = [torch.arange(3 * (r + 1), dtype=torch.float32).view(r + 1, 3) + 100 * r for r in range(2)]
    even = [torch.arange(8, dtype=torch.float32).view(4, 2) * (r + 1) for r in range(2)]
    found = {"gathered": mappings._gather_along_first_dim(rows[rank], group, output_split_sizes=[1, 2]),
             "even": mappings._gather_along_first_dim(even[rank], group), "want": (torch.cat(rows), torch.cat(even))}
    try:
        cpu_shims.original(mappings, "_gather_along_first_dim")(rows[rank], group, output_split_sizes=[1, 2])
        found["upstream"] = None
    except RuntimeError as exc:  # gloo's refusal
        found["upstream"] = str(exc)
    return found


def test_uneven_expert_tp_gather_equals_its_definition_and_is_needed():
    """Expert TP > 1 (verify's default ETP = TP) gathers the tokens routed to a rank's experts with a
    count per rank: the stand-in gives every rank's rows in rank order (NCCL's all_gather of unequal
    tensors); a gather without split sizes stays upstream's; upstream's own uneven gather gloo refuses."""
    for rank in run_ranks_checked(uneven_gather, 2, tp=2, fixes=[]):
        assert rank["gathered"].equal(rank["want"][0]) and rank["even"].equal(rank["want"][1])
        assert "ProcessGroupGloo::allgather: invalid tensor size" in rank["upstream"]


@pytest.mark.gpu
def test_host_stand_in_matches_upstream_on_a_device_tensor():
    """The reference of the host stand-in: upstream's own conversion of a CUDA tensor."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    from mtp_overlay.bed.runtime.cpu_shims import _to_host

    device = torch.tensor([5, 0, 2], device="cuda")
    upstream = moe_utils.maybe_move_tensor_to_cpu(device, as_numpy=True)
    stand_in = _to_host(moe_utils.maybe_move_tensor_to_cpu, device.cpu(), as_numpy=True)
    assert type(stand_in) is type(upstream) and stand_in.dtype == upstream.dtype
    assert stand_in.tolist() == upstream.tolist()


# ---------------------------------------------------------------- the MTP router's aux loss (stock)


def check_aux_doubling(measured):
    """Stock vs flagged by hand: same losses; each MTP router's aux gradient exactly mtp_num_layers x;
    the backbone routers' differ (the MTP aux loss reaches them through the hidden states). Logging
    (router.py:591-592): an MTP MoE layer numbered p in the MTP pattern logs in slot p - 1 on stock
    (a backbone layer's) and in slot p - 1 + num_layers flagged, the flagged one each application's
    loss / mtp_num_layers; so stock's slot p - 1 = flagged's + mtp_num_layers x flagged's MTP slot."""
    stock, flagged = measured[False], measured[True]
    assert stock["flags"] == [False] * len(MTP_MOE) and flagged["flags"] == [True] * len(MTP_MOE)
    assert stock["losses"] == flagged["losses"]
    assert stock["mtp"].keys() == flagged["mtp"].keys() and len(stock["mtp"]) == len(MTP_MOE)
    for name, grad in stock["mtp"].items():
        reference = flagged["mtp"][name]
        assert np.linalg.norm(reference) > 0
        assert np.linalg.norm(grad - DEPTHS * reference) <= 1e-6 * np.linalg.norm(grad), name
    for name, grad in stock["backbone"].items():
        assert np.abs(grad - flagged["backbone"][name]).max() > 0, name
    (metric, slots), = stock["slots"].items()
    fixed = flagged["slots"][metric]
    assert len(slots) == len(fixed) == len(MAIN) + DEPTHS
    mtp_slots = {position + len(MAIN): position for position in MTP_MOE}  # flagged slot -> stock slot
    expected = list(fixed)
    for flagged_slot, stock_slot in mtp_slots.items():
        assert fixed[flagged_slot] > 0 and slots[flagged_slot] == 0
        expected[stock_slot] += DEPTHS * fixed[flagged_slot]
        expected[flagged_slot] = 0.0
    assert slots == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", LAYOUTS)
def test_stock_counts_the_mtp_routers_aux_loss_twice(request, tp1, name):
    """The measurement the MoE-router fix needs, on stock: 2x, and the same gradient at every layout."""
    check_aux_doubling(request.getfixturevalue(name)["aux"])
    stock, at_tp1 = request.getfixturevalue(name)["aux"][False]["mtp"], tp1["aux"][False]["mtp"]
    for key, grad in at_tp1.items():
        assert np.abs(stock[key] - grad).max() <= EXACT


@pytest.mark.slow
@needs_bridge
def test_stock_counts_the_bridge_zoos_mtp_router_aux_loss_twice(bridge_tp1, bridge_tp2_ep2):
    """The same on the Bridge-built zoo (sequence aux loss, sigmoid router with expert bias)."""
    check_aux_doubling(bridge_tp1["bridge_aux"])
    check_aux_doubling(bridge_tp2_ep2["bridge_aux"])
