"""mtp-packed-roll with mtp-loss-mask and mtp-sp-scatter on at once, in a real training step.

Unpacked rows under CP=2 (the CP test bed runs unpacked batches): the fix reroutes roll_tensor's
CP exchange (one all-gather on the CP group instead of world-group send/recv) and must leave the
step's numbers exactly as stock's: the MTP loss, its token count and the MTP block's gradients.
"""

from mtp_overlay.bed.runtime.launcher import run_ranks_checked

ALL = ["mtp-sp-scatter", "mtp-loss-mask", "mtp-packed-roll"]


def step_with_and_without_the_fix():
    import torch

    import mtp_overlay
    from mtp_overlay import mtp
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, cp_slice, make_batch, train_step

    model = build_tiny_gpt()
    states = {row.name: row.state for row in mtp_overlay.status(only=ALL)}
    batch = make_batch(batch_size=2, seq_length=32)
    token_mask = (torch.arange(32) >= 6).float().expand(2, 32)
    mask = cp_slice(mtp.build_mtp_loss_mask(token_mask, torch.tensor([1.0, 1.0]), model))

    def run():
        with mtp.loss_mask_scope(mask):
            step = train_step(model, batch, labels=None, loss_mask=None)
        grads = [p.grad.tolist() for name, p in model.named_parameters() if name.startswith("mtp.")]
        return step.mtp_losses, step.mtp_tokens, grads

    fixed = run()
    mtp_overlay.uninstall(only=["mtp-packed-roll"])
    return states, fixed, run()


def test_cp2_step_with_all_three_fixes_equals_stock_rolls():
    for states, fixed, stock in run_ranks_checked(step_with_and_without_the_fix, 2, cp=2, fixes=ALL):
        assert states == {"mtp-sp-scatter": "installed", "mtp-loss-mask": "installed", "mtp-packed-roll": "installed"}
        assert fixed[1] == stock[1] and fixed[1][0] == 2 * (32 - 6)  # depth 1 weights position i by mask[i + 2]
        assert fixed[0] == stock[0] and fixed[2] == stock[2]
