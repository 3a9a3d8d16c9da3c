"""vllm-mtp-drafter-load with the fix off: vLLM's NemotronHMTP takes a refit in positional naming and says nothing.

Builds the installed vLLM's real drafter on CPU (`mtp_overlay.testing.vllm_drafter`) in a fresh
stock interpreter (no fix installed; vLLM's process-group state stays out of the caller), feeds its
``load_weights`` the MTP head named ``model.layers.<num_hidden_layers>.*``, and checks what it did.
"""

import json
import os

_SCRIPT = "from mtp_overlay.testing.reproducers.vllm_mtp_drafter_load import _run; _run()"


def reproduce():
    """(bug shows, evidence): the stock drafter returned normally, loaded no MTP parameter, kept its values."""
    from ..preloaded import run_python

    result = run_python(_SCRIPT, dict(os.environ), timeout=900, fixes=[])
    if result.returncode != 0:
        raise RuntimeError(f"the reproducer's interpreter failed:\n{result.stderr[-3000:]}")
    found = json.loads(result.stdout.strip().splitlines()[-1])
    shows = found["error"] is None and not found["loaded"] and not found["changed"]
    evidence = (
        f"vLLM {found['version']} NemotronHMTP.load_weights on {found['sent']} positional MTP names: "
        + (f"raised {found['error']}" if found["error"] else
           f"returned normally, loaded {len(found['loaded'])} of {found['parameters']} MTP parameters "
           f"({', '.join(found['loaded']) or 'none'}), {len(found['changed'])} changed, nothing said")
    )
    return shows, evidence


def _run():
    import warnings

    warnings.simplefilter("ignore")
    import vllm

    from ..vllm_drafter import build_drafter, changed, drafter_environment, refit_stream, snapshot

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
    print(json.dumps(found))
