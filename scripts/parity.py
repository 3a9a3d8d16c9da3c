"""Print the parity table: model x layout x parallelism -> LM loss, MTP loss, max |dgrad| vs the reference,
stock megatron-core and with the overlay's megatron-core fixes on; or (--compose) the composition table.

Models: tiny GPT, tiny HybridModel (and scatter=False), Bridge-built NemotronH, and the zoo model (MoE
layers, the Super recipe's MTP) built directly and by Bridge, with the MoE aux loss off (per-sequence
reference) and on (BSHD, against TP1; the notes under the table say which comparisons hold).
Parallelisms: TP1, CP2, TP2+SP, TP2xCP2+SP, for the MoE models EP2 and TP2xEP2+SP, for the tiny models
PP2 and TP2xPP2+SP (Megatron's pipelined schedule).

Megatron's own training step (DDP, get_forward_backward_func, finalize_model_grads), RL forward
(labels=None) with a response-only loss mask, per-token 3-output loss; one rank pool per parallelism
(mtp_overlay.bed.engines.parity). References: BSHD at TP1; for packed THD rows each sequence alone,
unpacked, at TP1. --compose: HybridModel on the unpadded THD row (NeMo-RL's
model_slices_context_parallel_inputs flavour), every subset that matters of the megatron-core fixes,
MTP-block / rest-of-model gradient relerr against each sequence alone at TP1; and the zoo with the MoE
aux loss on (BSHD) with and without mtp-moe-router and mtp-cp-loss-scale, against the TP1 step with
its MTP block's MoE layers flagged by hand.
Usage: PYTHONPATH=$PWD python scripts/parity.py [--compose] [--no-bridge] [--model M ...] [--parallelisms P,P]
[--log FILE]
"""

import argparse
import os
import tempfile
import time

from mtp_overlay.bed.engines import parity
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compose", action="store_true", help="print the composition table instead")
    parser.add_argument("--no-bridge", action="store_true",
                        help="leave out the NemotronH HybridModel built by Megatron-Bridge's provider (its import "
                             "costs ~15 s a rank; left out anyway when megatron-bridge is not installed)")
    parser.add_argument("--model", action="append", choices=parity.MODELS, metavar="MODEL",
                        help=f"a model of the parity table to run (repeatable; default: all of "
                             f"{', '.join(repr(model) for model in parity.MODELS)})")
    parser.add_argument("--parallelisms", default=",".join(parity.PARALLELISMS),
                        help=f"comma-separated rows of the parity table to run (default: all of "
                             f"{', '.join(parity.PARALLELISMS)}; the TP1 references always run)")
    parser.add_argument("--log", help="file for the ranks' output (default: a temporary file)")
    options = parser.parse_args()
    parallelisms = tuple(name for name in options.parallelisms.split(",") if name)
    unknown = [name for name in parallelisms if name not in parity.PARALLELISMS]
    if unknown or not parallelisms:
        parser.error(f"--parallelisms: {', '.join(unknown) or 'none given'}; known: {', '.join(parity.PARALLELISMS)}")
    bridge = not options.no_bridge and bridge_installed()
    log = options.log or os.path.join(tempfile.mkdtemp(prefix="mtp-parity-"), "ranks.log")
    started = time.perf_counter()
    if options.compose:
        print(parity.composition_markdown(*parity.run_composition(log=log)))
    else:
        models = [model for model in options.model or parity.MODELS if bridge or model not in parity.BRIDGE_MODELS]
        if not models:
            parser.error(f"--model: {', '.join(options.model)} needs Megatron-Bridge ({BRIDGE_MISSING})")
        rows = parity.parity_table(models, parallelisms, log=log)
        print(parity.markdown(rows))
        notes = parity.notes_markdown(rows)
        if notes:
            print("\n" + notes)
        if not bridge:
            print(f"\n(no Megatron-Bridge model: {'--no-bridge' if options.no_bridge else BRIDGE_MISSING})")
    print(f"\noverlay: {', '.join(parity.megatron_core_fixes())}; {time.perf_counter() - started:.0f} s "
          f"(ranks' output: {log})")


if __name__ == "__main__":
    main()
