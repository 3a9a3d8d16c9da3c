"""bridge-mtp-off: ``mtp_num_layers=0`` means no MTP, also for a repeated-layer provider.

Megatron-Bridge 0.6 ``models/hybrid/hybrid_provider.py:199-208``: ``HybridModelProvider.finalize``
appends ``max(1, mtp_num_layers or 0)`` copies of ``mtp_hybrid_override_pattern`` to the main
pattern when ``mtp_use_repeated_layer`` is set (Bridge PR #2867, on purpose: "so the MTP block (and
its weights) are created ... even when mtp_num_layers=0", the shared layer of a checkpoint that has
one). Bridge's NemotronH import sets the flag for every checkpoint with an MTP layer
(``nemotron_h_bridge.py:305``), so a recipe's ``mtp_num_layers: 0`` still builds an MTP block, and
megatron-core's ``HybridModel.forward`` asserts ``mtp_num_layers > 0`` at the first step
(``models/hybrid/hybrid_model.py:555``). A pattern that already carries ``/`` sections (given
unified, or finalized before) keeps them at 0 whatever the flag.

The wrapper, only where ``mtp_num_layers`` is a numeric zero (0, 0.0, False; ``None`` still means
"as the pattern says", one copy of the shared layer: PR #2867's intent): the MTP sections are cut from
``hybrid_layer_pattern`` (and the deprecated ``hybrid_override_pattern``) and the stock finalize runs
with no MTP pattern to append; the provider's ``mtp_hybrid_override_pattern`` is put back after, so
the provider still says which MTP layer the checkpoint has. Subclasses whose ``finalize`` calls
``super().finalize()`` (Bridge's Nemotron Omni and VL providers, ``MambaModelProvider``) go through
it too.
"""

from ...calls import original
from ...contract import Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

PROVIDER = "HybridModelProvider"
PATTERNS = ("hybrid_layer_pattern", "hybrid_override_pattern")  # the main pattern's field, and its deprecated name
MTP_PATTERN = "mtp_hybrid_override_pattern"
# a tiny repeated-layer provider with MTP off: one attention and one MLP layer, the same as its MTP layer
PROBE: "dict[str, Any]" = dict(hybrid_layer_pattern="*-", mtp_hybrid_override_pattern="*-", mtp_use_repeated_layer=True,
                               mtp_num_layers=0, hidden_size=8, ffn_hidden_size=16, num_attention_heads=1, vocab_size=8)


def _finalize(module: "ModuleType") -> "tuple[Any, Callable[..., Any] | None]":
    """(HybridModelProvider, its finalize as upstream defined it)."""
    cls = defined_in(module, [PROVIDER])
    found = None if cls is None else vars(cls).get("finalize")
    return cls, (None if found is None else original(found))


def _separator(module: "ModuleType") -> "str | None":
    """megatron-core's MTP separator of the hybrid pattern, as the module names it (``Symbols``)."""
    return getattr(getattr(module, "Symbols", None), "MTP_SEPARATOR", None)


def mtp_off(provider: "Any") -> bool:
    """``mtp_num_layers`` is a numeric zero (0, 0.0, False, a NumPy zero: YAML and CLI overrides bring
    any of them; Bridge's own ``mtp_num_layers or 0`` treats each as 0); None means "as the pattern says"."""
    import numbers

    value: "Any" = getattr(provider, "mtp_num_layers", None)
    # numbers.Number declares no __eq__ of its own: mypy would call the comparison always False
    return isinstance(value, numbers.Number) and value == 0  # type: ignore[comparison-overlap]


def _probe_provider(cls: "Any") -> "Any":
    """`PROBE` as a provider of ``cls``, every fusion off and no CUDA-graph module (nothing in its
    finalize needs Transformer Engine or warns)."""
    import dataclasses

    fields = {field.name: field for field in dataclasses.fields(cls)}
    quiet: "dict[str, object]" = {name: False for name, field in fields.items()
                                  if "fusion" in name and field.type in (bool, "bool")}
    if "cuda_graph_modules" in fields:
        quiet["cuda_graph_modules"] = []
    return cls(**PROBE, **quiet)


class MtpOffFix(Fix):
    declaration = DECLARATION  # "hybrid_provider": HybridModelProvider.finalize

    def probe(self, module: "ModuleType") -> Verdict:
        cls, finalize = _finalize(module)
        separator = _separator(module)
        if cls is None or finalize is None:
            return drifted(f"{module.__name__} has no {PROVIDER}.finalize")
        if separator is None:
            return drifted(f"{module.__name__} names no Symbols.MTP_SEPARATOR")
        try:
            provider = _probe_provider(cls)
            finalize(provider)
        except Exception as exc:  # noqa: BLE001 - a provider of another shape: the hook would not fit
            return drifted(f"finalizing a tiny {PROVIDER} with mtp_num_layers=0 raised {type(exc).__name__}: {exc}")
        pattern = provider.hybrid_layer_pattern
        if not isinstance(pattern, str):
            return drifted(f"{PROVIDER}.finalize left hybrid_layer_pattern {pattern!r}")
        if separator + PROBE[MTP_PATTERN] in pattern:
            return needed(f"a repeated-layer provider finalized with mtp_num_layers=0 keeps an MTP section "
                          f"({PROBE['hybrid_layer_pattern']!r} -> {pattern!r})")
        return redundant(f"mtp_num_layers=0 finalizes to {pattern!r}: no MTP section")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        cls, finalize = _finalize(module)
        separator = _separator(module)
        assert finalize is not None and separator is not None, "probed first"

        def finalize_without_mtp(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                 kwargs: "dict[str, Any]") -> "Any":
            if not mtp_off(instance):
                return wrapped(*args, **kwargs)
            for name in PATTERNS:
                pattern = getattr(instance, name, None)
                if isinstance(pattern, str):
                    setattr(instance, name, pattern.split(separator)[0])
            mtp_pattern = getattr(instance, MTP_PATTERN)
            setattr(instance, MTP_PATTERN, None)
            try:
                return wrapped(*args, **kwargs)
            finally:
                setattr(instance, MTP_PATTERN, mtp_pattern)

        yield cls, "finalize", finalize_without_mtp


FIX = MtpOffFix()
