"""mtp-multimodal on stock megatron-core: MTP on a tiny LLaVAModel (HybridModel language model with an MTP
depth), labels and a prompt-masked loss mask, TP1: the language model gets no token ids."""

from ..runtime.launcher import run_ranks_checked

IMAGES = [[0], [5]]  # an image placeholder at the start of sample 0, in the middle of sample 1


def reproduce():
    run = run_ranks_checked(llava_mtp_forward, 1, fixes=[])[0]
    setup = "stock LLaVAModel (HybridModel with MTP), labels and a prompt-masked loss mask, TP1"
    if run["error"] is not None:
        return True, f"{setup}: {run['error']} (its language model gets input_ids=None)"
    trained, allowed = run["trained"], run["allowed"]
    return trained != allowed, (f"{setup}: the MTP head trained {len(trained)} (slot, target) pairs, the combined mask "
                                f"allows {len(allowed)}" + (" (the same)" if trained == allowed else ""))


def llava_mtp_forward():
    """Rank worker: one forward of the tiny LLaVAModel with MTP (with whatever fixes the run installed):
    ``error`` (None when it ran), the (sample, slot, target) pairs MTP depth 1 ``trained``, those
    ``llava_oracle`` says the combined mask ``allowed``, and how many trained pairs are ``image_targets``."""
    import torch

    from ..oracles import llava_oracle
    from ..models import tiny_llava
    from ..models.packed import record_mtp

    model = tiny_llava.build_tiny_llava(hybrid_layer_pattern="*-*-/*-")
    batch = tiny_llava.make_llava_batch(IMAGES)
    layout = tiny_llava.combined_layout(model, batch)
    allowed = llava_oracle.mtp_pairs(layout, 1)
    try:
        with record_mtp(model) as records:
            model(images=batch["images"], input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                  attention_mask=None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    except Exception as exc:  # noqa: BLE001 - the stock failure is the evidence
        return dict(error=f"{type(exc).__name__}: {exc}", trained=set(), allowed=allowed, image_targets=0)
    targets, on = records[0]["targets"], records[0]["trained"]
    trained = {(int(b), int(p), int(targets[b, p])) for b, p in zip(*torch.nonzero(on, as_tuple=True))}
    wrong = llava_oracle.image_targets(layout, trained, 1)
    return dict(error=None, trained=trained, allowed=allowed, image_targets=len(wrong))
