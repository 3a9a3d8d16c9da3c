"""Megatron's own training step on every model x layout x parallelism, stock and with the overlay.

One case is one `megatron_step.MegatronStep` step (DDP, ``get_forward_backward_func``,
``finalize_model_grads``; gradients only) of a built model on one microbatch, with exactly the
overlay fixes it names installed. `run_cases` runs a list of cases on the ranks of one spawned pool
(models are built once per pool and reused); `parity_table` runs every layout's cases, each in its
own `RankPool`, and compares them with the references of a TP1 pool.

Models (``MODELS``): the tiny GPTModel, the tiny HybridModel, that HybridModel built with
``scatter_embedding_sequence_parallel=False`` (Nemotron VL/Omni's setting: mtp-sp-scatter), and,
with megatron-bridge installed, a NemotronH HybridModel built by Bridge's provider (the same
setting); and the zoo model (``tiny_hybrid.build_zoo``: attention, MoE and MLP layers, the Super
recipe's MTP ``"*E"`` at 2 depths with one repeated layer, alltoall dispatcher) built directly and
by Bridge's NemotronH provider (its own router: sigmoid, expert bias, sequence aux loss; a shared
expert).

The zoo rows run with the MoE aux-loss coefficient 0: the load-balancing loss is a function of the
whole microbatch's routing (padding included), not a sum over sequences, so a per-sequence
reference exists only without it (routing itself is per token, nothing dropped). The ``aux loss``
zoo rows keep it (`AUX_LOSS_COEFF`) on the full-length BSHD batch only, with two references at TP1
on the same batch: the model with ``is_mtp_layer`` set by hand on its MTP block's MoE layers
(`moe.flag_mtp_moe_layers`: what upstream means, Megatron-LM PR #6748), which stock misses by the
defect mtp-moe-router fixes (the repeated MTP layer's aux loss trained once per depth), and stock
itself (the layout check: every parallelism must give TP1's gradients, the defect included). The
expert-parallel layouts (EP2, TP2xEP2+SP with expert tensor parallel size 1, as Nemotron 3 Super
trains) run the MoE models only.

Layouts (``LAYOUTS``): BSHD (``make_batch``, 2 x 32), and one packed THD row of four sequences in
NeMo-RL's two ``PackedSeqParams`` flavours, "padded" (``cu_seqlens_q`` padded) and "unpadded"
(``cu_seqlens_q`` real, ``cu_seqlens_q_padded`` padded: NeMo-RL PR #3494's
``model_slices_context_parallel_inputs`` path). Every case is an RL forward (``labels=None``) with a
response-only loss mask, the per-token 3-output loss (``calculate_per_token_loss=True``, where
upstream's own LM normalisation is exact under CP). References: BSHD at TP1 for BSHD; for packed
rows each sequence alone, unpacked, at TP1 (``PackedRow.reference_microbatch``), through the same
step. Pipeline-parallel rows (``PIPELINED``: the tiny models only) run Megatron's pipelined schedule
on stage models that hold the TP1 weights (`pipeline.build_stage`; HybridModel's pattern split by
``|``, MTP on the last stage).
"""

import contextlib
import dataclasses

from ..steps.megatron_step import relative_error
from ..models.bridge import own_attention_backend
from ..models.tiny_hybrid import ZOO_PATTERN

# the packed row: four sequences (lengths drawn in [3, 15], seeded: 9, 12, 6, 4) and their prompts
LENGTH_RANGE, LENGTH_SEED = (3, 15), 1
PROMPTS = (2, 0, 3, 1)
FLAVOURS = ("padded", "unpadded")
LAYOUTS = ("bshd",) + FLAVOURS
MODELS = ("gpt", "hybrid", "hybrid, scatter=False", "bridge nemotron_h, scatter=False",
          "zoo", "zoo, aux loss", "bridge zoo", "bridge zoo, aux loss")
BRIDGE_KINDS = {"bridge nemotron_h, scatter=False": "nemotron_h", "bridge zoo": "nemotron_h_zoo",
                "bridge zoo, aux loss": "nemotron_h_zoo"}  # bed.models.bridge kinds
BRIDGE_MODELS = tuple(model for model in MODELS if model in BRIDGE_KINDS)
NOT_SCATTERING = tuple(model for model in MODELS if model.endswith("scatter=False"))
MOE_MODELS = tuple(model for model in MODELS if "zoo" in model)
AUX_LOSS_MODELS = tuple(model for model in MODELS if model.endswith("aux loss"))
AUX_LOSS_COEFF = 0.1  # the aux-loss rows' MoE load-balancing coefficient: their defect shows well above float noise
# the fixes the cases name
LOSS_MASK = "mtp-loss-mask"
PACKED_ROLL = "mtp-packed-roll"
CP_LOSS_SCALE = "mtp-cp-loss-scale"
SP_SCATTER = "mtp-sp-scatter"
LOGPROB_SKIP = "mtp-logprob-skip"
# MTP defects the table's rows meet that no overlay fix covers yet, by the id their fix would take:
# id -> what is wrong. A defect whose id is a registered megatron-core fix is no longer open
# (`open_defects`): the overlay rows then must equal their reference.
MTP_MOE_ROUTER = "mtp-moe-router"
OPEN_DEFECTS = {
    MTP_MOE_ROUTER: (
        "the MTP block's MoE layers are built without is_mtp_layer (megatron-core 0.17-0.19.x "
        "models/hybrid/hybrid_block.py:183-191; Megatron-LM PR #6748): the repeated MTP layer's "
        "load-balancing loss counts once per depth (x2 here, router.py:575-581) and logs in a backbone slot"
    ),
}
# world size, TP, CP, sequence parallelism, and the per-sequence padding multiple NeMo-RL uses
# (2*CP*TP under CP, TP under SP); at TP1 none is needed: 4 makes the two flavours differ
PARALLELISMS = {
    "TP1": dict(world_size=1, tp=1, cp=1, sp=False, pad_multiple=4),
    "CP2": dict(world_size=2, tp=1, cp=2, sp=False, pad_multiple=4),
    "TP2+SP": dict(world_size=2, tp=2, cp=1, sp=True, pad_multiple=2),
    "TP2xCP2+SP": dict(world_size=4, tp=2, cp=2, sp=True, pad_multiple=8),
    # expert parallelism (MoE models only): EP2 alone (data parallel for the rest), and TP2 x EP2 on
    # the same two ranks with expert tensor parallel size 1 (Nemotron 3 Super's TP8 x EP16, ETP1)
    "EP2": dict(world_size=2, tp=1, cp=1, ep=2, sp=False, pad_multiple=4),
    "TP2xEP2+SP": dict(world_size=2, tp=2, cp=1, ep=2, etp=1, sp=True, pad_multiple=2),
}
# pipeline stages: two, through forward_backward_pipelining_without_interleaving
PARALLELISMS.update({
    "PP2": dict(world_size=2, tp=1, cp=1, pp=2, sp=False, pad_multiple=4),
    "TP2xPP2+SP": dict(world_size=4, tp=2, cp=1, pp=2, sp=True, pad_multiple=2),
})
PIPELINED = ("gpt", "hybrid", "hybrid, scatter=False")  # the models the test bed builds in stages
PIPELINED_PATTERN = "*-|*-/*-"  # the tiny HybridModel's "*-*-/*-", one stage per '|' segment
LOSSES = {  # MegatronStep.step arguments of the per-token loss modes
    "3-output": dict(loss="3-output"),
    "nemo-rl": dict(loss="nemo-rl", mtp_grad_scale="global-valid-tokens"),
}


# fixes whose hooks act while the model is built (mtp-moe-router flags the MTP block's MoE layers
# as MultiTokenPredictionLayer builds them): a case's model is built with those of its fixes installed
BUILT_WITH = (MTP_MOE_ROUTER,)

# modules of multimodal wrappers around a language model (LLaVAModel, MimoModel): no parity model is one
MULTIMODAL_WRAPPERS = ("megatron.core.models.multimodal.", "megatron.core.models.mimo.")
# fixes that act only in forwards that cannot train (no grad): a training step is bit-identical with
# them on and off (tests/fixes/mtp_logprob_skip/ proves it with every fix installed)
OUTSIDE_TRAINING = (LOGPROB_SKIP,)


def megatron_core_fixes():
    """The overlay's megatron-core fixes of the language model's path: every fix whose targets are
    megatron-core modules, but those that target multimodal wrappers only (mtp-multimodal), which
    change nothing for the parity models (tests/fixes/mtp_multimodal/ measures that fix), and those
    `OUTSIDE_TRAINING`, which change nothing in a training step."""
    from ... import registry

    return tuple(name for name, targets in registry.FIXES if all(t.startswith("megatron.core") for t in targets)
                 and not all(t.startswith(MULTIMODAL_WRAPPERS) for t in targets) and name not in OUTSIDE_TRAINING)


@dataclasses.dataclass(frozen=True)
class Case:
    """One step. model: one of MODELS; layout: one of LAYOUTS, or "reference" (each sequence of the
    packed row alone, BSHD); pad_multiple: the packed row's per-sequence padding; fixes: installed
    for this case only; loss: a key of LOSSES; mtp_mask: MegatronStep's route for the MTP mask
    ("explicit" or "scoped"); wrapper: the model inside ``packed.SelfSlicingCP`` (full rows in);
    mtp_moe_flag: ``is_mtp_layer`` set by hand on the MTP block's MoE layers (`moe.flag_mtp_moe_layers`,
    MoE models only)."""

    model: str
    layout: str
    sequence_parallel: bool = False
    pad_multiple: int = 1
    fixes: tuple = ()
    loss: str = "3-output"
    mtp_mask: str = "explicit"
    wrapper: bool = False
    mtp_moe_flag: bool = False

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.mtp_moe_flag and self.model not in MOE_MODELS:
            raise ValueError(f"mtp_moe_flag=True needs a model with MoE layers {MOE_MODELS}, got {self.model!r}")
        if self.layout not in LAYOUTS + ("reference",):
            raise ValueError(f"layout must be one of {LAYOUTS + ('reference',)}, got {self.layout!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {tuple(LOSSES)}, got {self.loss!r}")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A case's `MegatronStepResult` (``step``) or the error its step raised (``"Type: message"``)."""

    case: Case
    step: object = None
    error: str | None = None

    def compare(self, reference):
        """(max |Δgrad| MTP block, max |Δgrad| rest, relerr MTP, relerr rest) against ``reference``."""
        import numpy

        deltas = [float(numpy.abs(self.step.grads[part].astype(numpy.float64) - reference.step.grads[part]).max())
                  for part in ("mtp", "lm")]
        return (*deltas, *(relative_error(self.step.grads[part], reference.step.grads[part]) for part in ("mtp", "lm")))


def lengths():
    from ..models.packed import random_lengths

    return random_lengths(len(PROMPTS), *LENGTH_RANGE, seed=LENGTH_SEED)


def packed_row(pad_multiple, flavour="padded"):
    """The packed row of the table (`packed.make_packed_row`)."""
    from ..models.packed import make_packed_row

    return make_packed_row(lengths(), pad_multiple=pad_multiple, flavour=flavour, prompts=PROMPTS)


def microbatch(case):
    """The case's full-length RL microbatch (``labels=False`` convention of MegatronStep)."""
    from ..fixes.mtp_cp_loss_scale import microbatch as bshd_microbatch

    if case.layout == "bshd":  # loss mask zero over the first 40% of each sequence
        return bshd_microbatch("uneven", labels=False)
    if case.layout == "reference":
        return packed_row(1).reference_microbatch(labels=False)
    return packed_row(case.pad_multiple, case.layout).microbatch(labels=False)


def build(model, *, sequence_parallel=False, seed=1234, mtp_moe_flag=False, **overrides):
    """A per-token-loss model of MODELS for this rank (TP/CP/EP/PP from parallel_state; under PP its
    stage); with ``mtp_moe_flag`` its MTP block's MoE layers flagged by hand (`moe.flag_mtp_moe_layers`);
    ``overrides`` go to the test bed's builder (e.g. ``mtp_num_layers=2`` for "gpt")."""
    from ..models import pipeline
    from ..models.tiny_gpt import build_tiny_gpt
    from ..models.tiny_hybrid import build_tiny_hybrid, build_zoo
    from ..steps.moe import flag_mtp_moe_layers

    settings = dict(scatter_embedding_sequence_parallel=model not in NOT_SCATTERING)
    moe = dict(moe_aux_loss_coeff=AUX_LOSS_COEFF if model in AUX_LOSS_MODELS else 0.0) if model in MOE_MODELS else {}
    if model in BRIDGE_MODELS:
        from ..models.bridge import build_bridge_model

        with own_attention_backend():
            built = build_bridge_model(BRIDGE_KINDS[model], seed=seed, sequence_parallel=sequence_parallel, recipe=moe,
                                       **settings)
        built.config.calculate_per_token_loss = True  # read at DDP's construction and in every step
    else:
        builder = {"gpt": build_tiny_gpt}.get(model, build_zoo if model in MOE_MODELS else build_tiny_hybrid)
        if pipeline.size() > 1 and builder is build_tiny_hybrid:
            settings["hybrid_layer_pattern"] = PIPELINED_PATTERN
        built = builder(seed=seed, sequence_parallel=sequence_parallel, calculate_per_token_loss=True, **settings,
                        **moe, **overrides)
    if mtp_moe_flag:
        flag_mtp_moe_layers(built)
    return built


def run_cases(cases):
    """Rank worker: every case in order; on global rank 0 a list of Outcomes (None elsewhere).

    Each (model, sequence parallelism, wrapper, MTP MoE flag, build-time fixes) is built and wrapped
    in MegatronStep once: by stock megatron-core, with only the case's fixes of `BUILT_WITH` installed
    (their hooks act on the build); every step starts from the built buffers (``finalize_model_grads``
    moves a router's expert bias each step). A case's step installs exactly its fixes (stock
    megatron-core otherwise). A step that raises is recorded with its error: every rank fails at the
    same point (shape checks, layout refusals), so the next case starts in step.
    """
    import torch

    import mtp_overlay

    from ..steps.megatron_step import MegatronStep
    from ..models.packed import SelfSlicingCP

    steps, buffers, outcomes = {}, {}, []
    for case in cases:
        built_with = [fix for fix in case.fixes if fix in BUILT_WITH]
        key = (case.model, case.sequence_parallel, case.wrapper, case.mtp_moe_flag, tuple(built_with))
        if key not in steps:
            mtp_overlay.uninstall()  # stock megatron-core, but for the build-time fixes of the case
            mtp_overlay.install(only=built_with)
            model = build(case.model, sequence_parallel=case.sequence_parallel, mtp_moe_flag=case.mtp_moe_flag)
            steps[key] = MegatronStep(SelfSlicingCP(model) if case.wrapper else model, optimizer=None)
            buffers[key] = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
        step, error = run_step(steps[key], buffers[key], microbatch(case), case.fixes, labels=False,
                               mtp_mask=case.mtp_mask, **LOSSES[case.loss])
        outcomes.append(Outcome(case, step=step, error=error))
    mtp_overlay.uninstall()
    return outcomes if torch.distributed.get_rank() == 0 else None


def run_step(step, buffers, batch, fixes, **options):
    """One case on a built model: its buffers back to their built values, exactly ``fixes`` installed
    (stock megatron-core for none), one ``step.step([batch], update=False, **options)``; (the
    MegatronStepResult, None), or (None, "Type: message") when the step raised: every rank fails at
    the same point (shape checks, layout refusals), so the next case starts in step. The core of
    `run_cases` and of ``mtp-overlay verify``'s engine (`verify.run_cases`)."""
    import torch

    import mtp_overlay

    with torch.no_grad():
        for buffer, built in buffers:
            buffer.copy_(built)
    mtp_overlay.uninstall()
    mtp_overlay.install(only=list(fixes))
    try:
        return step.step([batch], update=False, **options), None
    except Exception as error:  # noqa: BLE001 - a stock crash or a refusal is a result
        return None, f"{type(error).__name__}: {error}"


def run_layout(parallelism, cases, *, timeout=900, log=None):
    """``run_cases(cases)`` on a fresh RankPool of ``parallelism`` (a key of PARALLELISMS)."""
    from ..runtime.launcher import RankPool

    spec = PARALLELISMS[parallelism]
    layout = dict(tp=spec["tp"], cp=spec["cp"], pp=spec.get("pp", 1), ep=spec.get("ep", 1), etp=spec.get("etp"))
    with RankPool(spec["world_size"], **layout, log=log) as pool:
        return pool.run_checked(run_cases, args=(cases,), fixes=[], timeout=timeout)[0]


def model_layouts(model):
    """The layouts a model's rows run: all, or BSHD alone with the aux loss on (module docstring)."""
    return ("bshd",) if model in AUX_LOSS_MODELS else LAYOUTS


def table_cases(parallelism, models):
    """The parity table's cases for one parallelism: every model and its layouts, stock and overlay
    (the scatter=False tiny HybridModel only under sequence parallelism: elsewhere it is its twin;
    under expert parallelism the MoE models only, under pipeline parallelism the PIPELINED ones)."""
    spec, fixes = PARALLELISMS[parallelism], megatron_core_fixes()
    cases = []
    for model in models:
        if model in NOT_SCATTERING and model not in BRIDGE_MODELS and not spec["sp"]:
            continue
        if spec.get("ep", 1) > 1 and model not in MOE_MODELS:
            continue
        if spec.get("pp", 1) > 1 and model not in PIPELINED:
            continue
        for layout in model_layouts(model):
            for variant in ((), fixes):
                cases.append(Case(model, layout, spec["sp"], spec["pad_multiple"], variant))
    return cases


def reference_cases(models):
    """TP1, stock: BSHD and each sequence alone, per model (scatter=False models share their twin's
    weights: the setting changes nothing without sequence parallelism); for an aux-loss model BSHD
    with its MTP MoE layers flagged by hand (the reference), then stock BSHD (the layout reference)."""
    cases = []
    for model in models:
        if model in AUX_LOSS_MODELS:
            cases += [Case(model, "bshd", mtp_moe_flag=True), Case(model, "bshd")]
        else:
            cases += [Case(model, layout) for layout in ("bshd", "reference")]
    return cases


def reference_key(case):
    """The key of `parity_table`'s references a case's row compares with."""
    return case.model, "bshd" if case.layout == "bshd" else "reference", case.model in AUX_LOSS_MODELS


def open_defects(model):
    """The ids of `OPEN_DEFECTS` that keep ``model``'s overlay rows off their reference: those its rows
    meet (the MTP MoE router's with the aux loss on) that no registered fix covers."""
    met = (MTP_MOE_ROUTER,) if model in AUX_LOSS_MODELS else ()
    return tuple(defect for defect in met if defect in OPEN_DEFECTS and defect not in megatron_core_fixes())


COMPOSED_MOE = "zoo, aux loss"  # the composition's MoE model (`composition_cases`)


def composition_cases(parallelism):
    """The real path with the fixes composed: HybridModel, the unpadded packed row (real ``cu_seqlens_q``,
    padded ``cu_seqlens_q_padded``), RL forward, response-only mask, at one parallelism.

    Per model (under sequence parallelism also the ``scatter=False`` HybridModel): with the mask
    scoped (``mtp_overlay.mtp.loss_mask_scope``: mtp-loss-mask's route) stock, each fix alone, all
    but one, all; with the mask passed explicitly stock, mtp-packed-roll and mtp-cp-loss-scale alone
    and together (with mtp-sp-scatter), all; stock and all with NeMo-RL's loss too, and through a
    model that slices CP itself (``SelfSlicingCP``, full rows in). Then the zoo with the MoE aux loss
    on (`COMPOSED_MOE`: BSHD, the mask passed; its reference the TP1 step with the MTP MoE layers
    flagged by hand): stock, mtp-moe-router alone, all but mtp-moe-router, all but
    mtp-cp-loss-scale, all. Named by `composition_name`.
    """
    spec, everything = PARALLELISMS[parallelism], megatron_core_fixes()
    models = ("hybrid",) + (("hybrid, scatter=False",) if spec["sp"] else ())
    scoped = [()] + [(fix,) for fix in everything] + [tuple(f for f in everything if f != fix) for fix in everything]
    explicit = [(), (PACKED_ROLL,), (CP_LOSS_SCALE,), (SP_SCATTER, PACKED_ROLL, CP_LOSS_SCALE)]
    base = dict(layout="unpadded", sequence_parallel=spec["sp"], pad_multiple=spec["pad_multiple"])
    cases = []
    for model in models:
        for route, fix_sets in (("scoped", scoped + [everything]), ("explicit", explicit + [everything])):
            for fixes in fix_sets:
                cases.append(Case(model, fixes=fixes, mtp_mask=route, **base))
        for route in ("scoped", "explicit"):
            for fixes in ((), everything):
                cases.append(Case(model, fixes=fixes, mtp_mask=route, loss="nemo-rl", **base))
        for fixes in ((), everything):
            cases.append(Case(model, fixes=fixes, wrapper=True, **base))
    but = [tuple(f for f in everything if f != fix) for fix in (MTP_MOE_ROUTER, CP_LOSS_SCALE)]
    for fixes in [(), (MTP_MOE_ROUTER,)] + but + [everything]:
        cases.append(Case(COMPOSED_MOE, "bshd", spec["sp"], spec["pad_multiple"], fixes))
    return cases


def composition_name(case):
    """``"<model> <route>[ wrapper] <loss>: <fixes>"``, the fixes as "stock", "all", "all but X" or their ids."""
    everything = megatron_core_fixes()
    if not case.fixes:
        fixes = "stock"
    elif set(case.fixes) == set(everything):
        fixes = "all"
    elif len(case.fixes) == len(everything) - 1:
        fixes = "all but " + next(fix for fix in everything if fix not in case.fixes)
    else:
        fixes = " + ".join(case.fixes)
    route = case.mtp_mask + (" wrapper" if case.wrapper else "")
    return f"{case.model} {route} {case.loss}: {fixes}"


def composition_references():
    """TP1, stock: each sequence of the packed row alone, HybridModel, both per-token losses; the
    composition's MoE model on BSHD with its MTP MoE layers flagged by hand."""
    return [Case("hybrid", "reference", loss=loss) for loss in LOSSES] + [Case(COMPOSED_MOE, "bshd", mtp_moe_flag=True)]


def composition_reference_key(case):
    """The key of `run_composition`'s references a composition case compares with: (model, loss)."""
    return (case.model if case.model in AUX_LOSS_MODELS else "hybrid"), case.loss


def needed_fixes(case, parallelism):
    """The fixes this composition case's path needs to train like the reference, and why."""
    spec, needs = PARALLELISMS[parallelism], {}
    if case.layout == "unpadded":
        needs[PACKED_ROLL] = "cu_seqlens_q holds the real boundaries of a padded layout"
    if case.model in AUX_LOSS_MODELS:
        needs[MTP_MOE_ROUTER] = "the MTP block's MoE router trains its aux loss once per MTP depth"
    if case.model in NOT_SCATTERING and spec["sp"]:
        needs[SP_SCATTER] = "the embedding does not scatter to the sequence-parallel region"
    if case.mtp_mask == "scoped":
        needs[LOSS_MASK] = "the mask is scoped, not passed"
    if spec["cp"] > 1:
        needs[CP_LOSS_SCALE] = "each CP rank normalises its MTP loss by its own counts"
    return needs


def expected_outcome(case, parallelism):
    """What the composition case must give: "exact" (equals the reference), "differs", "refused" (the
    mtp-loss-mask hook refuses the unpadded flavour without mtp-packed-roll) or "crash" (the stock
    MTP concat of a model that does not scatter its embedding under SP)."""
    missing = set(needed_fixes(case, parallelism)) - set(case.fixes)
    if case.layout == "unpadded" and LOSS_MASK in case.fixes and PACKED_ROLL not in case.fixes:
        return "refused"
    if SP_SCATTER in missing:
        return "crash"
    return "differs" if missing else "exact"


def run_composition(parallelisms=("TP1", "CP2", "TP2xCP2+SP"), log=None):
    """{`composition_reference_key`: reference Outcome}, {parallelism: [Outcome]}: the references and
    composition cases at TP1 (one pool), then each other parallelism in its own pool."""
    count = len(composition_references())
    first = run_layout("TP1", composition_references() + composition_cases("TP1"), log=log)
    references = {composition_reference_key(o.case): o for o in first[:count]}
    outcomes = {"TP1": first[count:]}
    for parallelism in parallelisms:
        if parallelism != "TP1":
            outcomes[parallelism] = run_layout(parallelism, composition_cases(parallelism), log=log)
    return references, {p: outcomes[p] for p in parallelisms}


def composition_markdown(references, outcomes):
    """One row per composition case, one column per parallelism: the MTP-block and rest-of-model
    gradient relerr against the reference, or the refusal / crash (n/a: the scatter=False model
    runs under sequence parallelism only)."""
    parallelisms = list(outcomes)
    cells = {}
    for parallelism, results in outcomes.items():
        for outcome in results:
            name = composition_name(outcome.case)
            if outcome.error is not None and PACKED_ROLL in outcome.error:
                cell = "refused (mtp-loss-mask: needs mtp-packed-roll)"
            elif outcome.error is not None:
                cell = _error(outcome.error, 40)
            else:
                *_, mtp, rest = outcome.compare(references[composition_reference_key(outcome.case)])
                cell = f"{mtp:.2g} / {rest:.2g}"
            cells.setdefault(name, {})[parallelism] = cell
    lines = ["| case (RL; HybridModel: THD unpadded, zoo: BSHD) | " + " | ".join(parallelisms) + " |",
             "|" + " --- |" * (len(parallelisms) + 1)]
    for name, row in cells.items():
        lines.append(f"| {name} | " + " | ".join(row.get(p, "n/a") for p in parallelisms) + " |")
    return "\n".join(lines)


def parity_table(models=None, parallelisms=tuple(PARALLELISMS), log=None):
    """Run the TP1 reference pool and one pool per parallelism; ``{(model, layout, parallelism): row}``
    in table order, each row a dict of Outcomes: ``reference``, ``stock``, ``overlay``, and for the
    aux-loss models ``layout_reference`` (TP1 stock on the same batch)."""
    models = tuple(models or (model for model in MODELS if model not in BRIDGE_MODELS))
    first = reference_cases(models)
    results = run_layout("TP1", first + (table_cases("TP1", models) if "TP1" in parallelisms else []), log=log)
    references, outcomes = results[: len(first)], [("TP1", outcome) for outcome in results[len(first):]]
    for parallelism in parallelisms:
        if parallelism != "TP1":
            results = run_layout(parallelism, table_cases(parallelism, models), log=log)
            outcomes += [(parallelism, outcome) for outcome in results]
    return table_rows(references, outcomes)


def table_rows(references, outcomes):
    """``{(model, layout, parallelism): row}`` in table order (`parity_table`) from the Outcomes of
    `reference_cases` and ``[(parallelism, Outcome of table_cases)]``."""
    by_key = {(o.case.model, o.case.layout, o.case.mtp_moe_flag): o for o in references}
    rows = {}
    for parallelism, outcome in outcomes:
        case = outcome.case
        row = rows.setdefault((case.model, case.layout, parallelism), dict(reference=by_key[reference_key(case)]))
        if case.model in AUX_LOSS_MODELS:
            row["layout_reference"] = by_key[case.model, "bshd", False]
        row["overlay" if case.fixes else "stock"] = outcome
    order = {name: index for index, name in enumerate(MODELS + LAYOUTS + tuple(PARALLELISMS))}
    return dict(sorted(rows.items(), key=lambda item: tuple(order[part] for part in item[0])))


def row_needs(model, layout, parallelism):
    """The fixes a table row's stock path lacks to equal its reference: mtp-packed-roll on the unpadded
    flavour (real ``cu_seqlens_q``), mtp-cp-loss-scale under CP, mtp-sp-scatter for a model that does
    not scatter its embedding under sequence parallelism, and the MTP MoE router's (`MTP_MOE_ROUTER`,
    still open: `open_defects`) with the aux loss on."""
    spec = PARALLELISMS[parallelism]
    needs = {MTP_MOE_ROUTER} if model in AUX_LOSS_MODELS else set()
    if layout == "unpadded":
        needs.add(PACKED_ROLL)
    if spec["cp"] > 1:
        needs.add(CP_LOSS_SCALE)
    if model in NOT_SCATTERING and spec["sp"]:
        needs.add(SP_SCATTER)
    return needs


def markdown(rows):
    """The parity table in markdown; rows that a note qualifies (`row_note`) say so in its last column."""
    head = ("| model | layout | parallelism | reference LM / MTP loss | stock LM / MTP loss "
            "| stock max \\|Δgrad\\| MTP / rest | overlay LM / MTP loss | overlay max \\|Δgrad\\| MTP / rest | note |")
    lines = [head, "|" + " --- |" * 9]
    for (model, layout, parallelism), row in rows.items():
        reference = row["reference"]
        cells = [model, LAYOUT_NAMES[layout], parallelism, _losses(reference)]
        for variant in ("stock", "overlay"):
            outcome = row[variant]
            if outcome.error is not None:
                cells += [_error(outcome.error), ""]
            else:
                mtp, rest, *_ = outcome.compare(reference)
                cells += [_losses(outcome), f"{_delta(mtp)} / {_delta(rest)}"]
        lines.append("| " + " | ".join(cells + [row_note(model, row)]) + " |")
    return "\n".join(lines)


def row_note(model, row):
    """What a row's comparison means when it is not "overlay equals the reference": the open defects
    (`OPEN_DEFECTS`) the overlay row carries and, for the aux-loss rows, the layout check: the max
    |Δgrad| (MTP / rest) against TP1 stock on the same batch of the overlay while a defect is open,
    else of stock (which misses the reference by the defect its fix cures)."""
    defects = open_defects(model)
    notes = [f"open: {defect}" for defect in defects]
    variant = "overlay" if defects else "stock"
    outcome, layout_reference = row.get(variant), row.get("layout_reference")
    if layout_reference is not None and outcome is not None and outcome.error is None:
        mtp, rest, *_ = outcome.compare(layout_reference)
        notes.append(f"{variant} vs TP1 stock {_delta(mtp)} / {_delta(rest)}")
    return "; ".join(notes)


def notes_markdown(rows):
    """What the zoo rows are and which comparisons hold, for below the table (empty without zoo rows)."""
    models = {model for model, _, _ in rows}
    lines = []
    if models & set(MOE_MODELS):
        lines.append(
            f"zoo: the tiny HybridModel `{ZOO_PATTERN}` (Mamba, attention, MoE, MLP; the Super recipe's MTP `*E` "
            "at 2 depths, one repeated layer; 4 experts, top-2, alltoall), bridge zoo: the same layers built by "
            "Megatron-Bridge's NemotronH provider (its router: sigmoid, expert bias, sequence aux loss; a shared "
            "expert). Their MoE aux-loss coefficient is 0: the load-balancing loss is a function of the whole "
            "microbatch's routing, so only without it does a per-sequence reference exist."
        )
    if models & set(AUX_LOSS_MODELS):
        if any(open_defects(model) for model in models):
            missed = ("Stock and overlay miss it by the open defect; 'vs TP1 stock' is the layout check (every "
                      "parallelism gives TP1's gradients, the defect included)")
        else:
            missed = (f"Stock misses it by {MTP_MOE_ROUTER} (the MTP router's aux loss trained once per depth), the "
                      "overlay equals it; 'stock vs TP1 stock' is the layout check (stock gives TP1 stock's gradients "
                      "at every parallelism, the defect included; under CP it also lacks mtp-cp-loss-scale)")
        lines.append(
            f"aux loss: coefficient {AUX_LOSS_COEFF}, BSHD only; reference: TP1 on the same batch with is_mtp_layer "
            f"set by hand on the MTP block's MoE layers (upstream's intent). {missed}."
        )
    for defect in sorted({defect for model in models for defect in open_defects(model)}):
        lines.append(f"open {defect}: {OPEN_DEFECTS[defect]}.")
    return "\n".join(lines)



LAYOUT_NAMES = {"bshd": "BSHD", "padded": "THD padded", "unpadded": "THD unpadded"}


def _losses(outcome):
    step = outcome.step
    return f"{step.lm_loss:.5f} / {step.mtp_loss:.5f}"


def _delta(value):
    return "0" if value == 0 else f"{value:.1e}"


def _error(text, width=60):
    first = text.splitlines()[0]
    kind = "refused" if first.startswith("ValueError") else "crash"
    return f"{kind}: {first[: width] + '…' if len(first) > width else first}"
