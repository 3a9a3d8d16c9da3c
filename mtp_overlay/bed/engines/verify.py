"""The engine of ``mtp-overlay verify``: a user's shrunk model on gloo ranks through Megatron's own step.

The product (`mtp_overlay.verification`) reads the user's config, shrinks it, draws the data and
judges; it never imports this module: it runs ``python -m mtp_overlay.bed.engines.verify --world-size N``
as a child process (`verification.engine.ChildEngine`) and talks JSON lines with it (`main`), or a
test hands it an in-process `Engine`. This module measures and judges nothing. Per case it reports
what Megatron's step gave (LM and per-depth logged MTP losses, token counts), the (sequence,
position, target) triples each MTP depth back-propagated a loss from (`packed.record_mtp`, gathered
over CP, mapped back to each sequence through the microbatch's slot map), the relative error of the
MTP block's, each MTP layer's and the rest's gradients against the reference, and the parity
table's max |Δgrad|. A step is the parity table's (`parity.run_step`: one engine, two faces).

Requests and answers (`Engine.request`; their types: `mtp_overlay.verification.plan`, which the product
imports too): ``describe`` (a provider given by its module path: its fields, for the product to
shrink; its family) and ``run``: jobs of ``(layout, [(case name, fixes), ...])``. The
layout ``"reference"`` is each sequence alone, unpacked, TP1, stock; its gradients are kept for
every later case. Each job sets its layout up over the same ranks (model parallelism destroyed and
initialised again, the rest data parallel, fed the same microbatch: a replica's gradients are the
single rank's), builds the model anew with Megatron-Bridge's provider from one seed with the test
bed's CPU settings (`bridge.build_provided`; stock megatron-core; under PP each stage holding the
weights of the model without stages, `pipeline.build_stage`, the MTP block's positions sent from the
last stage), and runs each case with exactly its fixes installed. A config the test bed cannot build
answers ``{"error": ...}`` naming what is missing (`PlanError`); anything else that fails answers the
error with its traceback and the ranks' log.

A multimodal plan (a Nemotron VL / Omni config: ``images`` in the plan) is built by Bridge's own VL /
Omni provider with a CLIP ViT for RADIO (`tiny_llava.build_bridge_vl`); its microbatch is BSHD rows
with image placeholders, the images and their tile counts (`multimodal_microbatch`); its reference is
``tiny_llava.CombinedIdsReference`` around the reference build's LLaVAModel (the language model run
directly on the hand-built combined ids and mask, TP1, stock) and its positions are combined slots
(text tokens and image embeddings).
"""

import json
import os
import sys
import time

from ...verification.plan import LOSSES  # verify's --loss -> (MegatronStep's loss shape, calculate_per_token_loss)
from .verify_model import PlanError, check_buildable, describe, family, provided

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ...verification.plan import Answer, CaseAnswer, DescribeRequest, Job, Plan, RunRequest


def build(plan, sequence_parallel):
    """(this rank's model of the plan (its layout from parallel_state), per-token loss as the plan
    says; ``{"provider_settings": [...]}``: what verify set beyond Bridge's import, `provided`).

    Under pipeline parallelism this rank's stage, holding the weights of the model built at PP1 over
    the same ranks (`pipeline.build_stage`; a stage built from the seed alone would draw other
    weights); a hybrid pattern is cut into one ``|``-separated segment per stage (`staged_pattern`).
    """
    from ..models import pipeline

    details = {}

    def one(staged):
        from ..models.bridge import build_provided
        from ..models.bridge import own_attention_backend

        provider, details["provider_settings"] = provided(plan["model"])
        kind = family(provider)
        check_buildable(provider)
        if pipeline.size() > 1 and provider.share_embeddings_and_output_weights:
            raise PlanError(
                f"--pp {pipeline.size()} with tied embeddings: the last stage holds its own copy of the tied output "
                "weight (megatron-core language_module.py:273-283), which the test bed does not yet map to the "
                "word embeddings of the model without stages (bed/models/pipeline.py maps untied models); verify "
                "this config with --pp 1"
            )
        if kind == "multimodal":
            raise PlanError(f"{type(provider).__name__} builds a LLaVAModel: its plan must hold images (the product "
                            "plans a Nemotron VL / Omni model as multimodal)")
        if staged and kind == "hybrid":
            provider.hybrid_layer_pattern = staged_pattern(provider.hybrid_layer_pattern, pipeline.size())
        with own_attention_backend():
            model = build_provided(provider, seed=plan["seed"], sequence_parallel=sequence_parallel,
                                   scatter_embedding_sequence_parallel=plan["scatter_embedding_sequence_parallel"],
                                   recipe=plan.get("recipe") or None)
        model.config.calculate_per_token_loss = LOSSES[plan["loss"]][1]
        return model

    model = one(False) if pipeline.size() == 1 else pipeline.build_stage(one, dict(staged=False), dict(staged=True))
    return model, details


def build_multimodal(plan, sequence_parallel):
    """This rank's Nemotron VL / Omni model of a multimodal plan (`tiny_llava.build_bridge_vl`: Bridge's
    own provider and ``provide()``, a CLIP ViT for RADIO) and what verify changed to build it:
    ``{"substituted": [...], "provider_settings": [...]}`` (`provided`). The loss setting goes on the
    provider before it builds: the language model's config is a copy of it (``nemotron_omni_provider.py:304``)."""
    from ..models import pipeline
    from ..models.bridge import own_attention_backend
    from ..models.tiny_llava import build_bridge_vl

    provider, settings = provided(plan["model"])
    if family(provider) != "multimodal":
        raise PlanError(f"the plan holds images, but {type(provider).__name__} builds no LLaVAModel: the test bed runs "
                        "images through Megatron-Bridge's Nemotron VL and Omni providers")
    check_buildable(provider)
    if pipeline.size() > 1:
        raise PlanError("--pp: the test bed runs a multimodal model without pipeline stages")
    recipe = dict(plan.get("recipe") or {}, calculate_per_token_loss=LOSSES[plan["loss"]][1])
    with own_attention_backend():
        model, substituted = build_bridge_vl(provider, seed=plan["seed"], sequence_parallel=sequence_parallel,
                                             recipe=recipe)
    return model, dict(substituted=substituted, provider_settings=settings)


def staged_pattern(pattern, stages):
    """``pattern`` (a hybrid layer pattern without MTP) cut into ``stages`` ``|``-separated segments, the
    longer ones first: ``"ME*-"`` at PP2 -> ``"ME|*-"``; PlanError with fewer layers than stages."""
    layers = pattern.replace("|", "")
    if len(layers) < stages:
        raise PlanError(f"the shrunk layer pattern {layers!r} has {len(layers)} layers, fewer than the {stages} "
                        "pipeline stages: verify with --layers all, or fewer stages")
    size, extra = divmod(len(layers), stages)
    cuts, start = [], 0
    for stage in range(stages):
        end = start + size + (stage < extra)
        cuts.append(layers[start:end])
        start = end
    return "|".join(cuts)


# --- the data ----------------------------------------------------------------------------------
def masks(tokens, prompt, forward):
    """(label-aligned LM loss mask, input-aligned MTP token mask or None) of one sequence of ``len(tokens)
    - 1`` inputs whose tokens from index ``prompt`` on are the response (`verification.oracle`)."""
    import torch

    length = len(tokens) - 1
    response = (torch.arange(length + 1) >= prompt).float()  # per token of the text
    if forward == "sft":  # label j is token j + 1
        return response[1:], None
    # RL: the trainer's LM loss over label j (token j + 1, none past the inputs); the model's mask per input
    return torch.cat([response[1:length], response.new_zeros(1)]), response[:length]


def microbatch(plan, layout):
    """The plan's sequences as one microbatch of ``MegatronStep`` for ``layout`` ("reference": each
    sequence alone in its own row, unpadded beyond the longest; else the plan's packing, each sequence
    padded to the layout's multiple), and the slot -> (sequence, position) map of its [rows, slots]."""
    import torch

    from ... import mtp

    sequences, prompts = plan["sequences"], plan["prompts"]
    lengths = [len(tokens) - 1 for tokens in sequences]
    forward = plan["forward"]
    packing = "none" if layout == "reference" else plan["packing"]
    multiple = 1 if layout == "reference" else pad_multiple(plan, layout)
    longest = -(-max(lengths) // multiple) * multiple
    rows = {key: torch.zeros(len(sequences), longest) for key in ("loss_mask", "mtp_loss_mask")}
    ids = {key: torch.zeros(len(sequences), longest, dtype=torch.int64) for key in ("input_ids", "labels")}
    for index, (tokens, prompt) in enumerate(zip(sequences, prompts)):
        text, length = torch.tensor(tokens), lengths[index]
        ids["input_ids"][index, :length], ids["labels"][index, :length] = text[:-1], text[1:]
        lm_mask, token_mask = masks(tokens, prompt, forward)
        rows["loss_mask"][index, :length] = lm_mask
        if token_mask is not None:
            rows["mtp_loss_mask"][index, :length] = token_mask
    if packing == "none":
        batch = dict(ids, position_ids=torch.arange(longest).repeat(len(sequences), 1), **rows)
        slots = [[(row, column) for column in range(longest)] for row in range(len(sequences))]
    else:
        packed = mtp.pack_sequences(ids["input_ids"], lengths, rows["loss_mask"], pad_multiple=multiple)
        padded = packed.cu_seqlens_padded.long()
        slot = torch.arange(int(padded[-1]))
        owner = torch.searchsorted(padded, slot, right=True) - 1
        batch = dict(
            input_ids=packed.input_ids,
            labels=mtp.pack_sequences(ids["labels"], lengths, pad_multiple=multiple).input_ids,
            position_ids=(slot - padded[owner])[None, :],
            loss_mask=packed.loss_mask,
            mtp_loss_mask=mtp.pack_sequences(rows["mtp_loss_mask"], lengths, pad_multiple=multiple).input_ids.float(),
            packed_seq_params=mtp.packed_seq_params(packed, real_lengths=packing == "thd-real-lengths"),
        )
        slots = [[(int(owner[k]), int(k - padded[owner[k]])) for k in range(int(padded[-1]))]]
    if forward == "sft":
        batch.pop("mtp_loss_mask")
    return batch, slots


IMAGE_MARKER = -1  # a plan's token at an image placeholder: the built model's image token goes there


def multimodal_microbatch(plan, llava):
    """The plan's sequences as one multimodal SFT microbatch of ``MegatronStep`` for ``llava`` (the built
    LLaVAModel): one BSHD row per sequence (zeros after its end), the image token of the model at each
    image placeholder (`IMAGE_MARKER`) of ``input_ids`` and, as LLaVAModel's labels are the same stream
    shifted, of ``labels``; the label-aligned loss mask of the response (`masks`); ``images``: one
    ``[3, h, w]`` image of the model's vision geometry per placeholder, in reading order, drawn from the
    plan's seed; ``num_image_tiles``: per image ``tokens_per_image / img_seq_len`` (1 tile of a CLIP
    tower's embeddings; Nemotron Omni counts embeddings, ``img_seq_len = 1``). PlanError when a text
    token is the model's image or sound token (it would be taken for one)."""
    import torch

    from ..models.tiny_llava import tokens_per_image

    sequences, prompts = plan["sequences"], plan["prompts"]
    image, sound = llava.image_token_index, getattr(llava, "sound_token_index", None)
    clash = sorted({token for tokens in sequences for token in tokens if token in (image, sound)})
    if clash:
        raise PlanError(f"the sample's text holds token(s) {clash}: the image ({image}) or sound ({sound}) token of "
                        "the built model, which LLaVAModel would take for an image or a sound clip")
    lengths = [len(tokens) - 1 for tokens in sequences]
    width = max(lengths)
    batch = {key: torch.zeros(len(sequences), width, dtype=torch.int64) for key in ("input_ids", "labels")}
    batch["loss_mask"] = torch.zeros(len(sequences), width)
    for row, (tokens, prompt) in enumerate(zip(sequences, prompts)):
        stream, length = torch.tensor(tokens), lengths[row]
        stream[stream == IMAGE_MARKER] = image
        batch["input_ids"][row, :length], batch["labels"][row, :length] = stream[:-1], stream[1:]
        batch["loss_mask"][row, :length] = masks(tokens, prompt, "sft")[0]
    count = int((batch["input_ids"] == image).sum())
    per_image, per_tile = tokens_per_image(llava), llava.img_seq_len
    if per_image % per_tile:
        raise PlanError(f"the built vision tower gives {per_image} embeddings per image, not a whole number of "
                        f"LLaVAModel's img_seq_len {per_tile}")
    vision = llava.vision_model
    generator = torch.Generator().manual_seed(plan["seed"])
    batch.update(position_ids=torch.arange(width).repeat(len(sequences), 1),
                 images=torch.randn(count, 3, vision.img_h, vision.img_w, generator=generator),
                 num_image_tiles=torch.full((count,), per_image // per_tile, dtype=torch.int32))
    return batch


def pad_multiple(plan, layout):
    """The per-sequence padding multiple of ``layout``: the plan's, else NeMo-RL's (2*CP*TP under CP,
    TP under SP: `mtp.padding_multiple`)."""
    from ... import mtp

    if plan.get("pad_multiple"):
        return plan["pad_multiple"]
    return mtp.padding_multiple(layout["cp"], layout["tp"], layout["sp"])


# --- rank workers -------------------------------------------------------------------------------
def model_parallel(layout, seed):
    """Make this rank's model parallelism ``layout`` (TP, CP, EP, ETP; the rest data parallel), seeded
    as the pool seeds it; the pool's own is set up again by its next run (`launcher`)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout["tp"], context_parallel_size=layout["cp"],
        pipeline_model_parallel_size=layout.get("pp") or 1,
        expert_model_parallel_size=layout.get("ep") or 1, expert_tensor_parallel_size=layout.get("etp"),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def run_cases(plan: "Plan", jobs: "list[Job]") -> "list[dict[str, object]] | dict[str, str] | None":
    """Rank worker: each job ``(layout, [(name, fixes), ...])`` in order: the layout set up, its model built
    once, each case one step with exactly its fixes installed (`parity.run_step`) and MTP recorded.
    On global rank 0 one dict per case (the reference's with the facts of what was built and its MTP
    parameters' sizes); None elsewhere; ``{"error": ...}`` for a plan the test bed cannot build."""
    import torch

    import mtp_overlay

    from ..models import pipeline
    from ..steps.megatron_step import MegatronStep
    from ..models.packed import record_mtp
    from .parity import run_step

    out = []
    for layout, cases in jobs:
        spec = dict(tp=1, cp=1, pp=1, ep=1, etp=None, sp=False) if layout == "reference" else layout
        model_parallel(spec, plan["seed"])
        mtp_overlay.uninstall()  # every model is built by stock megatron-core
        try:
            model, built, language_model, batch, slots, details = prepared(plan, layout, spec["sp"])
        except PlanError as error:
            return dict(error=str(error))
        step = MegatronStep(model, optimizer=None)
        buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
        facts = dict(built=built_facts(built, details), mtp_sizes=[
            param.numel() for name, param in language_model.named_parameters() if name.split(".")[0] == "mtp"
        ]) if layout == "reference" else {}
        # the reference passes the MTP mask as loss_mask (what the trainer means); a scoped mask reaches stock
        # megatron-core only through mtp-loss-mask, which is what the other cases check
        route = "explicit" if layout == "reference" else plan["mtp_mask"]
        for name, fixes in cases:
            with record_mtp(language_model) as records:
                result, error = run_step(step, buffers, batch, fixes, labels=plan["forward"] == "sft",
                                         mtp_mask=route, loss=LOSSES[plan["loss"]][0])
            trained = None if error else positions(records, batch, slots)
            if pipeline.size() > 1:  # the MTP block runs on the last stage: its positions, on every stage
                trained = pipeline.broadcast_from_last_stage(trained)
            out.append(dict(layout=layout, case=name, fixes=list(fixes), error=error, step=result, trained=trained,
                            **facts))
        del step, model, built, language_model
    mtp_overlay.uninstall()
    return out if torch.distributed.get_rank() == 0 else None


def prepared(plan, layout, sequence_parallel):
    """(the model the step runs, the model Bridge's provider built, its megatron-core language model, the
    microbatch, its slot map (None: combined slots, row = sequence), what verify changed to build it) of
    one layout. A multimodal plan's reference is ``CombinedIdsReference`` around the reference build's
    LLaVAModel (module docstring)."""
    from ..models.pipeline import language_model_of

    if plan.get("images") is None:
        model, details = build(plan, sequence_parallel)
        return (model, model, model, *microbatch(plan, layout), details)
    from ..models.tiny_llava import CombinedIdsReference

    model, details = build_multimodal(plan, sequence_parallel)
    llava = model.llava_model
    stepped = CombinedIdsReference(llava) if layout == "reference" else model
    return stepped, model, language_model_of(model), multimodal_microbatch(plan, llava), None, details


def positions(records, batch, slots):
    """Per MTP depth the sorted [sequence, position, target] triples it back-propagated a loss from,
    over the whole microbatch (a CP collective: every CP rank's slots, on every rank). ``slots`` None:
    a multimodal microbatch, whose MTP records are in LLaVAModel's combined layout (this CP rank's
    chunks of the padded combined rows, ``llava_model.py:861``): [row, combined slot, target]."""
    import torch

    if slots is None:
        from megatron.core import parallel_state

        from ..models.packed import to_global

        depths = []
        for record in records:
            length = record["trained"].shape[1] * parallel_state.get_context_parallel_world_size()
            boundaries = torch.tensor([0, length])
            trained = to_global(record["trained"], boundaries)
            targets = to_global(record["targets"], boundaries)
            depths.append(sorted([row, slot, int(targets[row, slot])] for row, slot in trained.nonzero().tolist()))
        return depths
    from ..steps.megatron_step import padded_boundaries
    from ..models.packed import to_global

    params = batch.get("packed_seq_params")
    width = batch["input_ids"].shape[1]
    boundaries = padded_boundaries(params) if params is not None else torch.tensor([0, width])
    depths = []
    for record in records:
        trained = to_global(record["trained"], boundaries)
        targets = to_global(record["targets"], boundaries)
        found = [[*slots[row][column], int(targets[row, column])] for row, column in trained.nonzero().tolist()]
        depths.append(sorted(found))
    return depths


# --- the parent: runs and comparisons -------------------------------------------------------------
def gradient_errors(step, reference, sizes):
    """{part: relative error} of a case's finalized gradients against the reference's: "mtp" (the MTP
    block), "lm" (the rest), and per MTP layer ("mtp.layers.<i>") where the block has several.
    ``sizes``: the flat size of each MTP-block parameter, in the order of ``grad_names["mtp"]``."""
    import numpy

    from ..steps.megatron_step import relative_error

    errors = {part: relative_error(step.grads[part], reference.grads[part]) for part in ("mtp", "lm", "encoder")
              if part in step.grads and part in reference.grads}
    names = reference.grad_names["mtp"]
    if len(sizes) != len(names) or tuple(step.grad_names["mtp"]) != tuple(names):
        raise RuntimeError(f"MTP parameters differ from the reference's: {step.grad_names['mtp']} vs {names}")
    layers, offset = {}, 0
    for name, size in zip(names, sizes):
        if name.startswith("mtp.layers."):
            layers.setdefault(".".join(name.split(".")[:3]), []).append(numpy.arange(offset, offset + size))
        offset += size
    if len(layers) > 1:
        for layer, spans in layers.items():
            index = numpy.concatenate(spans)
            errors[layer] = relative_error(step.grads["mtp"][index], reference.grads["mtp"][index])
    return errors


def summarise(case: "dict[str, object]", reference: "dict[str, object]") -> "CaseAnswer":
    """A case's JSON row: losses, counts, trained triples, gradient errors against ``reference`` (the
    reference case, with its ``mtp_sizes``)."""
    row = {key: case[key] for key in ("layout", "case", "fixes", "error", "trained")}
    step = case["step"]
    if step is not None:
        row.update(lm_loss=step.lm_loss, mtp_losses=list(step.mtp_losses), mtp_tokens=list(step.mtp_tokens))
        if reference.get("step") is not None:
            row["grad_relerr"] = gradient_errors(step, reference["step"], reference["mtp_sizes"])
    return row


def warm_up():
    """Rank worker: the imports every later job needs (megatron-core's models, Megatron-Bridge)."""
    from megatron.core.models.gpt import gpt_model  # noqa: F401
    from megatron.core.models.hybrid import hybrid_model  # noqa: F401

    from ..models.bridge import import_bridge

    import_bridge()


def built_facts(model, details=None):
    """What Bridge's provider built: classes, layer patterns, MTP, MoE, embeddings, parameter count; for
    a multimodal model also its wrapper, the LLaVAModel's image facts and ``details`` (what verify
    substituted and set, `build_multimodal`)."""
    from ..models.pipeline import language_model_of

    wrapper, model = model, language_model_of(model)
    config = model.config
    facts = dict(provider=type(wrapper.config).__name__, model=type(model).__name__,
                 parameters=sum(param.numel() for param in wrapper.parameters()))
    llava = getattr(wrapper, "llava_model", None)
    if llava is not None:
        from ..models.tiny_llava import tokens_per_image

        facts.update(wrapper=f"{type(wrapper).__name__} around {type(llava).__name__}",
                     vision_model=type(llava.vision_model).__name__, image_token_index=llava.image_token_index,
                     img_seq_len=llava.img_seq_len, tokens_per_image=tokens_per_image(llava),
                     language_model_type=getattr(config, "language_model_type", None),
                     reference="CombinedIdsReference: its language model run directly on the hand-built combined "
                               "ids and loss mask (TP1, stock)")
    facts.update(details or {})
    names = ["hybrid_layer_pattern", "num_layers", "mtp_num_layers", "mtp_use_repeated_layer", "hidden_size",
             "num_attention_heads", "num_query_groups", "share_embeddings_and_output_weights", "vocab_size",
             "calculate_per_token_loss"]
    if getattr(config, "num_moe_experts", None):
        names += ["num_moe_experts", "moe_router_topk", "moe_token_dispatcher_type", "moe_router_score_function"]
    if "M" in (getattr(config, "hybrid_layer_pattern", None) or ""):
        names += ["mamba_num_heads", "mamba_num_groups"]
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (bool, int, float, str)):
            facts[name] = value
    facts["scatter_embedding_sequence_parallel"] = getattr(model.embedding, "scatter_to_sequence_parallel", True)
    return facts


def max_deltas(step, reference):
    """{part: max |g - g_ref|} of the MTP block ("mtp") and the rest ("lm"): the parity table's columns."""
    import numpy

    return {part: float(numpy.abs(step.grads[part].astype(numpy.float64) - reference.grads[part]).max(initial=0.0))
            for part in ("mtp", "lm")}


class Engine:
    """The engine the product talks to: `request` answers one message (module docstring), keeping its
    ranks (and the reference's gradients) between messages.

    world_size: the ranks of every run; log: a file the ranks' output goes to; progress: called with
    one line per phase. With ``MTP_OVERLAY_SHARED_RANKS=1`` (a test suite) the ranks are the shared
    pool of ``launcher.run_ranks``; otherwise one `launcher.RankPool`, closed by `close`.
    """

    def __init__(self, world_size, *, log=None, progress=None, timeout=900):
        from ..runtime.launcher import SHARED_RANKS, RankPool

        self.world_size, self.log, self.timeout = world_size, log, timeout
        self.progress = progress or (lambda line: None)
        self.shared = os.environ.get(SHARED_RANKS) == "1"
        self.pool = None if self.shared else RankPool(world_size, log=log)
        self.reference = None
        self.started = False

    def request(self, message: "DescribeRequest | RunRequest") -> "Answer":
        """``{"op": "describe", "model": ...}`` or ``{"op": "run", "plan": ..., "jobs": ...}``; a dict. The
        first request starts the ranks first: its answer's ``startup`` is the seconds that took."""
        op = message.get("op")
        if op not in ("describe", "run"):
            raise ValueError(f"op must be 'describe' or 'run', got {op!r}")
        startup = None
        if not self.started:
            self.progress(f"starting {self.world_size} gloo rank(s) (each imports megatron-core and Megatron-Bridge)")
            since = time.perf_counter()
            self._run(warm_up, ())
            self.started, startup = True, round(time.perf_counter() - since, 1)
        since = time.perf_counter()
        if op == "describe":
            answer = self._run(describe, (message["model"],))
        else:
            answer = self._cases(message["plan"], message["jobs"])
        answer["seconds"] = round(time.perf_counter() - since, 1)
        if startup is not None:
            answer["startup"] = startup
        return answer

    def _cases(self, plan: "Plan", jobs: "list[Job]") -> "Answer":
        jobs = [(layout, [tuple(case) for case in cases]) for layout, cases in jobs]
        names = ", ".join(layout_name(layout) for layout, _ in jobs)
        self.progress(f"{names}: {sum(len(cases) for _, cases in jobs)} step(s) through Megatron's own step")
        found = self._run(run_cases, (plan, jobs))
        if isinstance(found, dict):
            return found
        answer = dict(cases=[])
        for case in found:
            if case["layout"] == "reference":
                self.reference = case
                answer["built"] = case["built"]
            if self.reference is None:
                raise RuntimeError("the reference must run before any other case")
            row = summarise(case, self.reference)
            if case["step"] is not None and self.reference["step"] is not None:
                row["max_delta"] = max_deltas(case["step"], self.reference["step"])
            answer["cases"].append(row)
        return answer

    def _run(self, fn, args):
        from ..runtime.launcher import run_ranks_checked

        if self.shared:
            return run_ranks_checked(fn, self.world_size, args=args, fixes=[], timeout=self.timeout, log=self.log)[0]
        return self.pool.run_checked(fn, args=args, fixes=[], timeout=self.timeout)[0]

    def close(self):
        if self.pool is not None:
            self.pool.close()


def layout_name(layout):
    """"TP2xCP2+SP", "EP2", "TP1" ... of a layout dict (or "reference")."""
    if layout == "reference":
        return "the reference (TP1, stock)"
    from ...verification.layout import Layout

    return Layout(**layout).name


def main(argv=None):
    """``python -m mtp_overlay.bed.engines.verify --world-size N [--log FILE]``: one JSON request per line on
    stdin, one JSON answer per line on stdout (an error as ``{"error": ..., "traceback": ...}``),
    progress on stderr; ends at the end of stdin."""
    import argparse
    import traceback

    parser = argparse.ArgumentParser(prog="python -m mtp_overlay.bed.engines.verify")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--log", help="the ranks' output (default: a temporary file)")
    options = parser.parse_args(argv)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed by accident goes to stderr
    log = options.log
    if log is None:
        import tempfile

        log = os.path.join(tempfile.mkdtemp(prefix="mtp-overlay-verify-"), "ranks.log")

    def progress(line):
        print(f"mtp-overlay verify: {line}", file=sys.stderr, flush=True)

    engine = Engine(options.world_size, log=log, progress=progress)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                answer = engine.request(json.loads(line))
            except Exception as error:  # noqa: BLE001 - the product reports it, with the ranks' log
                answer = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(), log=log)
            replies.write(json.dumps(answer) + "\n")
            replies.flush()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
