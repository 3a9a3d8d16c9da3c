"""mtp-multimodal on stock megatron-core: MTP on a tiny LLaVAModel (HybridModel language model with an MTP
depth), labels and a prompt-masked loss mask, TP1: the language model gets no token ids."""

from ..launcher import run_ranks_checked

IMAGES = [[0], [5]]  # an image placeholder at the start of sample 0, in the middle of sample 1


def reproduce():
    error, trained, allowed = run_ranks_checked(stock_llava_mtp, 1, fixes=[])[0]
    setup = "stock LLaVAModel (HybridModel with MTP), labels and a prompt-masked loss mask, TP1"
    if error is not None:
        return True, f"{setup}: {error} (its language model gets input_ids=None)"
    return trained != allowed, (f"{setup}: the MTP head trained {len(trained)} (slot, target) pairs, the combined mask "
                                f"allows {len(allowed)}" + (" (the same)" if trained == allowed else ""))


def stock_llava_mtp():
    """Rank worker: one forward of the tiny LLaVAModel with MTP; (the error, or None; the (sample, slot,
    target) pairs MTP depth 1 trained; those ``llava_oracle`` says the combined mask allows)."""
    import torch

    from .. import llava_oracle, tiny_llava
    from ..packed import record_mtp

    model = tiny_llava.build_tiny_llava(hybrid_layer_pattern="*-*-/*-")
    batch = tiny_llava.make_llava_batch(IMAGES)
    allowed = llava_oracle.mtp_pairs(tiny_llava.combined_layout(model, batch), 1)
    try:
        with record_mtp(model) as records:
            model(images=batch["images"], input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                  attention_mask=None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    except Exception as exc:  # noqa: BLE001 - the stock failure is the evidence
        return f"{type(exc).__name__}: {exc}", set(), allowed
    targets, on = records[0]["targets"], records[0]["trained"]
    trained = {(int(b), int(p), int(targets[b, p])) for b, p in zip(*torch.nonzero(on, as_tuple=True))}
    return None, trained, allowed
