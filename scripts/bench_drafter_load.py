"""Benchmark vllm-mtp-drafter-load: the cost per refit of accounting vLLM's MTP drafter loads, and the
per-step cost of the freshness check.

Builds vLLM's real ``NemotronHMTP`` on CPU (test bed `mtp_overlay.bed.steps.vllm_drafter`), tiny and
wide, and refits it with its own MTP head in checkpoint naming, stock (the unwrapped
``load_weights``) and fixed (the hooked one inside ``drafter_refit``: observation, accounting, the
report), interleaved pair by pair in one process. Each refit loads the stream in one call and in one
call per tensor (vLLM's unpacked NCCL path, the most calls). Prints per-refit medians, the median of
per-pair ratios (shared machines drift: back-to-back pairs cancel it), the fix's own microseconds
per refit and per name, and how many tensors the fix copied (goal 0: the drafter gets the very
tensor objects of the stream).

Per step, while no report is owed, in nanoseconds per call, stock and hooked interleaved: vLLM's V1
``GPUModelRunner.execute_model`` (the real method, made with ``__new__`` and stopped by its own state
guard, its first statement: the exception's way out through one more frame is part of it); the hook
as installed (wrapt and the fix's wrapper) around a step that returns; and the check alone (the
fix's wrapper function around a no-op: the test of one module-level integer).

    .venv/bin/python scripts/bench_drafter_load.py [--repeats 41] [--steps 20000]
"""

import argparse
import inspect
import statistics
import time
import warnings

import mtp_overlay  # installs the fix on the drafter below
from mtp_overlay.fixes.vllm_mtp_drafter_load import drafter_refit
from mtp_overlay.bed.steps.vllm_drafter import build_drafter, drafter_environment, refit_stream

SHAPES = {
    "tiny (hidden 32)": {},
    "wide (hidden 2048)": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                               intermediate_size=4096, vocab_size=1024),
}


def timed(function, *args):
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def refit_stock(stock, model, stream, chunk):
    for start in range(0, len(stream), chunk):
        stock(model, iter(stream[start:start + chunk]))


def refit_fixed(model, stream, chunk):
    with drafter_refit(model):
        for start in range(0, len(stream), chunk):
            model.load_weights(iter(stream[start:start + chunk]))


def copies_made(stock, model, stream):
    """Pairs the drafter received that are not the stream's own objects (through the hook)."""
    seen = []

    def recording(self, weights):
        pairs = list(weights)
        seen.extend(pairs)
        return stock(self, iter(pairs))

    cls = type(model)
    wrapper = vars(cls)["load_weights"]
    wrapper.__wrapped__, original = recording, wrapper.__wrapped__
    try:
        with drafter_refit(model):
            model.load_weights(iter(stream))
    finally:
        wrapper.__wrapped__ = original
    return sum(a is not b or a[1] is not b[1] for a, b in zip(stream, seen)) + abs(len(stream) - len(seen))


def per_call(function, calls):
    """Seconds per call of ``function()`` over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls


def bench_step(repeats, calls):
    """The freshness check's per-step cost: on vLLM's real execute_model, and alone."""
    import wrapt
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker import gpu_model_runner

    from mtp_overlay.fixes.vllm_mtp_drafter_load import freshness

    hooked = vars(gpu_model_runner.GPUModelRunner)["execute_model"]
    stock = getattr(hooked, "__wrapped__", hooked)  # what vLLM defines there: torch.inference_mode's wrapper
    assert stock is not hooked, "the fix is not installed on GPUModelRunner.execute_model"
    assert freshness._due == 0, "a staleness report is owed: the step would look its runner up"
    runner = gpu_model_runner.GPUModelRunner.__new__(gpu_model_runner.GPUModelRunner)
    runner.execute_model_state = "set: vLLM's guard stops the step at its first statement"
    output = SchedulerOutput.make_empty()

    def step(method):
        def run():
            try:
                method(runner, output)
            except RuntimeError:
                pass
        return run

    def noop():
        return None

    def returning(self, scheduler_output):
        return None

    class Plain:
        execute_model = returning

    class Hooked:  # the fix's wrapper as it sits on the runner (wrapt), around a step that returns
        execute_model = wrapt.FunctionWrapper(returning, freshness.on_execute_model)

    bare, wrapped = Plain(), Hooked()
    cases = {
        "vLLM's V1 GPUModelRunner.execute_model, stopped by its guard (an exception through the hook)":
            (step(stock), step(hooked)),
        "the hook (wrapt + the check) around a step that returns":
            (lambda: bare.execute_model(output), lambda: wrapped.execute_model(output)),
        "the check alone (the fix's wrapper function around a no-op)":
            (noop, lambda: freshness.on_execute_model(noop, runner, (), {})),
    }
    for label, (without, fixed) in cases.items():
        pairs = [(per_call(without, calls), per_call(fixed, calls)) for _ in range(repeats)]
        plain_ns = statistics.median(p for p, _ in pairs) * 1e9
        fixed_ns = statistics.median(f for _, f in pairs) * 1e9
        own = statistics.median(f - p for p, f in pairs) * 1e9
        print(f"  {label}:\n      stock {plain_ns:7.0f} ns  hooked {fixed_ns:7.0f} ns  the fix's own {own:6.0f} ns per step")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--steps", type=int, default=20000, help="calls per timing of the per-step check")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    assert mtp_overlay.status(only=["vllm-mtp-drafter-load"])[0].state in ("pending", "installed")
    with drafter_environment():
        for label, overrides in SHAPES.items():
            model = build_drafter("nemotron_h", **overrides)
            stock = inspect.unwrap(vars(type(model))["load_weights"])
            assert stock is not vars(type(model))["load_weights"], "the fix is not installed on NemotronHMTP"
            stream = refit_stream(model, "mtp.*", seed=0)
            size = sum(t.numel() * t.element_size() for _, t in stream)
            print(f"{label}: {len(stream)} names, {size / 2**20:.2f} MiB per refit; "
                  f"tensors copied by the fix: {copies_made(stock, model, stream)}")
            for chunk, how in ((len(stream), "one call"), (1, "one call per tensor")):
                pairs = []
                for _ in range(args.repeats):
                    pairs.append((timed(refit_stock, stock, model, stream, chunk), timed(refit_fixed, model, stream, chunk)))
                stock_s = statistics.median(s for s, _ in pairs)
                fixed_s = statistics.median(f for _, f in pairs)
                ratio = statistics.median(f / s for s, f in pairs)
                own = fixed_s - stock_s
                print(f"  {how:20s} stock {stock_s * 1e6:9.1f} us  fixed {fixed_s * 1e6:9.1f} us  "
                      f"ratio {ratio:.3f}  the fix's own work {own * 1e6:7.1f} us per refit, "
                      f"{own * 1e6 / len(stream):5.2f} us per name")
    print(f"per step (freshness check, no report owed; median of {args.repeats} x {args.steps} calls):")
    bench_step(args.repeats, args.steps)


if __name__ == "__main__":
    main()
