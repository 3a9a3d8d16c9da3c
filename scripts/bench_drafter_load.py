"""Benchmark vllm-mtp-drafter-load: the cost per refit of accounting vLLM's MTP drafter loads.

Builds vLLM's real ``NemotronHMTP`` on CPU (test bed `mtp_overlay.testing.vllm_drafter`), tiny and
wide, and refits it with its own MTP head in checkpoint naming, stock (the unwrapped
``load_weights``) and fixed (the hooked one inside ``drafter_refit``: observation, accounting, the
report), interleaved pair by pair in one process. Each refit loads the stream in one call and in one
call per tensor (vLLM's unpacked NCCL path, the most calls). Prints per-refit medians, the median of
per-pair ratios (shared machines drift: back-to-back pairs cancel it), the fix's own microseconds
per refit and per name, and how many tensors the fix copied (goal 0: the drafter gets the very
tensor objects of the stream).

    .venv/bin/python scripts/bench_drafter_load.py [--repeats 41]
"""

import argparse
import inspect
import statistics
import time
import warnings

import mtp_overlay  # installs the fix on the drafter below
from mtp_overlay.fixes.vllm_mtp_drafter_load import drafter_refit
from mtp_overlay.testing.vllm_drafter import build_drafter, drafter_environment, refit_stream

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
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


if __name__ == "__main__":
    main()
