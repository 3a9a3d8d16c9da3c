"""mtp-multimodal: the MTP block of a multimodal model gets the combined-length token ids and loss mask.

megatron-core 0.19.x ``LLaVAModel.forward`` (``models/multimodal/llava_model.py:930``) replaces
each image placeholder of ``input_ids`` by the image's embeddings (``_preprocess_data``, :482), slices
the combined sequence for CP/SP (``_process_embedding_token_parallel``, :749) and calls its language
model with ``input_ids=None``, ``decoder_input=<combined embeddings>``, the combined ``labels`` and no
``loss_mask`` (:1267-1276); ``MimoModel`` (``models/mimo/model/base.py``) does the same with ids that
already have the combined length. The MTP block embeds the *ids* of the next positions itself
(``multi_token_prediction.py:1112``, from :1490): a TypeError in the first forward; and with ids it
would still train on every slot, images included, for lack of the mask.

Per target model (`llava`, `mimo`: how each builds and slices them), the hooks put the combined ids
and mask, in the language model's exact CP layout, in a `combined_inputs.Combined` for the call; the
GPTModel/HybridModel forward (mtp-loss-mask's hook, which calls `combined_inputs.inject` first) hands them to
the language model where its call passes none. Megatron then rolls both with the labels
(``process_mtp_loss``): MTP depth k at slot p trains ``labels[p+k]`` where the combined mask allows,
so no image slot is ever an MTP target; without labels (RL) it derives them from the combined ids and
rolls the caller's input-aligned mask, placed in the combined layout, with them.

No device sync: ids and masks are placed by scatters and elementwise ops. A language model without
MTP layers, an inference forward reusing the KV cache, and a call that carries its own ids or mask
pass untouched.
"""

from ...contract import State, Verdict
from .. import Fix
from . import llava, mimo
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

LOSS_MASK_FIX = "mtp-loss-mask"  # its GPTModel/HybridModel.forward hook hands the combined inputs on
MODELS = {"llava": llava, "mimo": mimo}  # target role -> the module that knows its model


class MultimodalFix(Fix):
    declaration = DECLARATION  # targets "llava" (LLaVAModel) and "mimo" (MimoModel)

    def probe(self, module: "ModuleType") -> Verdict:
        verdict: Verdict = MODELS[self.role_of(module)].probe(module)
        return verdict

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        found: "Iterator[tuple[object, str, Callable[..., Any]]]" = MODELS[self.role_of(module)].wrappers(
            module, self.check_loss_mask_hook)
        return found

    def check_loss_mask_hook(self) -> None:
        """RuntimeError unless fix mtp-loss-mask's forward hook, which hands the combined inputs to the
        language model, is installed (without it the MTP block would crash as on stock). Asked by each
        multimodal forward with MTP, not at install: a target may be imported before the language
        model's modules (MimoModel's module imports neither), when mtp-loss-mask is still pending."""
        state, reason = self.peer_state(LOSS_MASK_FIX)
        if state != State.INSTALLED:
            raise RuntimeError(
                f"fix {self.name!r} builds the combined ids and mask of a multimodal forward, but fix "
                f"{LOSS_MASK_FIX!r}, whose GPTModel/HybridModel.forward hook hands them to the language model, is "
                f"{state} ({reason}): install both (mtp_overlay.install(only=[..., {LOSS_MASK_FIX!r}]))"
            )


FIX = MultimodalFix()
