"""mtp-cp-loss-scale reproducer and measurement: the MTP gradient at CP=2 against CP=1, Megatron's own step.

The tiny GPT with one MTP layer (``mtp_detach_heads``: the MTP block learns from the MTP loss only,
the rest from the LM loss only), batch 2 x 32, one real step through ``get_forward_backward_func()``
-> DDP -> ``finalize_model_grads`` (``megatron_step.MegatronStep``), in every loss mode of `MODES`
and with the masks of `MASKS`. Stock megatron-core 0.19 normalises each CP rank's MTP loss by its own
token counts (Megatron-LM PR #7498): the MTP gradient at CP=2 differs from CP=1's.
"""

import dataclasses

FIX = "mtp-cp-loss-scale"
BATCH_SIZE, SEQ_LENGTH = 2, 32
PROMPT_FRACTION = 0.4  # the uneven mask is zero over the first 40% of every sequence


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way to train: MegatronStep.step's loss shape, labels, mtp_grad_scale, and the config's
    ``calculate_per_token_loss``."""

    loss: str
    per_token: bool
    mtp_grad_scale: object = None
    labels: bool = True


MODES = {
    "2-output": Mode("2-output", False),
    "3-output, per-token": Mode("3-output", True),
    "3-output": Mode("3-output", False),
    "2-output, constant mtp_grad_scale_func 0.5": Mode("2-output", False, 0.5),
    "NeMo-RL: per-token, mtp_grad_scale_func 1/global valid tokens": Mode("nemo-rl", True, "global-valid-tokens"),
    "NeMo-RL, RL forward (labels=None)": Mode("nemo-rl", True, "global-valid-tokens", labels=False),
}
# uneven: zero over the first 40% of every sequence; all-ones; middle: ones on positions 8-23 only,
# so under CP2 every LM token sits on CP rank 1 while rank 0 still holds one MTP target (position 7)
MASKS = ("uneven", "all-ones", "middle")


def microbatch(mask, labels=True, vocab_size=128):
    """The batch of ``tiny_gpt.make_batch`` with the ``mask`` of MASKS.

    labels=True: ``loss_mask`` (label-aligned) is the mask. labels=False (RL): the mask is the
    input_ids-aligned ``mtp_loss_mask`` and the LM loss mask is it shifted to the labels.
    """
    import torch

    from ..models.tiny_gpt import make_batch

    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    batch = make_batch(batch_size=BATCH_SIZE, seq_length=SEQ_LENGTH, vocab_size=vocab_size)
    tokens = torch.ones(BATCH_SIZE, SEQ_LENGTH)
    if mask == "uneven":
        tokens[:, : int(PROMPT_FRACTION * SEQ_LENGTH)] = 0
    elif mask == "middle":
        tokens[:, : SEQ_LENGTH // 4] = 0
        tokens[:, 3 * SEQ_LENGTH // 4 :] = 0
    if labels:
        batch["loss_mask"] = tokens
    else:  # label i is token i+1: trained when token i+1 is (the last label's token is past the window)
        batch["mtp_loss_mask"] = tokens
        batch["loss_mask"] = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    return batch


def measure(modes=None, masks=MASKS, variants=("stock", "fixed"), sequence_parallel=False, vocab_size=128,
            **model_overrides):
    """Rank worker: one MegatronStep per mode and mask, stock (fix off) and fixed (fix on).

    Returns, on global rank 0, ``{(mode, mask): {variant: MegatronStepResult}}`` (None elsewhere).
    Gradients only (no optimizer step): every step starts from the same weights. A small
    ``vocab_size`` (8) lets the untrained MTP head guess some tokens: a non-zero acceptance rate.
    ``model_overrides`` go to ``build_tiny_gpt`` (e.g. MoE settings, ``mtp_loss_scaling_factor``).
    """
    import torch

    import mtp_overlay

    from ..steps.megatron_step import MegatronStep
    from ..models.tiny_gpt import build_tiny_gpt

    steps = {}
    results = {}
    for name in modes or MODES:
        mode = MODES[name]
        if mode.per_token not in steps:
            model = build_tiny_gpt(
                sequence_parallel=sequence_parallel, mtp_detach_heads=True, calculate_per_token_loss=mode.per_token,
                vocab_size=vocab_size, **model_overrides,
            )
            steps[mode.per_token] = MegatronStep(model, optimizer=None)
        for mask in masks:
            batch = microbatch(mask, mode.labels, vocab_size)
            row = results[(name, mask)] = {}
            for variant in variants:
                if variant == "fixed":
                    mtp_overlay.install(only=[FIX])
                else:
                    mtp_overlay.uninstall(only=[FIX])
                row[variant] = steps[mode.per_token].step(
                    [batch], loss=mode.loss, labels=mode.labels, mtp_grad_scale=mode.mtp_grad_scale, update=False
                )
    mtp_overlay.uninstall(only=[FIX])
    return results if torch.distributed.get_rank() == 0 else None


def reproduce():
    """Stock megatron-core, fix off: the MTP-block gradient at CP=2 against CP=1 (2-output loss,
    uneven mask). Returns (bug shows, evidence)."""
    from ..runtime.launcher import run_ranks_checked

    key = ("2-output", "uneven")
    options = dict(modes=[key[0]], masks=[key[1]], variants=("stock",))
    cp1 = run_ranks_checked(measure, 1, fixes=[], kwargs=options)[0][key]["stock"]
    cp2 = run_ranks_checked(measure, 2, cp=2, fixes=[], kwargs=options)[0][key]["stock"]
    mtp, lm = cp2.relative_error(cp1, "mtp"), cp2.relative_error(cp1, "lm")
    return mtp > 1e-3, (
        f"stock Megatron step, 2-output loss, loss mask zero over the first {PROMPT_FRACTION:.0%}: MTP-block "
        f"gradient relerr CP2 vs CP1 {mtp:.3g} (LM {lm:.2g}); logged mtp_1_loss CP1 {cp1.mtp_loss:.5f}, "
        f"CP2 {cp2.mtp_loss:.5f}"
    )
