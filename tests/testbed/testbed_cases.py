"""The cases of the test-bed tests, run as one plan per parallel layout in one spawned rank pool.

A plan is a list of case dicts; `run_plan` runs them in order on every rank (built models are
reused across cases), each with exactly the overlay fixes it names installed (the pool starts with
none: stock megatron-core), and returns ``{case name: result}`` in plain numbers and numpy arrays.
"""

from mtp_overlay.mtp import padding_multiple
from mtp_overlay.bed.runtime.cases import use_fixes

# four sequences of random lengths in [3, 15] (seeded: 9, 12, 6, 4) and their prompt lengths (the
# loss mask leaves a sequence's prompt out)
LENGTH_RANGE, SEED = (3, 15), 1
PROMPTS = (2, 0, 3, 1)
MODELS = ("gpt", "hybrid")
LOSS_MASK, SP_SCATTER, PACKED_ROLL = "mtp-loss-mask", "mtp-sp-scatter", "mtp-packed-roll"
CP_LOSS_SCALE = "mtp-cp-loss-scale"
GQA = dict(num_query_groups=2)  # 4 query heads share 2 K/V heads

# world size, TP, CP, sequence parallelism, and the per-sequence padding multiple NeMo-RL uses for
# the layout (2*CP*TP under CP, TP under SP); TP1 would need none: 4 makes the two flavours differ
LAYOUTS = {
    "tp1": dict(world_size=1, tp=1, cp=1, sp=False, pad_multiple=4),
    "cp2": dict(world_size=2, tp=1, cp=2, sp=False, pad_multiple=padding_multiple(2, 1, False)),
    "tp2_sp": dict(world_size=2, tp=2, cp=1, sp=True, pad_multiple=padding_multiple(1, 2, True)),
    "tp2_cp2_sp": dict(world_size=4, tp=2, cp=2, sp=True, pad_multiple=padding_multiple(2, 2, True)),
}


def lengths():
    from mtp_overlay.bed.models.packed import random_lengths

    return random_lengths(len(PROMPTS), *LENGTH_RANGE, seed=SEED)


def packed_row(pad_multiple, flavour="padded"):
    from mtp_overlay.bed.models.packed import make_packed_row

    return make_packed_row(lengths(), pad_multiple=pad_multiple, flavour=flavour, prompts=PROMPTS)


def packed_name(model, flavour, labels, loss_mask="explicit"):
    suffix = "" if loss_mask == "explicit" else f"/{loss_mask}"
    return f"packed/{model}/{flavour}/{'sft' if labels else 'rl'}{suffix}"


def plan(layout):
    """The cases of one layout (see the test modules for what each proves)."""
    spec = LAYOUTS[layout]
    sp = dict(sequence_parallel=True) if spec["sp"] else {}
    row = dict(pad_multiple=spec["pad_multiple"])
    # under CP the BSHD step's logged MTP loss equals TP1's only with mtp-cp-loss-scale
    cp_fix = (CP_LOSS_SCALE,) if spec["cp"] > 1 else ()
    cases = [dict(name=f"bshd/{model}", kind="bshd", model=model, model_kwargs=sp, params=layout == "tp1",
                  fixes=cp_fix) for model in MODELS]
    for model in MODELS:
        for flavour in ("padded", "unpadded"):
            for labels in (True, False):
                cases.append(dict(name=packed_name(model, flavour, labels), kind="packed", model=model,
                                  model_kwargs=sp, row=dict(row, flavour=flavour), labels=labels))
    if layout == "tp1":
        for model in MODELS:
            for labels in (True, False):  # each sequence alone: a row without padding is the sequence space
                cases.append(dict(name=f"reference/{model}/{'sft' if labels else 'rl'}", kind="reference",
                                  model=model, row=dict(pad_multiple=1), labels=labels))
        cases.append(dict(name="reference/hybrid/sft/gqa", kind="reference", model="hybrid", model_kwargs=GQA,
                          row=dict(pad_multiple=1), labels=True))
        for flavour in ("padded", "unpadded"):  # stock MTP without a loss mask (RL)
            cases.append(dict(name=packed_name("hybrid", flavour, False, None), kind="packed", model="hybrid",
                              row=dict(row, flavour=flavour), labels=False, loss_mask=None))
    for labels in (True, False):  # the unpadded flavour with mtp-packed-roll on (stock: the cases above)
        cases.append(dict(name=packed_name("hybrid", "unpadded", labels) + "/roll-fixed", kind="packed",
                          model="hybrid", model_kwargs=sp, row=dict(row, flavour="unpadded"), labels=labels,
                          fixes=(PACKED_ROLL,)))
    if layout == "tp1":
        for flavour in ("padded", "unpadded"):  # no loss mask, mtp-packed-roll on
            cases.append(dict(name=packed_name("hybrid", flavour, False, None) + "/roll-fixed", kind="packed",
                              model="hybrid", row=dict(row, flavour=flavour), labels=False, loss_mask=None,
                              fixes=(PACKED_ROLL,)))
    if spec["cp"] > 1:
        cases.append(dict(name="packed/hybrid/padded/sft/gqa", kind="packed", model="hybrid",
                          model_kwargs=dict(sp, **GQA), row=dict(row, flavour="padded"), labels=True))
    if layout == "cp2":
        cases += loss_mask_cases(row)
    if spec["sp"]:
        not_scattering = dict(sp, scatter_embedding_sequence_parallel=False)
        for fixes in ((), (SP_SCATTER,)):
            state = "on" if fixes else "off"
            cases.append(dict(name=f"sp_scatter/bshd/{state}", kind="bshd", model="hybrid",
                              model_kwargs=not_scattering, fixes=fixes + cp_fix))
            cases.append(dict(name=f"sp_scatter/packed/{state}", kind="packed", model="hybrid",
                              model_kwargs=not_scattering, row=dict(row, flavour="padded"), labels=True, fixes=fixes))
    return cases


def loss_mask_cases(row):
    """mtp-loss-mask on HybridModel, packed THD, RL (labels=None), off and on."""
    padded = dict(row, flavour="padded")
    base = dict(kind="packed", model="hybrid", labels=False)
    cases = []
    for fixes in ((), (LOSS_MASK,)):
        state = "on" if fixes else "off"
        cases += [
            # the trainer scopes the CP-local mask and passes none
            dict(base, name=f"loss_mask/scoped/{state}", row=padded, loss_mask="scoped", fixes=fixes),
            # a model that slices CP itself gets the full-row mask explicitly ...
            dict(base, name=f"loss_mask/wrapper/explicit/{state}", row=padded, wrapper=True, fixes=fixes),
            # ... and a full-row mask scoped around it does not have its input_ids' layout
            dict(base, name=f"loss_mask/wrapper/scoped/{state}", row=padded, wrapper=True, loss_mask="scoped",
                 fixes=fixes),
        ]
    cases.append(dict(base, name="loss_mask/unpadded/on", row=dict(row, flavour="unpadded"), fixes=(LOSS_MASK,)))
    cases.append(dict(base, name="loss_mask/unpadded/on+roll", row=dict(row, flavour="unpadded"),
                      fixes=(LOSS_MASK, PACKED_ROLL)))
    return cases


def run_plan(cases):
    """Rank worker: run every case of a plan; ``{name: result}`` (plain numbers and numpy arrays)."""
    models, results = {}, {}
    for case in cases:
        use_fixes(case.get("fixes", ()))
        key = (case["model"], tuple(sorted(case.get("model_kwargs", {}).items())))
        if key not in models:
            models[key] = _build(case["model"], **case.get("model_kwargs", {}))
        results[case["name"]] = RUNNERS[case["kind"]](models[key], case)
    use_fixes(())
    return results



def _build(model, **kwargs):
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid

    return {"gpt": build_tiny_gpt, "hybrid": build_tiny_hybrid}[model](**kwargs)


def _run_bshd(model, case):
    """tiny_gpt.train_step on its default batch: StepResult, full gradients (and parameters)."""
    from mtp_overlay.bed.models.packed import _portable, full_grads
    from mtp_overlay.bed.models.tiny_gpt import make_batch, train_step

    try:
        step = train_step(model, make_batch())
    except Exception as exc:  # the test compares the kind and text of the failure
        return dict(error=f"{type(exc).__name__}: {exc}")
    names, grads = full_grads(model)
    result = dict(step=step, names=names, grads=_portable(grads), error=None)
    if case.get("params"):
        result["params"] = [(name, tuple(p.shape), p.detach().double().numpy()) for name, p in model.named_parameters()]
    return result


def _run_packed(model, case):
    from mtp_overlay.bed.models.packed import SelfSlicingCP, run_packed

    if case.get("wrapper"):
        model = SelfSlicingCP(model)
    row = packed_row(**case["row"])
    return run_packed(model, row, labels=case["labels"], loss_mask=case.get("loss_mask", "explicit")).portable()


def _run_reference(model, case):
    from mtp_overlay.bed.models.packed import run_reference

    return run_reference(model, packed_row(**case["row"]), labels=case["labels"]).portable()


RUNNERS = {"bshd": _run_bshd, "packed": _run_packed, "reference": _run_reference}


def layout_params(*names):
    """pytest parameters for layouts; the 4-process TP2xCP2+SP pool is marked slow."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.slow) if LAYOUTS[name]["world_size"] > 2 else name
            for name in names]
