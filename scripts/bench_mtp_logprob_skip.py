"""Time saved by mtp-logprob-skip in a logprob forward (no grad, train mode, labels=None), against stock.

One gloo rank (TP1, CPU) runs a no-grad forward of each model, alternating every repetition (ABBA order)
between the fix installed and uninstalled (stock), so machine drift hits both sides alike. Prints per
model the median forward time of each side, their ratio, the time saved, and the MTP block's share of
the stock forward, timed separately in the same stock forwards: from the MTP block's entry to the last
output-layer call (the main logits), i.e. the MTP layers, each depth's vocabulary GEMM and what
`process_mtp_loss` does with it. The saving should match that share.
Usage: PYTHONPATH=$PWD python scripts/bench_mtp_logprob_skip.py [repeats]  (default 20)
"""

import statistics
import sys

from mtp_overlay.bed.runtime.launcher import run_ranks_checked

FIX = "mtp-logprob-skip"
MODELS = {  # name -> (builder kind, model overrides, make_batch overrides)
    "zoo (M*E-/*E/*E, h64, vocab 128, 2x32 tokens)": ("zoo", dict(), dict()),
    "zoo (h256, vocab 8192, 4x256 tokens)": (
        "zoo", dict(hidden_size=256, vocab_size=8192, max_sequence_length=256),
        dict(batch_size=4, seq_length=256, vocab_size=8192)),
    "Bridge NemotronH zoo (h64, vocab 128, 2x32 tokens)": ("bridge", dict(), dict()),
}


def interleaved_forwards(name, repeats):
    """Rank worker: {stock, fixed: median seconds, share: the MTP block's median share} of model ``name``."""
    import time

    import torch

    import mtp_overlay
    from mtp_overlay.bed.models.bridge import build_bridge_model
    from mtp_overlay.bed.models.tiny_gpt import make_batch
    from mtp_overlay.bed.models.tiny_hybrid import build_zoo

    kind, overrides, batch_size = MODELS[name]
    model = (build_zoo(**overrides) if kind == "zoo" else build_bridge_model("nemotron_h_zoo")).train()
    batch = make_batch(**batch_size)
    marks = {}
    model.mtp.register_forward_pre_hook(lambda *_: marks.__setitem__("mtp", time.perf_counter()))
    model.mtp.layers[0].register_forward_pre_hook(lambda *_: marks.__setitem__("layer", time.perf_counter()))
    model.output_layer.register_forward_pre_hook(lambda *_: marks.__setitem__("output", time.perf_counter()))
    times, shares = {"stock": [], "fixed": []}, []
    for index in range(2 * repeats + 4):
        side = "fixed" if index % 4 in (1, 2) else "stock"  # ABBA: neither side always runs second
        mtp_overlay.uninstall(only=[FIX])
        if side == "fixed":
            mtp_overlay.install(only=[FIX])
        marks.clear()
        start = time.perf_counter()
        with torch.no_grad():
            model(batch["input_ids"], batch["position_ids"], None)
        elapsed = time.perf_counter() - start
        if index < 4:  # warm-up forwards are not counted
            continue
        times[side].append(elapsed)
        if side == "stock":
            shares.append((marks["output"] - marks["mtp"]) / elapsed)
        else:
            assert "layer" not in marks, "the fix ran an MTP layer"
    stock, fixed = (statistics.median(times[side]) for side in ("stock", "fixed"))
    mtp_overlay.uninstall(only=[FIX])
    return dict(stock=stock, fixed=fixed, share=statistics.median(shares))


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    # one fresh rank per model: each build sets the attention backend's environment its own way
    report = {name: run_ranks_checked(interleaved_forwards, 1, args=(name, repeats), fixes=[])[0] for name in MODELS}
    print(f"no-grad forward (train mode, labels=None), TP1 CPU, median of {repeats} per side, interleaved ABBA")
    print(f"{'model':54} {'stock ms':>9} {'fixed ms':>9} {'ratio':>6} {'saved':>6} {'MTP share':>9}")
    for name, row in report.items():
        ratio = row["fixed"] / row["stock"]
        print(f"{name:54} {row['stock'] * 1e3:9.2f} {row['fixed'] * 1e3:9.2f} {ratio:6.3f} "
              f"{1 - ratio:6.1%} {row['share']:9.1%}")


if __name__ == "__main__":
    main()
