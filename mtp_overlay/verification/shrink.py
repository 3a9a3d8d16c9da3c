"""Shrink a model config to CPU size and keep its shape: what ``mtp-overlay verify`` builds.

A config arrives in one of two key spaces: a Hugging Face ``config.json`` (what
``AutoBridge.from_hf_config`` reads) or a Megatron-Bridge provider's fields. `ROLES` names each
size both ways (the HF key -> provider field pairs of Megatron-Bridge 0.6
``models/conversion/model_bridge.py:437-480`` ``CONFIG_MAPPING`` and NemotronHBridge's additions,
``models/nemotronh/nemotron_h_bridge.py:233-246``). `shrink` sizes each role down:

* widths: hidden 64, FFN 128, expert FFN 32, shared-expert FFN 64, head dim 16, vocabulary 128;
* attention heads: the fewest that keep the GQA ratio (heads per query group) and split over TP;
* experts: the fewest that keep top-k (at least twice top-k, and 4), a multiple of EP and of the
  router's expert groups; never more than the config has;
* Mamba: head dim 16, state 8, chunks of 8 steps (so a packed row's sequences start inside chunks),
  groups per TP rank kept on the same side of CP as the config's (replicated across CP ranks, or
  not: ``ssm/mamba_context_parallel.py:118-133``), heads the fewest that split over TP x CP;
* the layer pattern: all of it (``layers="all"``), or every distinct run of one layer kind, each at
  most 2 layers long, in order of first appearance (``"runs"``); ``"auto"`` keeps up to 16 layers.

Kept as the config has them: the MTP pattern and depth, the repeated MTP layer, MoE top-k, shared
experts, router groups, tied embeddings, ``scatter_embedding_sequence_parallel``, and every key not
named here (activations, norms, RoPE, router scoring): Bridge maps those as it would for the real model.

Before shrinking, the real config is checked against the layout the way megatron-core checks it at
build time (heads and query groups over TP, experts over EP, Mamba heads and groups over TP x CP,
MoE with TP needing SP): a layout the real model cannot run is a ValueError naming the flag.
"""

from __future__ import annotations

import dataclasses
import math

from .layout import Layout

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

KEYSPACES = ("hf", "provider")
LAYER_MODES = ("auto", "all", "runs")
ALL_UP_TO = 16  # "auto": patterns this long are kept whole
RUN_CAP = 2  # "runs": a run of one layer kind keeps at most this many layers
HIDDEN, FFN, EXPERT_FFN, HEAD_DIM, VOCAB = 64, 128, 32, 16, 128
MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_CHUNK = 16, 8, 8
MIN_EXPERTS = 4

# role -> (Hugging Face keys, the first found is read; provider field)
ROLES: dict[str, tuple[tuple[str, ...], str]] = {
    "hidden": (("hidden_size",), "hidden_size"),
    "ffn": (("intermediate_size",), "ffn_hidden_size"),
    "heads": (("num_attention_heads",), "num_attention_heads"),
    "query_groups": (("num_key_value_heads",), "num_query_groups"),
    "head_dim": (("head_dim",), "kv_channels"),
    "layers": (("num_hidden_layers",), "num_layers"),
    "pattern": (("hybrid_override_pattern",), "hybrid_layer_pattern"),
    "mtp_pattern": (("mtp_hybrid_override_pattern",), "mtp_hybrid_override_pattern"),
    "mtp_depth": (("num_nextn_predict_layers", "mtp_num_hidden_layers"), "mtp_num_layers"),
    "repeated_layer": (("mtp_use_repeated_layer",), "mtp_use_repeated_layer"),
    "experts": (("n_routed_experts", "num_experts", "num_local_experts"), "num_moe_experts"),
    "top_k": (("num_experts_per_tok",), "moe_router_topk"),
    "expert_ffn": (("moe_intermediate_size",), "moe_ffn_hidden_size"),
    "shared_expert_ffn": (("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"),
                          "moe_shared_expert_intermediate_size"),
    "expert_groups": (("n_group",), "moe_router_num_groups"),
    "latent": (("moe_latent_size",), "moe_latent_size"),
    "mamba_heads": (("mamba_num_heads",), "mamba_num_heads"),
    "mamba_head_dim": (("mamba_head_dim",), "mamba_head_dim"),
    "mamba_groups": (("n_groups",), "mamba_num_groups"),
    "mamba_state": (("ssm_state_size",), "mamba_state_dim"),
    "mamba_chunk": (("chunk_size",), "mamba_chunk_size"),
    "vocab": (("vocab_size",), "vocab_size"),
    "tied": (("tie_word_embeddings",), "share_embeddings_and_output_weights"),
    "scatter": (("scatter_embedding_sequence_parallel",), "scatter_embedding_sequence_parallel"),
}
# sizes no model has 0 of (0 key/value heads is no GQA ratio: refused, never reshaped)
POSITIVE = frozenset({"hidden", "heads", "query_groups", "head_dim", "vocab"})
# provider fields read off a provider given by its module path (beyond ROLES): what the report keeps
PROVIDER_EXTRAS = ("moe_token_dispatcher_type", "moe_router_score_function", "moe_shared_expert_intermediate_size",
                   "moe_router_group_topk", "normalization", "activation_func", "position_embedding_type")
PROVIDER_FIELDS = tuple(field for _, field in ROLES.values()) + PROVIDER_EXTRAS
# the HF pattern as a list (transformers 5 NemotronHConfig ``layers_block_type``/``layer_types``), by symbol
LIST_KEYS = {"pattern": ("layers_block_type", "layer_types"), "mtp_pattern": ("mtp_layers_block_type",)}
LAYER_NAMES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# megatron-core's other layer symbols (models/hybrid/hybrid_layer_allocation.py:14-26): no CPU stand-in
NO_STAND_IN = {"G": "gated delta net", "D": "DeepSeek sparse attention", "+": "multi-latent attention"}
# keys of features the test bed has no CPU stand-in for: key -> what it is
NO_STAND_IN_KEYS = {"kv_lora_rank": "multi-latent attention (MLA)", "q_lora_rank": "multi-latent attention (MLA)",
                    "multi_latent_attention": "multi-latent attention (MLA)"}
# what verify sets for its reference, whatever the config says: the MoE losses that are a function of a
# whole microbatch's routing (a per-sequence reference exists only without them), and token dropping
REFERENCE_SETTINGS = {
    "moe_aux_loss_coeff": (0.0, "the load-balancing loss is a function of the whole microbatch's routing: "
                                "a per-sequence reference exists only without it"),
    "moe_z_loss_coeff": (None, "likewise"),
    "moe_expert_capacity_factor": (None, "token dropping makes a token's expert depend on the other sequences"),
}


class ConfigError(ValueError):
    """A value of the model's config (or provider's fields) that verify cannot run with; verify names
    the config it came from."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One key the shrink changed: its name (in the config's key space), from, to, and why."""

    key: str
    original: object
    value: object
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """What a multimodal config adds to its `Shrunk`.

    image_token: the image token id in the shrunk config (None: the config names none; Bridge's provider
    has its own default); reserved: ids the sample's text must not hold (the image and sound tokens);
    provider: provider fields the engine sets after Bridge's import, where the provider has them (the
    sound token: the config's, else (or where it is 0, the batches' padding id and the providers'
    default) `vision.SOUND_ID`; Bridge maps it only with a sound encoder,
    ``nemotron_omni_bridge.py:109-116``, and LLaVAModel takes every token equal to it for a sound slot,
    ``llava_model.py:657-672``); not_run: what the run leaves out, in words; vision: the tower built
    (`vision.VISION`)."""

    image_token: int | None
    reserved: tuple[int, ...]
    provider: dict[str, object]
    not_run: tuple[str, ...]
    vision: dict[str, object]

    def as_dict(self) -> dict[str, object]:
        return dict(image_token=self.image_token, reserved=list(self.reserved), provider=dict(self.provider),
                    not_run=list(self.not_run), vision=dict(self.vision))


@dataclasses.dataclass(frozen=True)
class Shrunk:
    """What verify builds instead of the user's model.

    keyspace: "hf" or "provider". values: for "hf" the whole shrunk config.json dict; for "provider"
    the fields to set on the provider. changes: what was shrunk; kept: (what, value) left as the config
    has it; settings: provider fields set for the reference (`REFERENCE_SETTINGS`), applied after
    Bridge's import as a recipe would. mtp_depth, repeated_layer (None: Bridge's default), pattern and
    mtp_pattern (hybrid models; None for GPT ones) as built; hybrid: the config is a hybrid (Mamba /
    MoE / attention pattern) model; multimodal: a Nemotron VL / Omni config's vision side
    (`vision.shrink_multimodal`), None for a language model.
    """

    keyspace: str
    values: dict[str, object]
    changes: tuple[Change, ...]
    kept: tuple[tuple[str, object], ...]
    settings: dict[str, object]
    mtp_depth: int
    repeated_layer: bool | None
    pattern: str | None
    mtp_pattern: str | None
    vocab: int
    experts: int = 0
    multimodal: Multimodal | None = None

    @property
    def hybrid(self) -> bool:
        return self.pattern is not None

    def as_dict(self) -> dict[str, object]:
        return dict(
            keyspace=self.keyspace,
            shrunk=[dict(key=c.key, original=c.original, value=c.value, why=c.why) for c in self.changes],
            kept={name: value for name, value in self.kept},
            settings=dict(self.settings),
            mtp_depth=self.mtp_depth, repeated_layer=self.repeated_layer, pattern=self.pattern,
            mtp_pattern=self.mtp_pattern, multimodal=None if self.multimodal is None else self.multimodal.as_dict(),
        )


class _Config:
    """Read and write a config's roles in its key space."""

    def __init__(self, values: Mapping[str, object], keyspace: str) -> None:
        if keyspace not in KEYSPACES:
            raise ValueError(f"keyspace must be one of {KEYSPACES}, got {keyspace!r}")
        self.values, self.keyspace = dict(values), keyspace
        self.changes: list[Change] = []

    def key(self, role: str) -> str:
        hf_keys, field = ROLES[role]
        if self.keyspace == "provider":
            return field
        return next((key for key in hf_keys if self.values.get(key) is not None), hf_keys[0])

    def get(self, role: str) -> object:
        return self.values.get(self.key(role))

    def number(self, role: str) -> int | None:
        value = self.get(role)
        if value is None:
            return None
        least = 1 if role in POSITIVE else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            kind = "a positive" if least else "a non-negative"
            raise ConfigError(f"the config's {self.key(role)} must be {kind} integer, got {value!r}")
        return value

    def set(self, role: str, value: object, why: str = "", *, key: str | None = None) -> None:
        name = key or self.key(role)
        original = self.values.get(name)
        if original != value:
            self.values[name] = value
            self.changes.append(Change(name, original, value, why))


def shrink(values: Mapping[str, object], layout: Layout, *, keyspace: str = "hf", mtp_num_layers: int | None = None,
           repeated_layer: bool | None = None, layers: str = "auto",
           scatter_embedding_sequence_parallel: bool | None = None) -> Shrunk:
    """The CPU-size twin of config ``values`` for ``layout`` (module docstring).

    mtp_num_layers / repeated_layer / scatter_embedding_sequence_parallel: overrides of what the config
    says (None: the config's). layers: one of LAYER_MODES.
    """
    if layers not in LAYER_MODES:
        raise ValueError(f"--layers must be one of {LAYER_MODES}, got {layers!r}")
    config = _Config(values, keyspace)
    pattern, mtp_pattern = _patterns(config)
    check_stand_ins(config, pattern, mtp_pattern)
    depth = _mtp(config, mtp_num_layers, repeated_layer, pattern, mtp_pattern)
    check_layout(config, layout, pattern, mtp_pattern)
    kept: list[tuple[str, object]] = [("MTP depth", depth)]
    if scatter_embedding_sequence_parallel is not None:
        config.set("scatter", scatter_embedding_sequence_parallel, "--scatter-embedding")
    _shrink_attention(config, layout, kept)
    _shrink_moe(config, layout, kept)
    _shrink_mamba(config, layout, kept)
    for role, size, why in (("hidden", HIDDEN, "CPU size"), ("ffn", FFN, "2 x hidden")):
        width = config.number(role)
        if width is not None and width > size:
            config.set(role, size, why)
    vocab = config.number("vocab") or VOCAB
    if vocab > VOCAB:
        config.set("vocab", VOCAB, "CPU size (each sample sequence draws distinct tokens from it)")
        vocab = VOCAB
    built_pattern = _shrink_pattern(config, pattern, layers, kept, layout.pp)
    if mtp_pattern is not None:
        kept.append(("MTP pattern", mtp_pattern))
    repeated = config.get("repeated_layer")
    kept.append(("repeated MTP layer", "Bridge's default" if repeated is None else repeated))
    for what, role in (("tied embeddings", "tied"), ("scatter_embedding_sequence_parallel", "scatter")):
        value = config.get(role)
        kept.append((what, "the provider's default" if value is None else value))
    touched = {change.key for change in config.changes}
    kept += [(key, value) for key, value in sorted(values.items())
             if key not in touched and key in _kept_keys(config) and value is not None]
    return Shrunk(
        keyspace=keyspace, values=config.values, changes=tuple(config.changes), kept=tuple(kept),
        settings={name: value for name, (value, _) in REFERENCE_SETTINGS.items()}, mtp_depth=depth,
        repeated_layer=repeated if isinstance(repeated, bool) else None, pattern=built_pattern,
        mtp_pattern=mtp_pattern, vocab=vocab, experts=config.number("experts") or 0,
    )


def _kept_keys(config: _Config) -> set[str]:
    """Keys worth naming as kept: the structural ones the report lists beside the roles (the MoE and
    Mamba ones only for a config with experts, or Mamba heads)."""
    names = {"hidden_act", "mlp_hidden_act", "activation_func", "normalization", "position_embedding_type",
             "architectures", "model_type"}
    if config.number("experts"):
        names |= {"moe_token_dispatcher_type", "moe_router_score_function", "n_shared_experts", "topk_group",
                  "moe_router_group_topk", config.key("top_k"), config.key("expert_groups")}
    if config.number("mamba_heads"):
        names |= {"conv_kernel", "mamba_hidden_act"}
    return names


# --- the checks ---------------------------------------------------------------------------------
def check_stand_ins(config: _Config, pattern: str | None, mtp_pattern: str | None) -> None:
    """ValueError naming what the test bed has no CPU stand-in for: a layer symbol outside M * - E, a
    feature key of `NO_STAND_IN_KEYS`."""
    missing = []
    for what, found in (("layer pattern", pattern), ("MTP pattern", mtp_pattern)):
        for symbol in sorted(set(found or "") - set(LAYER_NAMES) - set("|/")):
            missing.append(f"layer {symbol!r} ({NO_STAND_IN.get(symbol, 'not a megatron-core layer symbol')}) in "
                           f"the {what} {found!r}")
    for key, what in NO_STAND_IN_KEYS.items():
        if config.values.get(key):
            missing.append(f"{what} ({key}={config.values[key]!r})")
    if missing:
        raise ValueError("the test bed has no CPU stand-in for " + "; ".join(missing) +
                         f" (it builds {', '.join(f'{s!r} {k}' for s, k in LAYER_NAMES.items())} layers)")


def check_layout(config: _Config, layout: Layout, pattern: str | None, mtp_pattern: str | None) -> None:
    """ValueError naming the flag when the real config cannot run ``layout`` (module docstring)."""
    heads, groups = config.number("heads"), config.number("query_groups")
    symbols = set((pattern or "") + (mtp_pattern or ""))
    attention = pattern is None or "*" in symbols
    if attention and heads:
        groups = groups or heads
        if heads % groups:
            raise ConfigError(f"the config's {heads} attention heads do not split into {groups} query groups")
        for what, count in (("attention heads", heads), ("query groups (key/value heads)", groups)):
            if count % layout.tp:
                raise ValueError(f"--tp {layout.tp}: the model's {count} {what} do not split over {layout.tp} "
                                 "tensor-parallel ranks (megatron-core requires it)")
    experts = config.number("experts")
    moe = bool(experts) and (pattern is None or "E" in symbols)
    if moe and experts is not None:
        if experts % layout.ep:
            raise ValueError(f"--ep {layout.ep}: the model's {experts} experts do not split over {layout.ep} "
                             "expert-parallel ranks")
        top_k = config.number("top_k") or 1
        if top_k > experts:
            raise ConfigError(f"the config routes each token to {top_k} experts (top-k) of {experts}")
        if layout.tp > 1 and not layout.sp:
            raise ValueError(f"--tp {layout.tp} with MoE layers needs --sp: megatron-core refuses to train MoE with "
                             "tensor parallelism and no sequence parallelism (transformer/moe/moe_layer.py:630)")
    elif layout.ep > 1:
        raise ValueError(f"--ep {layout.ep}: the model has no MoE layers to split over expert-parallel ranks")
    if "M" in symbols:
        _check_mamba(config, layout)


def _check_mamba(config: _Config, layout: Layout) -> None:
    heads, groups = config.number("mamba_heads"), config.number("mamba_groups") or 1
    if not heads:
        raise ConfigError(f"the config has Mamba layers but no {config.key('mamba_heads')}")
    if heads % groups:
        raise ConfigError(f"the config's {heads} Mamba heads do not split into its {groups} groups")
    tp, cp = layout.tp, layout.cp
    if heads % tp or groups % tp:
        raise ValueError(f"--tp {tp}: the model's {heads} Mamba heads in {groups} groups do not split over {tp} "
                         "tensor-parallel ranks (ssm/mamba_mixer.py:260,268)")
    local = groups // tp
    if (heads // tp) % cp or (local < cp and cp % local) or (local >= cp and local % cp):
        raise ValueError(f"--cp {cp}: the model's {heads // tp} Mamba heads and {local} groups per TP rank do not "
                         f"split over {cp} context-parallel ranks (ssm/mamba_context_parallel.py:106-131)")


# --- the sizes ----------------------------------------------------------------------------------
def _shrink_attention(config: _Config, layout: Layout, kept: list[tuple[str, object]]) -> None:
    heads = config.number("heads")
    if not heads:
        return
    groups = config.number("query_groups") or heads
    ratio = heads // groups
    new_groups = min(groups, layout.tp)
    if config.get("query_groups") is not None:
        config.set("query_groups", new_groups, f"the fewest that split over TP{layout.tp}")
    config.set("heads", new_groups * ratio, f"{ratio} heads per query group (GQA ratio kept)")
    kept.append(("GQA ratio (heads per query group)", ratio))
    head_dim = config.number("head_dim")
    if head_dim is None or head_dim > HEAD_DIM:
        config.set("head_dim", HEAD_DIM, "CPU size")


def _shrink_moe(config: _Config, layout: Layout, kept: list[tuple[str, object]]) -> None:
    experts = config.number("experts")
    if not experts:
        return
    top_k = config.number("top_k") or 1
    multiple = math.lcm(layout.ep, config.number("expert_groups") or 1)
    wanted = max(MIN_EXPERTS, 2 * top_k)
    new = min(experts, -(-wanted // multiple) * multiple)
    config.set("experts", new, f"keeps top-{top_k}, a multiple of EP{layout.ep}" +
               (f" and of {config.number('expert_groups')} router groups" if config.number("expert_groups") else ""))
    kept.append(("MoE top-k", top_k))
    for role, size in (("expert_ffn", EXPERT_FFN), ("shared_expert_ffn", HIDDEN), ("latent", EXPERT_FFN)):
        value = config.number(role)
        if value is not None and value > size:
            config.set(role, size, "CPU size")


def _shrink_mamba(config: _Config, layout: Layout, kept: list[tuple[str, object]]) -> None:
    heads = config.number("mamba_heads")
    if not heads:
        return
    groups = config.number("mamba_groups") or 1
    tp, cp = layout.tp, layout.cp
    local = groups // tp
    new_groups = tp * min(local, cp) if cp > 1 else tp
    multiple = math.lcm(new_groups, tp * cp)
    wanted = 2 * HIDDEN // MAMBA_HEAD_DIM
    config.set("mamba_groups", new_groups, "groups per TP rank on the config's side of CP" if cp > 1 else
               f"one group per TP rank (TP{tp})")
    config.set("mamba_heads", min(heads, -(-wanted // multiple) * multiple), f"the fewest that split over TP x CP "
               f"and groups, near 2 x hidden / head dim")
    for role, size in (("mamba_head_dim", MAMBA_HEAD_DIM), ("mamba_state", MAMBA_STATE),
                       ("mamba_chunk", MAMBA_CHUNK)):
        value = config.number(role)
        if value is None or value > size:
            why = "packed sequences start inside a chunk" if role == "mamba_chunk" else "CPU size"
            config.set(role, size, why)
    kept.append(("Mamba groups replicated across CP ranks", cp > 1 and local < cp))


# --- the patterns -------------------------------------------------------------------------------
def _patterns(config: _Config) -> tuple[str | None, str | None]:
    """(layer pattern, MTP pattern) as symbol strings, or None for a config without one."""
    found: dict[str, str | None] = {}
    for role in ("pattern", "mtp_pattern"):
        value = config.get(role)
        if value is None and config.keyspace == "hf":
            listed = _listed(config, role)
            if listed is not None and role == "pattern" and not _is_hybrid_list(listed):
                value = None  # per-layer attention kinds of a GPT-family config (Qwen3 layer_types)
            elif listed is not None:
                value = "".join(_symbol(name, config, role) for name in listed)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"the config's {config.key(role)} must be a string of layer symbols, got {value!r}")
        found[role] = value or None
    return found["pattern"], found["mtp_pattern"]


def _listed(config: _Config, role: str) -> list[object] | None:
    """The HF config's per-layer list for ``role`` (`LIST_KEYS`), or None."""
    for key in LIST_KEYS[role]:
        value = config.values.get(key)
        if isinstance(value, list):
            return list(value)
    return None


def _is_hybrid_list(listed: list[object]) -> bool:
    return any(name in ("moe", "mlp", "linear_attention", "mamba") for name in listed)


def _symbol(name: object, config: _Config, role: str) -> str:
    symbols = {layer: symbol for symbol, layer in LAYER_NAMES.items()} | {"mamba": "M", "attention": "*"}
    if name not in symbols:
        key = next(key for key in LIST_KEYS[role] if key in config.values)
        raise ConfigError(f"the config's {key} holds layer type {name!r}, which has no CPU stand-in in the test bed "
                         f"(known: {', '.join(sorted(symbols))})")
    return symbols[str(name)]


def _mtp(config: _Config, depth: int | None, repeated: bool | None, pattern: str | None,
         mtp_pattern: str | None) -> int:
    if depth is not None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"--mtp-num-layers must be a positive integer, got {depth!r}")
        config.set("mtp_depth", depth, "--mtp-num-layers")
    found = config.number("mtp_depth") or 0
    if found < 1:
        raise ConfigError(f"the config has no MTP layers ({config.key('mtp_depth')} is {config.get('mtp_depth')!r}): "
                         "give --mtp-num-layers N to verify it with N")
    if pattern is not None and not mtp_pattern:
        listed = next((key for key in LIST_KEYS["mtp_pattern"] if key in config.values), None)
        key = listed or config.key("mtp_pattern")
        raise ConfigError(f"the config's {config.key('mtp_depth')} is {found}, but its {key} is "
                         f"{config.values.get(key)!r}: a hybrid model's MTP block needs its layers (e.g. "
                         + ("['full_attention', 'moe']" if listed else "'*E'") + ")")
    if repeated is not None:
        config.set("repeated_layer", repeated, "--repeated-layer")
    return found


def _shrink_pattern(config: _Config, pattern: str | None, layers: str, kept: list[tuple[str, object]],
                    stages: int) -> str | None:
    """The layer pattern (or a GPT config's layer count / layer kinds) as ``layers`` keeps it, with at
    least one layer per pipeline stage (a GPT stack: the same number on every stage); a pattern's own
    stage marks (``|``) are dropped: the engine cuts the shrunk pattern into the layout's stages."""
    if pattern is not None:
        layers_only = pattern.replace("|", "")
        new = layers_only if _whole(layers, len(layers_only)) else distinct_runs(layers_only)
        new *= -(-stages // len(new))  # repeated until every stage has a layer
        how = "every layer" if new == layers_only else f"every distinct run ({len(layers_only)} layers -> {len(new)})"
        kept.append(("layer pattern", f"{new!r} ({how})"))
        why = "every distinct run of one layer kind, at most " f"{RUN_CAP} long, in order of first appearance" \
            if new != layers_only else "without its pipeline stage marks"
        if config.keyspace == "hf" and config.get("pattern") is None:
            key = next(key for key in LIST_KEYS["pattern"] if isinstance(config.values.get(key), list))
            config.set("pattern", [LAYER_NAMES[symbol] for symbol in new], why, key=key)
        else:
            config.set("pattern", new, why)
        if config.number("layers") is not None:
            config.set("layers", len(new), "the pattern's length")
        return new
    count = config.number("layers")
    if count is None:
        return None
    kinds: list[object] = _listed(config, "pattern") or ["layer"] * count
    new_kinds = kinds if _whole(layers, count) else _runs(kinds)
    if len(new_kinds) % stages:  # megatron-core splits a GPT stack evenly over the stages
        new_kinds += [new_kinds[-1]] * (stages - len(new_kinds) % stages)
    if len(new_kinds) != count:
        config.set("layers", len(new_kinds), f"every distinct run of the {count} layers")
        listed = next((key for key in LIST_KEYS["pattern"] if isinstance(config.values.get(key), list)), None)
        if listed is not None:
            config.set("pattern", new_kinds, "likewise", key=listed)
    kept.append(("layers", f"{len(new_kinds)} ({'every layer' if len(new_kinds) == count else 'every distinct run'})"))
    return None


def _whole(layers: str, count: int) -> bool:
    return layers == "all" or (layers == "auto" and count <= ALL_UP_TO)


def distinct_runs(pattern: str) -> str:
    """Every distinct run of one layer symbol in ``pattern``, at most `RUN_CAP` long, in order of first
    appearance: ``"MEMEM*EMEMEM*E-"`` -> ``"ME*-"``, ``"MM-MM-M*"`` -> ``"MM-M*"``."""
    return "".join(str(kind) * length for kind, length in _distinct(list(pattern)))


def _runs(kinds: list[object]) -> list[object]:
    return [kind for kind, length in _distinct(kinds) for _ in range(length)]


def _distinct(kinds: list[object]) -> list[tuple[object, int]]:
    runs: list[tuple[object, int]] = []
    for kind in kinds:
        if runs and runs[-1][0] == kind and runs[-1][1] < RUN_CAP:
            runs[-1] = (kind, runs[-1][1] + 1)
        elif not runs or runs[-1][0] != kind:
            runs.append((kind, 1))
    seen: list[tuple[object, int]] = []
    for run in runs:
        if run not in seen:
            seen.append(run)
    return seen

