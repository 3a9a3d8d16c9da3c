"""bridge-mtp-export: the HF config of a NemotronH export describes the MTP layers the model has.

Megatron-Bridge 0.6 ``models/nemotronh/nemotron_h_bridge.py:322-370``: ``megatron_to_hf_config``
maps ``mtp_num_layers`` to ``num_nextn_predict_layers`` through ``CONFIG_MAPPING``
(``models/conversion/model_bridge.py:478``) whatever ``mtp_use_repeated_layer`` says. With a
repeated layer, ``mtp_num_layers`` counts forward repetitions of one shared layer (the provider
builds one copy of the MTP pattern's weights, ``hybrid_provider.py:204``), so the export of the
Super recipe (one layer, applied twice) says 2, and vLLM 0.33.0's ``NemotronHMTP`` refuses it
(``model_executor/models/nemotron_h_mtp.py:246-249``: one MTP layer only). The MTP pattern is
exported only from the ``/``-sections a finalized ``hybrid_layer_pattern`` carries, so a provider
that was not finalized exports none and the config reads as HF's default pattern: a drafter of
other layers than the ones trained, silently.

The wrapper, after the stock export: a repeated-layer provider's positive depth becomes 1 (Bridge
PR #5948's rule; 0 stays 0, independent layers keep their count); where the config has MTP layers
and no ``mtp_hybrid_override_pattern``, the provider's own is written, checked for the layer symbols
the stock export accepts. Everything else is the stock export's.
"""

from ...calls import argument, original, positions
from ...contract import Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

BRIDGE = "NemotronHBridge"
EXPORT = "megatron_to_hf_config"
DEPTH, PATTERN = "num_nextn_predict_layers", "mtp_hybrid_override_pattern"
SYMBOLS = frozenset("ME*-")  # what the stock export accepts in a layer pattern (nemotron_h_bridge.py:331)
# Bridge issue #5946's repeated-layer provider, and the same MTP not finalized (its pattern beside it)
REPEATED = dict(hybrid_layer_pattern="MEME/*E/*E", mtp_num_layers=2, mtp_use_repeated_layer=True)
UNFINALIZED = dict(hybrid_layer_pattern="MEME", mtp_hybrid_override_pattern="*E", mtp_num_layers=2,
                   mtp_use_repeated_layer=False)


def _export(module: "ModuleType") -> "tuple[Any, Callable[..., Any] | None]":
    """(NemotronHBridge, its megatron_to_hf_config as upstream defined it: a function of (cls, provider))."""
    cls = defined_in(module, [BRIDGE])
    found = None if cls is None else vars(cls).get(EXPORT)
    return cls, (None if found is None else original(found))


def exported(provider: "Any", config: "dict[str, Any]") -> "dict[str, Any]":
    """``config`` (the stock export of ``provider``) with the MTP depth and pattern the model has."""
    depth = config.get(DEPTH)
    if getattr(provider, "mtp_use_repeated_layer", False) and isinstance(depth, int) and depth > 1:
        config[DEPTH] = 1
    pattern = getattr(provider, PATTERN, None)
    if config.get(DEPTH) and not config.get(PATTERN) and pattern:
        unknown = set(pattern) - SYMBOLS
        if unknown:
            raise ValueError(f"provider.{PATTERN} {pattern!r} has unknown layer symbols {sorted(unknown)}: expected "
                             "M (mamba), * (attention), E (moe), - (mlp)")
        config[PATTERN] = pattern
    return config


def _is_classmethod(found: "Any") -> bool:
    """Whether the class attribute ``found`` is a classmethod, wrappers that name what they wrap
    looked through."""
    while not isinstance(found, classmethod) and hasattr(found, "__wrapped__"):
        found = found.__wrapped__
    return isinstance(found, classmethod)


class MtpExportFix(Fix):
    declaration = DECLARATION  # "nemotron_h_bridge": NemotronHBridge.megatron_to_hf_config

    def probe(self, module: "ModuleType") -> Verdict:
        import types

        cls, export = _export(module)
        if cls is None or export is None:
            return drifted(f"{module.__name__} has no {BRIDGE}.{EXPORT}")
        if not _is_classmethod(vars(cls)[EXPORT]):
            return drifted(f"{BRIDGE}.{EXPORT} is not a classmethod")
        try:
            repeated = export(cls, types.SimpleNamespace(**REPEATED))
            unfinalized = export(cls, types.SimpleNamespace(**UNFINALIZED))
        except Exception as exc:  # noqa: BLE001 - an export that no longer takes a plain provider: drift
            return drifted(f"{BRIDGE}.{EXPORT} of a namespace provider raised {type(exc).__name__}: {exc}")
        wrong = []
        if repeated.get(DEPTH) == REPEATED["mtp_num_layers"]:
            wrong.append(f"one repeated MTP layer applied twice exports {DEPTH}=2")
        elif repeated.get(DEPTH) != 1:
            return drifted(f"a repeated-layer provider with mtp_num_layers=2 exports {DEPTH}={repeated.get(DEPTH)!r}")
        if unfinalized.get(PATTERN) is None:
            wrong.append(f"a provider not finalized exports no {PATTERN}")
        elif unfinalized[PATTERN] != UNFINALIZED[PATTERN]:
            return drifted(f"an unfinalized provider's {PATTERN} '*E' exports as {unfinalized[PATTERN]!r}")
        if wrong:
            return needed("; ".join(wrong))
        return redundant(f"the export writes one repeated MTP layer and the provider's {PATTERN}")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        cls, export = _export(module)
        assert export is not None, "probed first"
        at = positions(export, method=True)  # wrapt hands a classmethod's args without cls

        def megatron_to_hf_config(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                  kwargs: "dict[str, Any]") -> "Any":
            provider = argument(args, kwargs, at.get("provider"), "provider")
            return exported(provider, wrapped(*args, **kwargs))

        yield cls, EXPORT, megatron_to_hf_config


FIX = MtpExportFix()
