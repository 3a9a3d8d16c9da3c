"""mtp-logprob-skip on stock megatron-core: a logprob forward under ``torch.no_grad()`` (train mode,
as an RL trainer's reference / old-policy pass) runs every MTP depth and records MTP metrics in the
tracker the training step logs."""

from ..runtime.launcher import run_ranks_checked

MTP_DEPTHS = 2


def reproduce():
    recorded, calls = run_ranks_checked(stock_logprob_forward, 1, fixes=[])[0]
    return recorded or calls > 0, (
        f"stock no-grad forward of a GPTModel with {MTP_DEPTHS} MTP layers (train mode, labels=None): the MTP "
        f"layers ran {calls} time(s), MTP metrics recorded in MTPLossLoggingHelper's tracker: {recorded}"
    )


def stock_logprob_forward():
    """Rank worker: (MTP metrics recorded, MTP layer calls) of one no-grad forward of the tiny GPT."""
    from ..models.tiny_gpt import make_batch

    return logprob_forward(build("gpt"), make_batch())[1:]


def build(name):
    """The tiny GPT with `MTP_DEPTHS` MTP layers ("gpt") or the zoo HybridModel ("zoo"), in train mode."""
    from ..models.tiny_gpt import build_tiny_gpt
    from ..models.tiny_hybrid import build_zoo

    model = build_tiny_gpt(mtp_num_layers=MTP_DEPTHS) if name == "gpt" else build_zoo()
    return model.train()


def logprob_forward(model, batch, grad=False):
    """(logits, MTP metrics recorded, MTP layer calls) of one forward without labels (an RL logprob
    pass), with grad enabled or not; the tracker is cleared before and after."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    calls = []
    hooks = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in model.mtp.layers]
    MTPLossLoggingHelper.tracker.clear()
    try:
        with torch.set_grad_enabled(grad):
            logits = model(batch["input_ids"], batch["position_ids"], None)
        tracker = MTPLossLoggingHelper.tracker
        recorded = "total_values" in tracker and bool(tracker["total_values"].ne(0).any())
    finally:
        MTPLossLoggingHelper.tracker.clear()
        for hook in hooks:
            hook.remove()
    return logits.detach(), recorded, len(calls)
