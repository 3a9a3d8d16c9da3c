"""The host reads of Megatron's training step on the packed THD path, with every fix installed and stock.

Megatron's own step (``get_forward_backward_func`` -> DDP -> ``finalize_model_grads``) on the tiny
HybridModel, one packed row of four sequences in NeMo-RL's real-lengths flavour, an RL forward with
the MTP mask scoped without saying its alignment: every megatron-core fix's hook is on the path (the
mask routed and checked, the packed rolls, the CP loss scale, the SP scatter of a model that does not
scatter its embedding). `step_reads` runs on each rank and counts (`syncs.SyncCounter`) the reads of
the forward+backward alone, step by step: ``first`` (the one-time checks), ``warm`` (every later
step), ``bshd`` (full-length rows), ``full`` (``MTP_OVERLAY_CHECKS=full``) and ``stock`` (the padded
flavour, which stock can train), ``stock bshd``; the aten ops of each (a kernel launch each on a
GPU); and the longest device-assert message the rank queued (CUDA refuses 255 bytes or more).
``tests/testbed/test_hot_path_syncs.py`` asserts on it;
``scripts/hot_path_syncs.py`` prints it.
"""

LAYOUTS = {  # parallelism (bed.engines.parity.PARALLELISMS) -> (model, sequence parallel)
    "TP1": ("hybrid", False),
    "CP2": ("hybrid", False),
    "TP2+SP": ("hybrid, scatter=False", True),
}
STEPS = ("first", "warm", "bshd", "full", "stock", "stock bshd")


def step_reads(model_name, sequence_parallel, pad_multiple, **overrides):
    """Rank worker: per step of `STEPS`, (`SyncCounter.summary`, the step's grads, its MTP tokens, its
    aten ops: ``{"ops": {op: calls}, "by origin": {(origin, op): calls}, "files": {(origin, file): calls}}``).
    ``overrides``: `parity.build`'s (e.g. ``mtp_num_layers=2``)."""
    import mtp_overlay

    from . import parity
    from ..steps.megatron_step import MegatronStep
    from ..fixes.mtp_cp_loss_scale import microbatch
    from ..runtime.device import longest_assert_message
    from ..runtime.syncs import SyncCounter, checks_mode

    mtp_overlay.uninstall()  # the model is built by stock megatron-core, then every fix goes in
    step = MegatronStep(parity.build(model_name, sequence_parallel=sequence_parallel, **overrides), optimizer=None)
    mtp_overlay.install()
    batch = parity.packed_row(pad_multiple, "unpadded").microbatch(labels=False)
    counter = SyncCounter()
    step.schedule_scope = lambda: counter

    def counted(rows=batch, mtp_mask="scoped"):
        counter.clear()
        result = step.step([rows], labels=False, update=False, mtp_mask=mtp_mask)
        return counter.summary(), result, {"ops": dict(counter.op_counts()), "by origin": dict(counter.ops),
                                           "files": dict(counter.op_files)}

    out = {"first": counted(), "warm": counted()}
    counted(microbatch("uneven", labels=False))  # RoPE's cache of the full-length rows' frequencies filled
    out["bshd"] = counted(microbatch("uneven", labels=False))  # full-length rows, CP-sliced by Megatron's layout
    with checks_mode("full"):
        out["full"] = counted()
    # stock runs the padded flavour (the real-lengths one needs mtp-packed-roll), keeping only the
    # scatter a model that does not scatter its embedding needs under SP (without it: a crash)
    mtp_overlay.uninstall()
    mtp_overlay.install(only=["mtp-sp-scatter"] if model_name in parity.NOT_SCATTERING else [])
    # stock is given the mask as its loss_mask (it ignores a scope): the same masked MTP loss
    out["stock"] = counted(parity.packed_row(pad_multiple, "padded").microbatch(labels=False), "explicit")
    out["stock bshd"] = counted(microbatch("uneven", labels=False), "explicit")
    steps = {key: (summary, result.grads, result.mtp_tokens, ops) for key, (summary, result, ops) in out.items()}
    return {**steps, "longest assert message": longest_assert_message()}


def step_times(model_name, pad_multiple, repeats, **overrides):
    """Rank worker: the packed row's step, every fix installed (real lengths, mask scoped) and stock
    (padded, mask given), alternating every repetition, each switch followed by an untimed step;
    ``{"overlay": median s, "stock": median s}``."""
    import statistics
    import time

    import mtp_overlay

    from . import parity
    from .megatron_step import MegatronStep

    mtp_overlay.uninstall()
    step = MegatronStep(parity.build(model_name, **overrides), optimizer=None)
    sides = {"overlay": (parity.packed_row(pad_multiple, "unpadded"), "scoped", None),
             "stock": (parity.packed_row(pad_multiple, "padded"), "explicit", [])}
    times = {side: [] for side in sides}
    for index in range(2 * repeats + 4):
        side = "overlay" if index % 2 else "stock"
        row, route, fixes = sides[side]
        mtp_overlay.uninstall()
        mtp_overlay.install(only=fixes)
        rows = [row.microbatch(labels=False)]
        step.step(rows, labels=False, update=False, mtp_mask=route)  # untimed: the switch's own cost
        start = time.perf_counter()
        step.step(rows, labels=False, update=False, mtp_mask=route)
        if index >= 4:  # warm-up steps are not counted
            times[side].append(time.perf_counter() - start)
    mtp_overlay.install()
    return {side: statistics.median(values) for side, values in times.items()}


def run(layout):
    """`step_reads` of every rank of ``layout`` (a key of `LAYOUTS`), on the shared rank pools."""
    from ..runtime.launcher import run_ranks_checked
    from .parity import PARALLELISMS

    spec = PARALLELISMS[layout]
    model, sequence_parallel = LAYOUTS[layout]
    return run_ranks_checked(step_reads, spec["world_size"], tp=spec["tp"], cp=spec["cp"], fixes=None,
                             args=(model, sequence_parallel, spec["pad_multiple"]), timeout=600)
