"""vllm-mtp-drafter-load with the fix off: vLLM's NemotronHMTP takes a refit in positional naming and
says nothing, and a target weight-update session leaves it stale and says nothing.

In a fresh stock interpreter (no fix installed; vLLM's process-group state stays out of the caller):
the installed vLLM's real drafter built on CPU (`mtp_overlay.bed.steps.vllm_drafter`) is fed the MTP
head named ``model.layers.<num_hidden_layers>.*``; then vLLM's own Worker sessions
(`mtp_overlay.bed.steps.vllm_worker`) run two target refits carrying the head in ``mtp.*`` names.
"""

import json
import os

_SCRIPT = "from mtp_overlay.bed.fixes.vllm_mtp_drafter_load import _run; _run()"


def reproduce():
    """(bug shows, evidence): the stock drafter returned normally from a positional refit, loaded no MTP
    parameter and kept its values; or target sessions carrying the MTP head changed none of the
    drafter's parameters, and nothing was said."""
    from ..runtime.preloaded import run_python

    result = run_python(_SCRIPT, dict(os.environ), timeout=900, fixes=[])
    if result.returncode != 0:
        raise RuntimeError(f"the reproducer's interpreter failed:\n{result.stderr[-3000:]}")
    found = json.loads(result.stdout.strip().splitlines()[-1])
    naming = found["error"] is None and not found["loaded"] and not found["changed"]
    evidence = (
        f"vLLM {found['version']} NemotronHMTP.load_weights on {found['sent']} positional MTP names: "
        + (f"raised {found['error']}" if found["error"] else
           f"returned normally, loaded {len(found['loaded'])} of {found['parameters']} MTP parameters "
           f"({', '.join(found['loaded']) or 'none'}), {len(found['changed'])} changed, nothing said")
    )
    stale, said = _target_sessions(found["target_refits"])
    return naming or stale, f"{evidence}; {said}"


def _target_sessions(steps):
    """(the drafter stayed stale silently, what the target sessions did)."""
    failed = [step["error"] for step in steps if step["error"]]
    if failed:
        return False, f"the target sessions failed: {failed}"
    first = steps[0]
    drafter = max(len(step["drafter_changed"]) for step in steps)
    warned = any(step["said"] for step in steps)
    stale = drafter == 0 and not warned and all(step["target_changed"] for step in steps)
    return stale, (f"{len(steps)} target sessions ({first['engine']}) carrying the {len(first['mtp_sent'])} mtp.* "
                   f"tensors changed {len(first['target_changed'])} target and {drafter} of "
                   f"{len(first['drafter_parameters'])} drafter parameters, {'warned' if warned else 'nothing said'}")


def _run():
    import warnings

    warnings.simplefilter("ignore")
    import vllm

    from ..steps.vllm_drafter import build_drafter, changed, drafter_environment, refit_stream, snapshot

    with drafter_environment():
        model = build_drafter("nemotron_h")
        parameters = [name for name, _ in model.named_parameters() if name.startswith("model.layers.")]
        stream = refit_stream(model, "positional", seed=1, with_target_names=False)
        before = snapshot(model)
        try:
            loaded, error = model.load_weights(iter(stream)), None
        except Exception as exc:  # a loud failure is not the silent skip this reproduces
            loaded, error = set(), f"{type(exc).__name__}: {exc}"
        found = {"version": vllm.__version__, "sent": len(stream), "parameters": len(parameters),
                 "loaded": sorted(set(loaded) & set(parameters)), "changed": changed(model, before), "error": error}
    from ..steps.vllm_worker import SEQUENCES, run_sequence, worker_environment

    with worker_environment() as bed:
        steps = run_sequence(bed, SEQUENCES["target, target"])
        found["target_refits"] = [{"engine": step.engine, "error": step.error, "mtp_sent": step.mtp_sent,
                                   "target_changed": step.target_changed, "drafter_changed": step.drafter_changed,
                                   "drafter_parameters": step.drafter_parameters, "said": step.said} for step in steps]
    print(json.dumps(found))
