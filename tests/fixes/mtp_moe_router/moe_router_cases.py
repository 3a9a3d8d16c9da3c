"""mtp-moe-router's rank workers and shared facts, for its tests and for scripts run on megatron-core copies.

A module of its own (not a test module) so that a script run with another megatron-core first on the
path imports the same workers (``sys.path`` gets this folder) and ranks unpickle them by this name.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from mtp_overlay.bed.engines import parity

FIX = "mtp-moe-router"
FIX_DIR = str(Path(__file__).resolve().parents[3] / "mtp_overlay" / "fixes" / "mtp_moe_router")
TWO_BACKBONE = "*E*E/*E"  # Megatron-LM #7172's pattern: backbone MoE at layers 2 and 4, one MTP depth
# stock (built and stepped without the overlay), flagged by hand (the reference), the overlay
VARIANTS = {"stock": ((), False), "flagged": ((), True), "overlay": ((FIX,), False)}


def aux_step(model, sp):
    """Rank worker: the aux-loss-only step of ``model`` (a parity model name) stock, flagged and with the
    overlay; per variant the MTP and backbone router gradients, the logged slots, the losses, what the
    MTP block's MoE layers say, and which of the fix's functions ran while building and stepping."""
    import mtp_overlay
    from mtp_overlay.bed.steps import moe
    from mtp_overlay.bed.steps.megatron_step import MegatronStep

    out = {}
    for variant, (fixes, flag) in VARIANTS.items():
        mtp_overlay.uninstall()
        mtp_overlay.install(only=list(fixes))
        with moe.FunctionCalls(FIX_DIR) as build:
            built = parity.build(model, sequence_parallel=sp, mtp_moe_flag=flag)
        step = MegatronStep(built, optimizer=None)
        with moe.FunctionCalls(FIX_DIR) as stepped:
            measured = moe.aux_loss_gradients(step, [parity.microbatch(parity.Case(model, "bshd"))], labels=False)
        language_model = step.language_model
        layers = []
        for name, layer in moe.mtp_moe_layers(language_model):
            owner = language_model.get_submodule(name.rpartition(".")[0])
            layers.append(dict(flags=[owner.is_mtp_layer, layer.is_mtp_layer, layer.router.is_mtp_layer],
                               depth=vars(layer.router).get("mtp_depth"), number=layer.router.layer_number))
        out[variant] = dict(mtp=measured.mtp, backbone=measured.backbone, slots=measured.slots, layers=layers,
                            losses=(measured.step.lm_loss, measured.step.mtp_losses), build=build.calls,
                            step=stepped.calls)
    mtp_overlay.uninstall()
    return out


def two_backbone_moe(fixes, replay=False):
    """Rank worker: ``"*E*E/*E"`` (aux and z loss on) through Megatron's step with ``fixes``: the step's
    MTP router gradient and slots, or the error; with ``replay`` (built with routing replay, no step)
    the router replay instances in their order."""
    import mtp_overlay
    from mtp_overlay.bed.steps import moe
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.tiny_gpt import make_batch
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid

    mtp_overlay.uninstall()
    mtp_overlay.install(only=list(fixes))
    settings = dict(moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="allgather", moe_enable_routing_replay=replay)
    facts = {}
    if replay:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
    model = build_tiny_hybrid(hybrid_layer_pattern=TWO_BACKBONE, **settings)
    if replay:
        routers = {id(module.router_replay): (name, module) for name, module in model.named_modules()
                   if getattr(module, "router_replay", None) is not None}
        facts["replay"] = [dict(name=routers[id(r)][0], layer_number=r.layer_number,
                                is_mtp_layer=routers[id(r)][1].is_mtp_layer,
                                depth=vars(routers[id(r)][1]).get("mtp_depth"))
                           for r in RouterReplay.global_router_replay_instances]
        RouterReplay.clear_global_router_replay_instances()
        mtp_overlay.uninstall()
        return facts
    try:
        measured = moe.aux_loss_gradients(MegatronStep(model, optimizer=None), [make_batch()])
        facts.update(mtp=measured.mtp, slots=measured.slots, error=None)
    except Exception as error:  # noqa: BLE001 - upstream's crash is the result
        facts["error"] = f"{type(error).__name__}: {error}"
        facts["where"] = _innermost(error)
    mtp_overlay.uninstall()
    return facts


def _innermost(error):
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{'/'.join(Path(frame.filename).parts[-4:])}:{frame.lineno}"


def router_classes():
    """Rank worker: which router classes log by depth (stock, hooked, one overriding the logging), and
    what the build hook does with an MTP router of a class that overrides it: warns, leaves it."""
    import warnings

    import mtp_overlay
    from megatron.core.transformer.moe.router import TopKRouter

    from mtp_overlay.fixes.mtp_moe_router import flag_moe_layers, logs_by_depth
    from mtp_overlay.bed.steps import moe

    class OwnLogging(TopKRouter):
        def attach_and_log_load_balancing_loss(self, *args, **kwargs):
            return super().attach_and_log_load_balancing_loss(*args, **kwargs)

    mtp_overlay.uninstall()
    facts = dict(stock=logs_by_depth(TopKRouter))
    model = parity.build("zoo, aux loss")
    (_, layer), = moe.mtp_moe_layers(model)
    mtp_overlay.install(only=[FIX])
    facts.update(hooked=logs_by_depth(TopKRouter), own=logs_by_depth(OwnLogging))
    layer.router.__class__ = OwnLogging
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts["own_flagged"] = len(flag_moe_layers(model.mtp.layers[0]))
    facts["warned"] = [str(warning.message) for warning in caught]
    facts["own_flags"] = [layer.is_mtp_layer, layer.router.is_mtp_layer]
    layer.router.__class__ = TopKRouter
    facts["flagged"] = len(flag_moe_layers(model.mtp.layers[0]))
    facts["flags"] = [layer.is_mtp_layer, layer.router.is_mtp_layer]
    mtp_overlay.uninstall()
    return facts


def facts_on(site, template, script):
    """Run ``template`` (its ``{tests}`` / ``{fix}`` filled in) as ``script`` with the megatron-core
    copy ``site`` first on the path; the JSON its last ``FACTS `` line prints."""
    Path(script).write_text(template.format(tests=str(Path(__file__).parent), fix=FIX))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("FACTS ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1][len("FACTS "):])
