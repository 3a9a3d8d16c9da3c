"""mtp-sp-scatter: scatter the MTP embedding to the sequence-parallel region.

megatron-core 0.14-0.19.x: `MultiTokenPredictionLayer._get_embeddings` calls the model's embedding
directly. A model built with ``scatter_embedding_sequence_parallel=False`` scatters in its own outer
forward, the MTP path never does, so under sequence parallelism `decoder_input` stays [S/CP, b, h]
against hidden states of [S/(CP*TP), b, h] and `_concat_embeddings` fails. Upstream fix: Megatron-LM
PR #6256 (commit 67700f79).

The hook scatters the decoder input `_get_embeddings` returns (in each release's return layout) unless
its length already is the hidden states' (an upstream fix the probe did not recognise): never twice.
Upstream scatters right after the embedding call, before the `mtp_detach_heads` detach; the scatter's
forward is a slice, so scattering the returned (possibly detached) tensor gives the same values and
gradients.
"""

from ...calls import argument, original
from ...contract import Verdict, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

SCATTER = "scatter_to_sequence_parallel_region"

# parameters of `_get_embeddings` by release -> (release family, index of decoder_input in its result);
# `embedding` is the third argument in every one
_BASE = ("self", "input_ids", "position_ids", "embedding", "hidden_states")
SIGNATURES = {
    _BASE: ("0.14-0.15", 2),
    _BASE + ("packed_seq_params",): ("0.16-0.17", 2),
    _BASE + ("packed_seq_params", "padding_mask"): ("0.18-0.19", 3),
}
EMBEDDING_POSITION, HIDDEN_STATES_POSITION = 2, 3  # in args (self is bound by wrapt)


def signature_variant(function: "Callable[..., object]") -> "tuple[str, int] | None":
    """(release family, decoder_input index) of the `_get_embeddings` signature ``function`` has, or None."""
    import inspect

    return SIGNATURES.get(tuple(inspect.signature(function).parameters))


def stock_get_embeddings(layer_class: type) -> "Callable[..., object] | None":
    """The upstream `_get_embeddings`, seen through every wrapper (this fix's, a decorator's)."""
    method = vars(layer_class).get("_get_embeddings")
    return None if method is None else original(method)


def embedding_scatters(embedding: object) -> bool:
    """Upstream's rule: an embedding without the attribute scatters by itself."""
    return getattr(embedding, "scatter_to_sequence_parallel", True)


def _scatter_function(module: "ModuleType") -> "Callable[..., Any]":
    # resolved at call time through the target module's own global, as upstream does, so a test
    # that monkeypatches that name sees it; releases without the global fall back to tensor_parallel
    scatter: "Callable[..., Any] | None" = getattr(module, SCATTER, None)
    if scatter is None:
        from megatron.core import tensor_parallel

        scatter = getattr(tensor_parallel, SCATTER)
    return scatter


class SPScatterFix(Fix):
    declaration = DECLARATION  # one target, "mtp": MultiTokenPredictionLayer._get_embeddings

    def probe(self, module: "ModuleType") -> Verdict:
        layer = getattr(module, "MultiTokenPredictionLayer", None)
        if layer is None:
            return drifted(f"{module.__name__} has no MultiTokenPredictionLayer")
        method = stock_get_embeddings(layer)
        if method is None:
            return drifted("MultiTokenPredictionLayer has no _get_embeddings method")
        if self.marker.in_function(method):
            return redundant(f"_get_embeddings already calls {SCATTER} (upstream PR #6256 or patched on disk)")
        variant = signature_variant(method)
        if variant is None:
            known = "; ".join(f"{family}: {p}" for p, (family, _) in SIGNATURES.items())
            return drifted(f"_get_embeddings{method.__code__.co_varnames[:method.__code__.co_argcount]} matches none of {known}")
        return needed(f"signature of megatron-core {variant[0]}")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        stock = stock_get_embeddings(module.MultiTokenPredictionLayer)
        variant = None if stock is None else signature_variant(stock)
        assert variant is not None, "probed first: a _get_embeddings of known shape"
        _, index = variant

        def get_embeddings(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                           kwargs: "dict[str, Any]") -> "Any":
            result = wrapped(*args, **kwargs)
            embedding = argument(args, kwargs, EMBEDDING_POSITION, "embedding")
            if not instance.config.sequence_parallel or embedding_scatters(embedding):
                return result
            decoder_input = result[index]
            if decoder_input.shape[0] == argument(args, kwargs, HIDDEN_STATES_POSITION, "hidden_states").shape[0]:
                return result  # already scattered (upstream in a spelling the probe missed): never twice
            group = getattr(instance, "tp_group", None)
            scatter = _scatter_function(module)
            scattered = scatter(decoder_input) if group is None else scatter(decoder_input, group=group)
            return result[:index] + (scattered,) + result[index + 1 :]

        yield module.MultiTokenPredictionLayer, "_get_embeddings", get_embeddings


FIX = SPScatterFix()
