"""Test scaffolding, not product: vLLM's real MTP drafters (NemotronHMTP, DeepSeekMTP) built on a CPU machine.

vLLM's wheels are CUDA builds; on a machine without a GPU they run on ``UnspecifiedPlatform``, which
names no attention backend, and every ``Attention`` / MLA layer asks its platform for one while it is
constructed. `cpu_attention_selection` lends ``UnspecifiedPlatform`` the selectors of vLLM's own
``CpuPlatform`` (``get_attn_backend_cls``, and ``get_mla_prefill_backend_cls`` where it exists) for
the duration: the one stand-in here. Nothing runs a forward pass; the drafters' ``__init__``,
``named_parameters`` and ``load_weights`` (with their real weight loaders) are vLLM's.

Usage::

    with drafter_environment():
        model = build_drafter("nemotron_h")      # or "deepseek"
        stream = refit_stream(model, "mtp.*")    # the checkpoint names of its MTP head, fresh tensors
        model.load_weights(iter(stream))

The configs are tiny: hidden 32, one MTP layer (NemotronH ``mtp_hybrid_override_pattern="*"``, one
attention layer; DeepSeek-V3 with MLA and a dense MLP, since vLLM's fused MoE has no CPU backend).
"""

import contextlib
import os
import tempfile

from ..runtime.device import rank_device

KINDS = ("nemotron_h", "deepseek")
BACKBONE = 2  # num_hidden_layers of both tiny configs: the MTP layer is layer 2 in positional naming


def tiny_config(kind, **overrides):
    """The transformers config of a tiny target model with one MTP layer (``overrides``: config fields)."""
    if kind == "nemotron_h":
        from transformers import NemotronHConfig

        fields = dict(
            vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            layers_block_type=["mamba", "attention"], intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8,
            n_groups=1, ssm_state_size=8, num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*",
            max_position_embeddings=64, architectures=["NemotronHForCausalLM"], torch_dtype="float32",
        )
        return NemotronHConfig(**{**fields, **overrides})
    if kind == "deepseek":
        from transformers import DeepseekV3Config

        fields = dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=BACKBONE,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=100, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_nextn_predict_layers=1,
            max_position_embeddings=64, architectures=["DeepseekV3ForCausalLM"], torch_dtype="float32",
        )
        return DeepseekV3Config(**{**fields, **overrides})
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


@contextlib.contextmanager
def cpu_attention_selection():
    """``UnspecifiedPlatform`` selects attention backends as vLLM's ``CpuPlatform`` does (construction only)."""
    from unittest import mock

    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import UnspecifiedPlatform

    with contextlib.ExitStack() as stack:
        for name in ("get_attn_backend_cls", "get_mla_prefill_backend_cls"):
            if name in vars(CpuPlatform):
                stack.enter_context(mock.patch.object(UnspecifiedPlatform, name, vars(CpuPlatform)[name]))
        yield


def vllm_config(kind, directory, **overrides):
    """A VllmConfig whose speculative config builds ``kind``'s MTP drafter (as vLLM's proposer does:
    the draft model config is also the model config)."""
    return vllm_config_of(tiny_config(kind, **overrides), directory)


def vllm_config_of(hf_config, directory):
    """`vllm_config` of a given transformers config (saved to ``directory`` as vLLM reads it)."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    hf_config.save_pretrained(directory)
    target = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype="float32")
    speculative = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=target,
                                    target_parallel_config=ParallelConfig())
    return VllmConfig(model_config=speculative.draft_model_config, speculative_config=speculative,
                      device_config=DeviceConfig(device=rank_device().type))


_state = {}


@contextlib.contextmanager
def drafter_environment():
    """vLLM's world-size-1 gloo process group and model-parallel groups, and the attention stand-in;
    yields the folder the drafters' checkpoints are written to while it lasts."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_attention_selection())
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="mtp-overlay-drafter-"))
        _state["directory"] = directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with set_current_vllm_config(vllm_config("nemotron_h", os.path.join(directory, "init"))):
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield directory
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
            _state.clear()


def build_drafter(kind, **overrides):
    """vLLM's real MTP drafter for ``kind`` (inside `drafter_environment`), float32 on CPU, made as vLLM
    makes it: ``initialize_model`` resolves the draft architecture and records the reload metadata.
    ``overrides``: fields of `tiny_config` (a wider model for benchmarks)."""
    name = kind + "".join(f"-{key}={value}" for key, value in sorted(overrides.items()))
    return build_drafter_of(tiny_config(kind, **overrides), name)


def build_drafter_of(hf_config, name):
    """`build_drafter` of a given transformers config (a target model's, e.g. one an exporter wrote),
    saved under ``name`` in the environment's folder."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model

    if "directory" not in _state:
        raise RuntimeError("build_drafter runs inside drafter_environment()")
    config = vllm_config_of(hf_config, os.path.join(_state["directory"], name))
    with rank_device():
        model = initialize_model(vllm_config=config, model_config=config.speculative_config.draft_model_config)
    model.vllm_config_for_tests = config
    return model


# --- checkpoint-format refit streams ------------------------------------------------------------
NAMINGS = ("mtp.*", "positional")
# (fused vLLM parameter, checkpoint shards in order); their sizes come from the parameter's layer
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# names a full-model refit also carries and every drafter ignores on purpose
TARGET_NAMES = {"nemotron_h": "backbone.layers.0.mixer.in_proj.weight", "deepseek": "model.layers.0.self_attn.q_proj.weight"}


def checkpoint_layer_name(kind, naming, layer, rest):
    """Checkpoint name of MTP layer ``layer`` (from 0) weight ``rest`` in ``naming``."""
    if naming == "mtp.*":
        return f"mtp.layers.{layer}.{rest}"
    if naming == "positional":
        return f"model.layers.{BACKBONE + layer}.{rest}"
    raise ValueError(f"naming must be one of {', '.join(NAMINGS)}, got {naming!r}")


def _shard_sizes(module, fused, rows):
    if fused == "qkv_proj":
        return [module.q_size, module.kv_size, module.kv_size]
    return [rows // 2, rows // 2]


def refit_stream(model, naming, seed=0, prefix="", with_target_names=True):
    """``[(checkpoint name, fresh tensor)]`` of every MTP parameter of ``model`` in ``naming``
    (fused parameters split into their checkpoint shards), plus a backbone name the drafter ignores.

    ``prefix``: put in front of every name (``language_model.`` for multimodal checkpoints).
    """
    import torch

    kind = "nemotron_h" if type(model).__name__ == "NemotronHMTP" else "deepseek"
    generator = torch.Generator().manual_seed(seed)
    first = min(int(key) for key in model.model.layers.keys())
    stream = []
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            continue  # embed_tokens, lm_head: the target's
        layer, rest = int(parts[2]) - first, ".".join(part for part in parts[3:] if part != "mtp_block")
        fused = next((f for f in FUSED if f in parts), None)
        if fused is None:
            pieces = [(rest, parameter.shape)]
        else:
            owner = model.get_submodule(".".join(parts[: parts.index(fused)]))
            sizes = _shard_sizes(owner, fused, parameter.shape[0])
            pieces = [(rest.replace(fused, shard), (size, *parameter.shape[1:])) for shard, size in zip(FUSED[fused], sizes)]
        for rest_name, shape in pieces:
            tensor = torch.randn(shape, generator=generator, dtype=parameter.dtype)
            stream.append((prefix + checkpoint_layer_name(kind, naming, layer, rest_name), tensor))
    if with_target_names:
        stream.append((prefix + TARGET_NAMES[kind], torch.randn(4, 4, generator=generator)))
    return stream


def snapshot(model):
    """``{name: clone}`` of the drafter's MTP-layer parameters (to see what a refit changed)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("model.layers.")}


def changed(model, before):
    """Names of the parameters whose bytes differ from ``before`` (bytes: fresh parameters are
    ``torch.empty`` and may hold NaN, which equals nothing)."""
    import torch

    def raw(tensor):
        return tensor.detach().reshape(-1).view(torch.uint8)

    now = dict(model.named_parameters())
    return sorted(name for name, old in before.items() if not torch.equal(raw(now[name]), raw(old)))
