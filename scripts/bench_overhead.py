"""Cost of the installed overlay on the tiny MTP step and on the MoE step, against stock, in one process.

One gloo rank (TP1) and two (TP2 + sequence parallel) run forward+backward of the test bed's tiny
GPT with one MTP layer, alternating every repetition between the overlay installed (every fix's
wrappers on megatron-core) and uninstalled (stock), so machine drift hits both sides alike. After
each switch one step runs untimed: a process installs the overlay once, so what a switch costs
(CPython re-specialising the code whose classes and globals it patched) is not the overlay's.
Prints the median step time of each side and their ratio (goal <= 1.01), and the host reads (device
syncs on a GPU) of one step of each side by who made them (`mtp_overlay.bed.runtime.syncs`; the step's
own logging, ``mtp_overlay.mtp.mtp_metrics``, reads the logged numbers on both sides): the
installed overlay must add none in the default mode; ``--checks full`` shows what
``MTP_OVERLAY_CHECKS=full`` adds.

The MoE step: the zoo HybridModel (Mamba, attention, MoE, MLP; the Super recipe's MTP ``"*E"`` at 2
depths, one repeated layer; MoE aux loss on) through Megatron's own step (DDP, the schedule,
``finalize_model_grads``; RL forward, per-token loss), one model built stock and one built with the
overlay installed (mtp-moe-router's hook acts while the model is built), four sides per round in
rotating order, each switch followed by an untimed step as above: stock, the second model with no
fix installed (what the model instance alone costs: the same code as stock), with mtp-moe-router
alone, with the whole overlay. Then which of mtp-moe-router's functions ran while its model was
built and over its steps (counted with ``sys.setprofile``), and their own time per step (cProfile):
a build-time and a logging-only hook show up as calls per build and per router logging call, nothing
per token. For the MoE step it prints each side's median, its ratio, the median of its ratios to the
same round's stock step, and the ratios of the rank's median CPU time per step (one torch thread a
rank: other processes' load stays out of it more than out of wall time).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_overhead.py [REPEATS [MOE_REPEATS]] [--checks full]
"""

import argparse
import statistics

from mtp_overlay.bed.runtime.launcher import run_ranks_checked

MOE_MODEL = "zoo, aux loss"  # bed.engines.parity's zoo with the MoE aux loss on
FIX = "mtp-moe-router"
PROFILED_STEPS = 20
MODEL_ONLY = "its model, no fix"  # the MoE step's side: the overlay-built model stepped by stock code


def interleaved_steps(repeats, checks=None):
    import time

    from megatron.core import parallel_state

    import mtp_overlay
    from mtp_overlay.bed.runtime.syncs import SyncCounter, checks_mode
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch, train_step

    model = build_tiny_gpt(sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1)
    batch = make_batch(batch_size=4, seq_length=64)
    times = {"stock": [], "overlay": []}
    reads = {}
    with checks_mode(checks):
        for index in range(2 * repeats + 4):
            side = "overlay" if index % 2 else "stock"
            mtp_overlay.uninstall()
            if side == "overlay":
                mtp_overlay.install()
            train_step(model, batch)  # untimed: a switch's own cost (the interpreter re-specialising the patched code)
            start = time.perf_counter()
            train_step(model, batch)
            if index >= 4:  # warm-up steps are not counted
                times[side].append(time.perf_counter() - start)
        for side in ("stock", "overlay"):  # one more step each, its host reads counted
            mtp_overlay.uninstall()
            if side == "overlay":
                mtp_overlay.install()
            with SyncCounter() as counted:
                train_step(model, batch)
            sites = sorted({f"{event.file.rsplit('/', 2)[-2]}/{event.file.rsplit('/', 1)[-1]}:{event.function}"
                            for event in counted.of("overlay")})
            reads[side] = (counted.by_origin(), sites)
    mtp_overlay.install()
    return {side: statistics.median(values) for side, values in times.items()}, reads


def _own_seconds(profile, folder):
    """{function name: own seconds} of the functions defined under ``folder`` in a cProfile."""
    import pstats

    return {name: own for (filename, _, name), (_, _, own, *_) in pstats.Stats(profile).stats.items()
            if filename.startswith(folder)}


def interleaved_moe_steps(repeats):
    """Rank worker: the zoo's step on four sides in rotating order each round (stock; the overlay's
    model with no fix installed; mtp-moe-router alone; the whole overlay), their medians and each side's
    median ratio to the same round's stock step; and mtp-moe-router's functions that ran while its
    model was built and over its steps."""
    import cProfile
    import os
    import time

    from megatron.core import parallel_state

    import mtp_overlay
    from mtp_overlay.fixes import mtp_moe_router
    from mtp_overlay.bed.steps import moe
    from mtp_overlay.bed.engines import parity
    from mtp_overlay.bed.steps.megatron_step import MegatronStep

    sp = parallel_state.get_tensor_model_parallel_world_size() > 1
    folder = os.path.dirname(mtp_moe_router.__file__)
    mtp_overlay.uninstall()
    stock = MegatronStep(parity.build(MOE_MODEL, sequence_parallel=sp), optimizer=None)
    mtp_overlay.install()
    with moe.FunctionCalls(folder) as build:
        built = parity.build(MOE_MODEL, sequence_parallel=sp)
    overlay = MegatronStep(built, optimizer=None)
    batch = [parity.microbatch(parity.Case(MOE_MODEL, "bshd"))]
    sides = {"stock": (stock, []), MODEL_ONLY: (overlay, []), FIX: (overlay, [FIX]),
             "overlay": (overlay, None)}  # None: every fix
    times, cpu = {side: [] for side in sides}, {side: [] for side in sides}
    for round_ in range(repeats + 2):
        order = list(sides)[round_ % len(sides):] + list(sides)[: round_ % len(sides)]
        for side in order:
            step, fixes = sides[side]
            mtp_overlay.uninstall()
            mtp_overlay.install(only=fixes)
            step.step(batch, labels=False, update=False)  # untimed: the switch's own cost
            start, start_cpu = time.perf_counter(), time.process_time()
            step.step(batch, labels=False, update=False)
            if round_ >= 2:  # warm-up rounds are not counted
                times[side].append(time.perf_counter() - start)
                cpu[side].append(time.process_time() - start_cpu)
    mtp_overlay.install()
    with moe.FunctionCalls(folder) as steps:
        for _ in range(PROFILED_STEPS):
            overlay.step(batch, labels=False, update=False)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(PROFILED_STEPS):
        overlay.step(batch, labels=False, update=False)
    profile.disable()
    paired = {side: statistics.median(t / s for s, t in zip(times["stock"], times[side])) for side in sides}
    return dict(medians={side: statistics.median(values) for side, values in times.items()}, paired=paired,
                cpu={side: statistics.median(values) for side, values in cpu.items()}, build=build.calls,
                steps=steps.calls, own=_own_seconds(profile, folder))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repeats", nargs="?", type=int, default=150)
    parser.add_argument("moe_repeats", nargs="?", type=int, default=40)
    parser.add_argument("--checks", choices=("default", "full"), default=None,
                        help="MTP_OVERLAY_CHECKS for the ranks (default: the caller's)")
    args = parser.parse_args()
    for label, world, tp in (("TP1", 1, 1), ("TP2+SP", 2, 2)):
        medians, reads = run_ranks_checked(interleaved_steps, world, tp=tp, args=(args.repeats, args.checks),
                                           fixes=None)[0]
        print(f"{label:7s} tiny GPT+MTP fwd+bwd: stock {medians['stock'] * 1e3:.2f} ms, "
              f"overlay {medians['overlay'] * 1e3:.2f} ms, ratio {medians['overlay'] / medians['stock']:.3f} "
              f"(median of {args.repeats} interleaved)")
        for side in ("stock", "overlay"):
            counts, sites = reads[side]
            listed = ", ".join(f"{origin} {count}" for origin, count in counts.items())
            print(f"        host reads of one {side} step (device syncs on a GPU), rank 0: {listed}"
                  + (f" (overlay: {', '.join(sites)})" if sites else ""))
        added = reads["overlay"][0]["overlay"] - reads["stock"][0]["overlay"]
        print(f"        added by the installed overlay: {added} host read(s) per step")
    for label, world, tp in (("TP1", 1, 1), ("TP2+SP", 2, 2)):
        found = run_ranks_checked(interleaved_moe_steps, world, tp=tp, args=(args.moe_repeats,), fixes=None,
                                  timeout=3600)[0]
        medians, paired = found["medians"], found["paired"]
        print(f"{label:7s} zoo MoE+MTP Megatron step: stock {medians['stock'] * 1e3:.2f} ms; "
              + "; ".join(f"{side} {medians[side] * 1e3:.2f} ms, ratio {medians[side] / medians['stock']:.3f}, "
                          f"paired {paired[side]:.3f}" for side in (MODEL_ONLY, FIX, "overlay"))
              + f" (medians of {args.moe_repeats} rounds, sides in rotating order)")
        print("        the rank's CPU time (one torch thread a rank: less of the machine's load in it): stock "
              f"{found['cpu']['stock'] * 1e3:.2f} ms; "
              + "; ".join(f"{side} ratio {found['cpu'][side] / found['cpu']['stock']:.3f}"
                          for side in (MODEL_ONLY, FIX, "overlay")))
        build = ", ".join(f"{name} {count}" for name, count in sorted(found["build"].items())) or "none"
        own = {name: seconds / PROFILED_STEPS * 1e6 for name, seconds in found["own"].items()}
        step = ", ".join(f"{name} {count / PROFILED_STEPS:g} ({own.get(name, 0):.1f} us own)"
                         for name, count in sorted(found["steps"].items())) or "none"
        print(f"        mtp-moe-router calls per build: {build}; per step: {step}")


if __name__ == "__main__":
    main()
