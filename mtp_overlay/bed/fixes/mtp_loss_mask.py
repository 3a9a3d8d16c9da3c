"""mtp-loss-mask on stock megatron-core: an RL forward (labels=None) trains the MTP head on every
position, while the trainer's response-only mask of kept samples allows far fewer."""

from ..runtime.launcher import run_ranks_checked


def reproduce():
    trained, allowed = run_ranks_checked(scoped_mask_mtp_positions, 1, fixes=[])[0]
    return trained != allowed, (
        f"stock RL forward (labels=None): the MTP head trained on {trained:.0f} positions, "
        f"the response mask of kept samples allows {allowed:.0f}"
    )


def scoped_mask_mtp_positions():
    """Rank worker: MTP positions megatron-core trains in an RL forward (labels=None, no loss_mask
    passed) while the trainer scopes a response-only mask, and the positions that mask allows."""
    import torch

    from mtp_overlay.mtp import build_mtp_loss_mask, loss_mask_scope

    from ..models.tiny_gpt import build_tiny_gpt, make_batch, train_step

    model, batch = build_tiny_gpt(), make_batch(batch_size=2, seq_length=32)
    token_mask = (torch.arange(32) >= 8).float().expand(2, 32)  # 8 prompt tokens per row
    mask = build_mtp_loss_mask(token_mask, torch.tensor([1.0, 0.0]), model)  # second sample filtered out
    with loss_mask_scope(mask):
        step = train_step(model, batch, labels=None, loss_mask=None)  # the trainer passes no mask
    return step.mtp_tokens[0], float(mask[:, 2:].sum())  # depth 1 weights position i by mask[i+2]
