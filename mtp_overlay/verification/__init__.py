"""``mtp_overlay.verify``: prove on a CPU that *your* config and layout train the MTP head on the right
tokens with the right weight, stock and with the overlay.

The user's model (a Hugging Face config, or a Megatron-Bridge provider / recipe by module path) is
shrunk to CPU size keeping its shape (`shrink`), a sample of their data's lengths and prompt lengths
is shrunk alike and given distinct token ids (`data`), and the test bed's engine
(``mtp_overlay.bed.engines.verify``, run as a child process: `engine`) builds it with Megatron-Bridge's
provider on gloo ranks and runs Megatron's own training step: each sequence alone, unpacked, at TP1
(the numeric reference), then the asked layout and packing stock, with the overlay's megatron-core
fixes, and with all of them but one, in turn. The judge (`report`) holds every step to the numbers of
the reference and to the positions of the oracle (`oracle`: which (position, target) pairs each MTP
depth may train, from the tokens and the mask alone), names the fixes the config needs with the
case that shows why, and marks a difference the overlay leaves as a possible new defect with the
smallest layout that still shows it (the engine reruns the overlay on each smaller layout).

A Nemotron VL / Omni config (its language model in ``llm_config``, or a Bridge VL / Omni provider) is
shrunk by `vision` (the language model as any; the RADIO vision tower replaced by a tiny CLIP ViT, the
image token kept on its side of the vocabulary) and run with images in the microbatches: Bridge's own
provider builds megatron-core's LLaVAModel, each step is an SFT step of BSHD rows, the numeric
reference is the language model run directly on the hand-built combined ids and mask (the test bed's
``CombinedIdsReference``, TP1, stock) and the positions are the combined slots the oracle derives from
the tokens, the prompt and the image placeholders.

Not run, and said so in the report: layouts above ``max_ranks`` processes (the largest smaller layout
that fits runs instead); a VL / Omni config's sound encoder (no sound clips). Data-parallel ranks get
the same microbatch.
"""

from __future__ import annotations

import os
import time

from . import data as _data
from . import inputs
from . import report as _report
from .layout import Layout
from .plan import LOSSES
from .report import Report
from .shrink import ConfigError, Shrunk, shrink
from .vision import is_multimodal, shrink_multimodal, shrink_provider_multimodal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from .engine import Engine
    from .plan import Answer, CaseAnswer, HfConfigModel, Job, Plan, ProviderModel

__all__ = ["PACKINGS", "LOSSES", "MASKS", "Layout", "Report", "verify"]

PACKINGS = ("none", "thd-padded", "thd-real-lengths")
MASKS = ("passed", "scoped")  # the trainer passes the MTP mask as loss_mask, or scopes it (mtp.loss_mask_scope)
MAX_RANKS = 8
SEED = 1234
# the numeric reference, by whether the model is multimodal
REFERENCES = {False: "TP1, each sequence alone", True: "TP1, the language model on the hand-built combined ids"}


def verify(
    hf_config: str | os.PathLike[str] | None = None,
    *,
    provider: str | None = None,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    pp: int = 1,
    sp: bool = False,
    world_size: int | None = None,
    packing: str | None = None,
    loss: str = "per-token",
    forward: str | None = None,
    mtp_mask: str = "passed",
    mtp_num_layers: int | None = None,
    repeated_layer: bool | None = None,
    scatter_embedding: bool | None = None,
    layers: str = "auto",
    data: str | os.PathLike[str] | None = None,
    pad_multiple: int | None = None,
    tolerance: float = _report.TOLERANCE,
    max_ranks: int = MAX_RANKS,
    search: bool = True,
    log: str | None = None,
    progress: Callable[[str], None] | None = None,
    engine: Engine | None = None,
) -> Report:
    """Verify one config on one layout; the `Report` (``report.ok``, ``report.exit_code``, ``.text()``).

    hf_config: a folder holding ``config.json``, or the file; provider: ``MODULE:NAME`` or
    ``FILE.py:NAME`` (a provider, its class, or a function returning one or a recipe's
    ``ConfigContainer``); exactly one of the two. tp, cp, ep, etp, pp, sp, world_size: the layout
    (`Layout`). packing: one of PACKINGS ("thd-padded": NeMo-RL's default, ``cu_seqlens_q`` padded;
    "thd-real-lengths": real lengths in ``cu_seqlens_q``, the self-slicing path; None: "thd-padded",
    "none" for a VL / Omni model, whose steps are BSHD). loss: one of LOSSES ("per-token":
    ``calculate_per_token_loss``). forward: "rl" (no labels) or "sft" (None: "rl", "sft" for a VL / Omni
    model, whose steps need labels). mtp_mask: one of MASKS. mtp_num_layers, repeated_layer,
    scatter_embedding: overrides of the config's MTP depth, repeated MTP layer and
    ``scatter_embedding_sequence_parallel``. layers: "auto", "all" or "runs" (`shrink`).
    data: a JSONL sample of ``{"tokens": N, "prompt": P}`` lines (``"images": [...]`` too for a VL /
    Omni model: `data`). pad_multiple: the packer's
    per-sequence padding (default NeMo-RL's: 2·CP·TP under CP, TP under SP). tolerance: the largest
    relative error that counts as equal. max_ranks: the most processes to start. search: rerun the
    overlay on smaller layouts when it differs. log: the ranks' output. progress: called with each
    progress line (default: stderr). engine: what runs the test bed (default: `engine.ChildEngine`).

    Raises ValueError naming the argument for bad input and for a config the test bed cannot build;
    RuntimeError when the engine cannot run at all.
    """
    started = time.perf_counter()
    _check_options(packing or PACKINGS[1], loss, forward or "rl", mtp_mask, tolerance, max_ranks)
    if (hf_config is None) == (provider is None):
        raise ValueError("give exactly one of --hf-config (a Hugging Face config) and --provider (a Bridge provider)")
    layout = Layout(tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, sp=sp, world=world_size)
    run_layout, not_run = layout_to_run(layout, max_ranks)

    def shrunk_for(values: dict[str, object], keyspace: str, multimodal: bool) -> tuple[Shrunk, _data.Sample]:
        nonlocal packing, forward
        try:
            if multimodal:
                packing, forward = packing or "none", forward or "sft"
                check_multimodal_options(packing, forward, mtp_mask, layout, scatter_embedding, pad_multiple)
                build = shrink_multimodal if keyspace == "hf" else shrink_provider_multimodal
                made = build(values, layout, mtp_num_layers=mtp_num_layers, repeated_layer=repeated_layer,
                             layers=layers)
                reserved = made.multimodal.reserved if made.multimodal is not None else ()
                return made, _data.sample(data, made.vocab, seed=0, images=True, reserved=reserved)
            packing, forward = packing or PACKINGS[1], forward or "rl"
            made = shrink(values, layout, keyspace=keyspace, mtp_num_layers=mtp_num_layers,
                          repeated_layer=repeated_layer, layers=layers,
                          scatter_embedding_sequence_parallel=scatter_embedding)
        except ConfigError as error:  # which config: the flag and its value
            source = f"--provider {provider}" if hf_config is None else f"--hf-config {os.fspath(hf_config)}"
            raise ConfigError(f"{source}: {error}") from None
        drawn = _data.sample(data, made.vocab, seed=0)
        check_padding(drawn, run_layout, packing, pad_multiple)
        return made, drawn

    shrunk = sample = None
    if hf_config is not None:  # everything checked before a process starts
        values = inputs.read_hf_config(hf_config)
        shrunk, sample = shrunk_for(values, "hf", is_multimodal(values))
        name = inputs.model_name(values, os.fspath(hf_config))
    else:
        name = inputs.check_provider_path(str(provider))
    fixes, phases = megatron_core_fixes(), []
    runner = engine if engine is not None else _child(run_layout.world_size, log, progress)
    try:
        if shrunk is None or sample is None:  # a provider: its fields come from the engine (Bridge imports it)
            described = runner.request({"op": "describe", "model": {"kind": "provider", "path": name}})
            _raise_plan_error(described)
            fields = described.get("fields")
            if not isinstance(fields, dict):
                raise RuntimeError(f"the verify engine described the provider as {described!r}")
            shrunk, sample = shrunk_for(fields, "provider", described.get("family") == "multimodal")
            phases += _startup(described, run_layout.world_size) + [("the provider", _seconds(described))]
        assert packing is not None and forward is not None  # resolved by shrunk_for
        plan = _plan(shrunk, sample, name, loss=loss, forward=forward, mtp_mask=mtp_mask, packing=packing,
                     pad_multiple=pad_multiple)
        first = _request(runner, plan, [["reference", [["reference", []]]]])
        reference_name = REFERENCES[shrunk.multimodal is not None]
        phases += _startup(first, run_layout.world_size) + [(f"reference ({reference_name})", _seconds(first))]
        reference_row = _answers(first)[0]
        built = first.get("built")
        built = dict(built) if isinstance(built, dict) else {}
        per_image = built.get("tokens_per_image") if shrunk.multimodal is not None else None
        if shrunk.multimodal is not None and not isinstance(per_image, int):
            raise RuntimeError(f"the verify engine built a multimodal model without its tokens per image: {built!r}")
        cases = [["stock", []], ["overlay", fixes]] + ablations(fixes)
        second = _request(runner, plan, [[run_layout.as_dict(), cases]])
        phases.append((f"{run_layout.name}: {len(cases)} steps", _seconds(second)))
        depths = shrunk.mtp_depth

        def judged_as(answer: CaseAnswer, where: Layout | None, reference: CaseAnswer | None) -> _report.Case:
            named = dict(answer, layout_name=where.name if where is not None else reference_name)
            return _report.judge_case(named, sample, reference, forward, depths, tolerance,
                                      per_image if isinstance(per_image, int) else None)

        judged = [judged_as(answer, run_layout, reference_row) for answer in _answers(second)]
        searched: list[_report.Case] = []
        smaller = [small for small in run_layout.smaller() if small.world_size <= run_layout.world_size]
        if search and judged[1].differs and smaller:
            found = _request(runner, plan, [[small.as_dict(), [["overlay", fixes]]] for small in smaller])
            phases.append((f"{len(smaller)} smaller layouts", _seconds(found)))
            searched = [judged_as(answer, small, reference_row) for answer, small in zip(_answers(found), smaller)]
    finally:
        if engine is None:
            runner.close()
    phases.append(("total, the child process's start included", round(time.perf_counter() - started, 1)))
    if shrunk.multimodal is not None:
        not_run += list(shrunk.multimodal.not_run)
    return Report(
        model=name, layout=run_layout.name, asked=None if run_layout is layout else layout.name, packing=packing,
        shrunk=shrunk.as_dict(), built=built, sample=sample.as_dict(),
        reference=judged_as(reference_row, None, None),
        stock=judged[0], overlay=judged[1], ablations=tuple(judged[2:]), search=tuple(searched),
        needs=_report.needs(judged[1], judged[2:], symptoms(fixes), required_by(fixes)), not_run=tuple(not_run),
        notes=tuple(notes(run_layout, loss, shrunk, packing, pad_multiple)), phases=tuple(phases), tolerance=tolerance,
    )


def _check_options(packing: str, loss: str, forward: str, mtp_mask: str, tolerance: float, max_ranks: int) -> None:
    """ValueError naming the flag of a choice verify does not know or a combination it cannot run."""
    from .oracle import FORWARDS

    for name, value, allowed in (("--packing", packing, PACKINGS), ("--loss", loss, LOSSES),
                                 ("--forward", forward, FORWARDS), ("--mtp-mask", mtp_mask, MASKS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if mtp_mask == "scoped" and forward != "rl":
        raise ValueError("--mtp-mask scoped needs --forward rl: a mask is scoped for the RL forward only")
    if not (isinstance(tolerance, float) and 0 < tolerance < 1):
        raise ValueError(f"--tolerance must be a number in (0, 1), got {tolerance!r}")
    if not isinstance(max_ranks, int) or max_ranks < 1:
        raise ValueError(f"--max-ranks must be a positive integer, got {max_ranks!r}")


def check_multimodal_options(packing: str, forward: str, mtp_mask: str, layout: Layout,
                             scatter_embedding: bool | None, pad_multiple: int | None) -> None:
    """ValueError naming the flag of what a VL / Omni model cannot be verified with: its steps are SFT
    steps of BSHD rows, without pipeline stages, and LLaVAModel decides its language model's scatter
    setting and its padding itself."""
    refusals = [
        (packing != "none", f"--packing {packing}: a VL / Omni model is verified with BSHD rows "
                      "(--packing none): packed THD rows through LLaVAModel need Transformer Engine's "
                      "thd_get_partitioned_indices under CP (llava_model.py:869) and the test bed's step takes "
                      "multimodal microbatches as BSHD rows"),
        (forward != "sft", f"--forward {forward}: a VL / Omni model is verified with labels (--forward "
                      "sft): without labels LLaVAModel returns logits over the combined sequence, whose LM loss "
                      "needs labels only the trainer can build, and the test bed's step has no such loss"),
        (mtp_mask != "passed", "--mtp-mask scoped needs --forward rl, which a VL / Omni model is not "
                       "verified with"),
        (layout.pp > 1, f"--pp {layout.pp}: the test bed runs a VL / Omni model without pipeline stages "
                 "(its vision tower sits on the first stage only)"),
        (scatter_embedding is not None, "--scatter-embedding: LLaVAModel builds its language "
                                "model with scatter_embedding_sequence_parallel=False whatever the provider says "
                                "(llava_model.py:239,257)"),
        (pad_multiple is not None, "--pad-multiple: LLaVAModel pads the combined sequence to its "
                           "own multiple (2·CP·TP under CP, TP under SP: llava_model.py:781-830)"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(why)


def _plan(shrunk: Shrunk, sample: _data.Sample, name: str, *, loss: str, forward: str, mtp_mask: str,
          packing: str, pad_multiple: int | None) -> Plan:
    """What the engine builds and runs (`plan.Plan`)."""
    model: HfConfigModel | ProviderModel
    if shrunk.keyspace == "hf":
        model = {"kind": "hf-config", "config": shrunk.values}
    else:  # the provider's fields the shrink changed, set on it after it is made
        changed = {change.key for change in shrunk.changes}
        model = {"kind": "provider", "path": name,
                 "overrides": {key: value for key, value in shrunk.values.items() if key in changed}}
    scatter = shrunk.values.get("scatter_embedding_sequence_parallel")
    plan: Plan = {
        "model": model, "recipe": shrunk.settings, "seed": SEED, "loss": loss, "forward": forward,
        "mtp_mask": "explicit" if mtp_mask == "passed" else "scoped",
        "scatter_embedding_sequence_parallel": scatter if isinstance(scatter, bool) else True,
        "sequences": [list(sequence.tokens) for sequence in sample.sequences],
        "prompts": [sequence.prompt for sequence in sample.sequences], "packing": packing, "pad_multiple": pad_multiple,
    }
    if shrunk.multimodal is not None:  # images in the microbatch; provider fields set after Bridge's import
        model["multimodal"] = dict(shrunk.multimodal.provider)
        plan["images"] = [list(sequence.images) for sequence in sample.sequences]
        plan["scatter_embedding_sequence_parallel"] = False
    return plan


def notes(layout: Layout, loss: str, shrunk: Shrunk, packing: str, pad_multiple: int | None) -> list[str]:
    """What a reader of the report must know about how this run relates to the real one."""
    found = []
    if packing == "thd-real-lengths" and (pad_multiple or nemo_rl_multiple(layout)) == 1:
        found.append("NeMo-RL pads packed sequences to a multiple of 1 at this layout: the real and the padded "
                     "boundaries coincide (give --pad-multiple to verify a packer that pads)")
    cores = os.cpu_count() or 1
    if layout.world_size > cores:
        found.append(f"{layout.world_size} ranks on {cores} cores: oversubscribed (slower, the same numbers)")
    if layout.data_parallel > 1:
        found.append(f"DP{layout.data_parallel}: every data-parallel rank gets the same microbatch (MTP token "
                     "counts over DP are not reduced upstream, Megatron-LM #7452)")
    if loss == "3-output" and layout.cp > 1:
        found.append("a 3-output loss without calculate_per_token_loss averages per-rank LM means under CP "
                     "(Megatron-LM PR #7513): the LM gradient differs, which no MTP fix changes")
    if shrunk.multimodal is not None:
        found.append("a VL / Omni model: SFT steps of BSHD rows with images (a CLIP ViT for the config's vision "
                     "tower); positions are combined slots (each image placeholder is the image's embeddings); the "
                     "numeric reference is the language model run directly on the hand-built combined ids and "
                     "mask at TP1 (the test bed's CombinedIdsReference), not each sequence alone")
    if shrunk.experts:
        found.append("the MoE load-balancing loss is off (a function of the whole microbatch's routing: no "
                     "per-sequence reference exists with it): defects of the MTP block's aux loss (its routers "
                     "built without is_mtp_layer, Megatron-LM PR #6748) are not checked here; scripts/parity.py's "
                     "aux-loss rows check them")
    return found


def layout_to_run(layout: Layout, max_ranks: int) -> tuple[Layout, list[str]]:
    """The layout verify runs for ``layout``, and what it does not run, in words: a world size above
    ``max_ranks`` runs the largest smaller layout that fits instead (a smaller size of a dimension is not
    an exact stand-in for the larger, so the asked one is named as not run)."""
    if layout.world_size <= max_ranks:
        return layout, []
    fitting = [small for small in layout.smaller() if small.world_size <= max_ranks]
    # the most ranks, then the most dimensions kept parallel (CP2 x TP4 shows more than TP8 alone)
    instead = max(fitting, key=lambda small: (small.world_size, sum(size > 1 for size in (small.tp, small.cp, small.pp,
                                                                                          small.ep)), small.cp))
    return instead, [f"{layout.name}: {layout.world_size} ranks, above --max-ranks {max_ranks}; {instead.name} ran "
                     "instead (a smaller size of a dimension is not an exact stand-in for the larger)"]


def megatron_core_fixes() -> list[str]:
    """The overlay's fixes on megatron-core (every target a megatron.core module), in install order."""
    from ..table import FIXES

    return [name for name, targets in FIXES if all(target.startswith("megatron.core") for target in targets)]


def ablations(fixes: list[str]) -> list[list[object]]:
    """The overlay without each fix in turn, then without each pair of fixes one of which reads the other's
    state (``Declaration.reads``: mtp-loss-mask refuses a layout mtp-packed-roll would handle, so without
    mtp-packed-roll alone the step is refused; without both it shows what stock's roll trains), each
    pair once whichever way the reading goes."""
    from ..declarations import load

    cases: list[list[object]] = [[f"overlay without {fix}", [other for other in fixes if other != fix]]
                                 for fix in fixes]
    pairs: set[frozenset[str]] = set()
    for reader in fixes:
        for read in load(reader).reads:
            if read in fixes and frozenset((read, reader)) not in pairs:
                pairs.add(frozenset((read, reader)))
                cases.append([f"overlay without {read} and {reader}",
                              [other for other in fixes if other not in (read, reader)]])
    return cases


def symptoms(fixes: list[str]) -> dict[str, str]:
    """What goes wrong on stock, per fix (its declaration's ``symptom``)."""
    from ..declarations import load

    return {fix: load(fix).symptom for fix in fixes}


def required_by(fixes: list[str]) -> dict[str, tuple[str, ...]]:
    """Per fix, the other fixes of ``fixes`` that require it (``Declaration.requires``): without it they
    do not install either, so its row may show theirs."""
    from ..declarations import load

    return {fix: tuple(other for other in fixes if fix in load(other).requires) for fix in fixes}


def nemo_rl_multiple(layout: Layout) -> int:
    """NeMo-RL's per-sequence padding multiple: 2·CP under CP, times TP under SP
    (``mtp_overlay.mtp.padding_multiple``, restated here so the check needs no torch)."""
    return (2 * layout.cp if layout.cp > 1 else 1) * (layout.tp if layout.sp else 1)


def check_padding(sample: _data.Sample, layout: Layout, packing: str, pad_multiple: int | None) -> None:
    """ValueError naming ``--cp`` (or ``--tp``) when the padded lengths do not fit the layout: under CP
    each packed sequence (a BSHD row) is cut into 2·CP chunks, under SP the row into TP parts."""
    if pad_multiple is not None and (not isinstance(pad_multiple, int) or pad_multiple < 1):
        raise ValueError(f"--pad-multiple must be a positive integer, got {pad_multiple!r}")
    multiple = pad_multiple or nemo_rl_multiple(layout)
    padded = [-(-sequence.length // multiple) * multiple for sequence in sample.sequences]
    rows = padded if packing != "none" else [max(padded)]
    chunks = 2 * layout.cp
    if layout.cp > 1:
        for index, length in enumerate(rows):
            if length % chunks:
                what = f"sequence {index} ({sample.sequences[index].length} tokens)" if packing != "none" else "the row"
                raise ValueError(f"--cp {layout.cp} cuts each {'sequence' if packing != 'none' else 'row'} into "
                                 f"2·CP = {chunks} chunks, but --pad-multiple {multiple} pads {what} to {length}, "
                                 f"not a multiple of {chunks}")
    total = sum(rows) if packing != "none" else rows[0]
    if layout.sp and total % layout.tp:
        raise ValueError(f"--tp {layout.tp} with --sp splits the sequence over {layout.tp} ranks, but --pad-multiple "
                         f"{multiple} gives {total} tokens")


def _child(world: int, log: str | None, progress: Callable[[str], None] | None) -> Engine:
    from .engine import ChildEngine

    return ChildEngine(world, log=log, progress=progress)


def _request(runner: Engine, plan: Plan, jobs: list[Job]) -> Answer:
    answer = runner.request({"op": "run", "plan": plan, "jobs": jobs})
    _raise_plan_error(answer)
    return answer


def _raise_plan_error(answer: Answer) -> None:
    error = answer.get("error")
    if error:
        if answer.get("traceback"):
            raise RuntimeError(f"the verify engine failed: {error}\n{answer['traceback']}"
                               + (f"\n(the ranks' output: {answer['log']})" if answer.get("log") else ""))
        raise ValueError(error if str(error).startswith("--") else f"the test bed cannot build this config: {error}")


def _answers(answer: Answer) -> list[CaseAnswer]:
    cases = answer.get("cases")
    if not isinstance(cases, list) or not all(isinstance(case, dict) for case in cases):
        raise RuntimeError(f"the verify engine answered without cases: {str(answer)[:300]}")
    return cases


def _startup(answer: Answer, world: int) -> list[tuple[str, float]]:
    """The start-up phase of the engine's first answer (none on later ones)."""
    seconds = answer.get("startup")
    if not isinstance(seconds, (int, float)):
        return []
    return [(f"start-up ({world} ranks: megatron-core and Megatron-Bridge imports)", float(seconds))]


def _seconds(answer: Answer) -> float:
    seconds = answer.get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) else 0.0
