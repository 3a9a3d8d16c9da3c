"""The model of a verify plan: the user's config read as transformers reads a model folder, the
Megatron-Bridge provider it gives (or the user's own, by module path), its description for the product to
shrink, its family, and whether the test bed can build it (`PlanError` naming what it cannot).

Part of verify's engine (`verify`), in its child process."""

import importlib
import json
import os


class PlanError(ValueError):
    """A plan the test bed cannot run (a family Bridge cannot build, a layer without a CPU stand-in):
    returned to the product as its message, never a traceback."""


# --- the model ---------------------------------------------------------------------------------
def hf_config(values):
    """A transformers config of ``values`` (a config.json's dict, ``model_type`` included), read as
    transformers reads a model folder: saved as ``config.json`` and loaded by
    ``AutoConfig.from_pretrained`` (its own decoding: ``{"__float__": "Infinity"}`` is inf, a list where
    the class wants a tuple is taken, as for a downloaded model); a Nemotron VL / Omni config (its
    language model's config in ``llm_config``) as `multimodal_hf_config`."""
    import tempfile

    from transformers import AutoConfig

    if isinstance(values.get("llm_config"), dict):
        return multimodal_hf_config(values)
    model_type = values.get("model_type")
    if not model_type:
        raise PlanError("the config has no model_type: transformers cannot tell which family it is")
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-config-") as folder:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(values, handle)
        try:
            return AutoConfig.from_pretrained(folder)
        except Exception as error:  # noqa: BLE001 - transformers' refusal of the config, named
            raise PlanError(f"transformers cannot read a {model_type!r} config: {type(error).__name__}: "
                            f"{error}") from None


def multimodal_hf_config(values):
    """A Nemotron VL / Omni config as the model folder's own configuration class (``trust_remote_code``)
    gives it to ``AutoBridge``: its top-level keys on a ``PretrainedConfig``, ``llm_config`` a
    transformers config of its ``model_type`` (`hf_config`), ``vision_config`` a ``PretrainedConfig``
    (Bridge reads its attributes, ``nemotron_omni_bridge.py:139-143``). The folder's code is not run."""
    from transformers import PretrainedConfig

    values = dict(values)
    llm, vision = values.pop("llm_config"), values.pop("vision_config", None)
    values.pop("model_type", None)  # a class attribute of the folder's own config class, not an argument
    config = PretrainedConfig(**values)
    config.llm_config = hf_config(llm)
    config.vision_config = None if vision is None else PretrainedConfig(**{k: v for k, v in vision.items()
                                                                          if k != "model_type"})
    return config


# llm_config keys Megatron-Bridge 0.6's NemotronH bridge maps (nemotronh/nemotron_h_bridge.py:233-246,
# 300-303) and its Nemotron VL / Omni bridges do not (nemotron_vl_bridge.py:42-45, nemotron_omni_bridge.py:
# 60-71): HF key -> provider field. Without the MTP pattern the HybridModel builds no MTP block at all
# (megatron-core models/hybrid/hybrid_model.py:215-228) though mtp_num_layers says otherwise.
VL_BRIDGE_GAPS = {"mtp_hybrid_override_pattern": "mtp_hybrid_override_pattern",
                  "mtp_use_repeated_layer": "mtp_use_repeated_layer", "chunk_size": "mamba_chunk_size"}


def provided(model):
    """(the Megatron-Bridge provider (not finalized) the plan's ``model`` describes, the fields set on it
    beyond what Bridge mapped: one ``{"field", "bridge", "set", "why"}`` per field)."""
    from ..models.bridge import import_bridge

    import_bridge()
    if model["kind"] == "hf-config":
        from megatron.bridge import AutoBridge

        config = hf_config(model["config"])
        architecture = _named_architecture(config)
        try:
            bridge = AutoBridge.from_hf_config(config)
        except ValueError as error:
            import megatron.bridge

            version = megatron.bridge.__version__
            raise PlanError(f"Megatron-Bridge {version} cannot build this config: {error}") from None
        provider = bridge.to_megatron_provider(load_weights=False)
    else:
        provider = resolve_provider(model["path"])
    for name, value in model.get("overrides", {}).items():
        setattr(provider, name, value)
    settings = [architecture] if model["kind"] == "hf-config" and architecture else []
    if model["kind"] == "hf-config" and is_multimodal(provider):
        # read off transformers' config of the llm_config: a saved NemotronHConfig holds the MTP pattern as
        # mtp_layers_block_type, its property mtp_hybrid_override_pattern gives the symbols
        llm, bridged = config.llm_config, type(provider).__name__
        for key, field in VL_BRIDGE_GAPS.items():
            value = getattr(llm, key, None)
            if value is not None and getattr(provider, field, None) != value:
                settings.append(dict(field=field, bridge=getattr(provider, field, None), set=value,
                                     why=f"llm_config's {key}, which Megatron-Bridge's bridge of {bridged} does not "
                                         "map (a training recipe must set it)"))
                setattr(provider, field, value)
    for name, value in (model.get("multimodal") or {}).items():
        if hasattr(provider, name) and getattr(provider, name) != value:
            settings.append(dict(field=name, bridge=getattr(provider, name), set=value, why=MULTIMODAL_WHY[name]))
            setattr(provider, name, value)
    return provider, settings


def _named_architecture(config):
    """A config saved without ``architectures`` (``NemotronHConfig(...).save_pretrained`` unless given
    one) names the causal-LM class transformers maps its ``model_type`` to, as a checkpoint's would:
    Megatron-Bridge picks its bridge by it. The setting made (`provided`'s shape), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    if getattr(config, "architectures", None) or name is None:
        return None
    config.architectures = [name]
    return dict(field="architectures (config.json)", bridge=None, set=[name],
                why=f"the config names none; Megatron-Bridge picks its bridge by it: the causal-LM class "
                    f"transformers maps model_type {config.model_type!r} to")


# provider fields a multimodal plan sets (``plan["model"]["multimodal"]``), and why
MULTIMODAL_WHY = {
    "sound_context_token_id": "no sound in the batches: an id no text token has (LLaVAModel takes every token "
                              "equal to it for a sound slot, llava_model.py:657-672; the provider's default is 0, the "
                              "padding id)",
}


def provider_of(model):
    """The Megatron-Bridge provider (not finalized) the plan's ``model`` describes (`provided`)."""
    return provided(model)[0]


def is_multimodal(provider):
    """Whether ``provider`` is one of Megatron-Bridge's Nemotron VL / Omni providers (LLaVAModel builders)."""
    from megatron.bridge.models.nemotron_omni import nemotron_omni_provider
    from megatron.bridge.models.nemotron_vl import nemotron_vl_provider

    return isinstance(provider, (nemotron_omni_provider.NemotronVLModelProvider,
                                 nemotron_vl_provider.NemotronVLModelProvider))


def resolve_provider(path):
    """The provider at ``path``: ``package.module:attribute`` or ``file.py:attribute``; the attribute a
    provider, a provider class (built with its defaults), or a function returning a provider or a
    recipe's ``ConfigContainer`` (its ``.model``)."""
    import importlib.util
    import inspect

    from megatron.bridge.models.model_provider import ModelProviderMixin

    where, _, name = path.rpartition(":")
    if not where or not name:
        raise PlanError(f"--provider must be MODULE:NAME or FILE.py:NAME, got {path!r}")

    def load():
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            if spec is None or spec.loader is None:
                raise ImportError(f"no Python file at {where}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(where)

    module = users_code(path, f"importing {where}", load)
    if not hasattr(module, name):
        raise PlanError(f"--provider {path}: {where} has no attribute {name!r}")
    found = getattr(module, name)
    if (inspect.isclass(found) and issubclass(found, ModelProviderMixin)) or (
            callable(found) and not isinstance(found, ModelProviderMixin)):
        found = users_code(path, f"{name}()", found)
    found = getattr(found, "model", found)
    if not isinstance(found, ModelProviderMixin):
        raise PlanError(f"--provider {path} gives a {type(found).__name__}, not a Megatron-Bridge model provider")
    return found


def users_code(path, what, call):
    """``call()``, the user's code behind ``--provider path``; PlanError naming the flag, ``what`` raised
    and the innermost line of the user's file where it did (else of the code it ran; none when it raised
    before running any: a missing module, a call with the wrong arguments), never a traceback."""
    import importlib
    import traceback

    try:
        return call()
    except Exception as error:  # noqa: BLE001 - the user's code: any error is theirs to see, named
        frames = traceback.extract_tb(error.__traceback__)
        file = os.path.abspath(path.rpartition(":")[0])
        theirs = [frame for frame in frames if os.path.abspath(frame.filename) == file] or [
            frame for frame in frames if frame.filename != __file__ and not frame.filename.startswith(
                ("<", os.path.dirname(importlib.__file__)))]
        if isinstance(error, SyntaxError) and error.filename:
            at = f" (at {error.filename}:{error.lineno})"
        else:
            at = f" (at {theirs[-1].filename}:{theirs[-1].lineno})" if theirs else ""
        raise PlanError(f"--provider {path}: {what} raised {type(error).__name__}: {error}{at}") from None


def describe(model):
    """Rank worker: the fields of the plan's provider that the product shrinks (`verification.shrink`; a
    VL / Omni provider's vision side too, `verification.vision`), its class and the model family it
    builds; or ``{"error": ...}``."""
    from ...verification import vision
    from ...verification.shrink import PROVIDER_FIELDS

    try:
        provider = provider_of(model)
        kind = family(provider)
        check_buildable(provider)
    except PlanError as error:
        return dict(error=str(error))
    fields = {}
    for name in PROVIDER_FIELDS + ((*vision.PROVIDER_FIELDS, "vision_model_type") if kind == "multimodal" else ()):
        value = getattr(provider, name, None)
        if value is None or isinstance(value, (bool, int, float, str)):
            fields[name] = value
    return dict(fields=fields, provider=type(provider).__name__, family=kind)


def family(provider):
    """"multimodal" (a Nemotron VL / Omni provider: LLaVAModel around a HybridModel, `is_multimodal`),
    "hybrid" (HybridModelProvider: HybridModel) or "gpt" (GPTModelProvider: GPTModel); PlanError else."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    if is_multimodal(provider):
        return "multimodal"
    if isinstance(provider, HybridModelProvider):
        return "hybrid"
    if isinstance(provider, GPTModelProvider):
        return "gpt"
    raise PlanError(
        f"the test bed builds GPTModelProvider and HybridModelProvider models on CPU; "
        f"this config's provider is {type(provider).__name__}"
    )


# the language model types for which LLaVAModel builds a HybridModel (llava_model.py:223-226; for any
# other type a GPTModel, :244)
HYBRID_LANGUAGE_MODELS = ("nemotron5-hybrid", "nemotron6-moe")


def check_buildable(provider):
    """PlanError naming what the test bed has no CPU stand-in for in this provider's model (or, for a
    VL / Omni provider, a language model type LLaVAModel builds no HybridModel for)."""
    from ..models.tiny_hybrid import SYMBOLS, UNSUPPORTED

    missing = []
    if getattr(provider, "multi_latent_attention", False):
        missing.append("multi-latent attention (MLA): the CPU attention stand-in is standard self-attention")
    for name in ("hybrid_layer_pattern", "mtp_hybrid_override_pattern"):
        pattern = getattr(provider, name, None) or ""
        for symbol in sorted(set(pattern) - set(SYMBOLS) - set("|/")):
            missing.append(f"layer {symbol!r} ({UNSUPPORTED.get(symbol, 'unknown')}) in {name} {pattern!r}")
    dispatcher = getattr(provider, "moe_token_dispatcher_type", None)
    if getattr(provider, "num_moe_experts", None) and dispatcher not in ("allgather", "alltoall"):
        missing.append(f"MoE token dispatcher {dispatcher!r} (DeepEP/HybridEP kernels): allgather and alltoall "
                       "run on CPU")
    if getattr(provider, "experimental_attention_variant", None):
        missing.append(f"attention variant {provider.experimental_attention_variant!r}")
    if missing:
        raise PlanError("no CPU stand-in in the test bed for: " + "; ".join(missing))
    kind = getattr(provider, "language_model_type", "") or ""
    if is_multimodal(provider) and not kind.startswith(HYBRID_LANGUAGE_MODELS):
        raise PlanError(f"{type(provider).__name__}.language_model_type is {kind!r}: LLaVAModel then builds a "
                        f"GPTModel from the provider's hybrid stack spec (llava_model.py:223-244); a Nemotron VL / "
                        f"Omni language model needs a type starting with {' or '.join(HYBRID_LANGUAGE_MODELS)} "
                        "(Bridge's HF import sets it)")
