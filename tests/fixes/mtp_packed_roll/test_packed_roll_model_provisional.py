"""PROVISIONAL model-level check of mtp-packed-roll: the tiny GPT + 1 MTP layer, packed THD, TP1/CP1.

Provisional: the packed (THD) CPU test bed is being built separately; until it lands, this file
carries its own minimal varlen attention (``packed_attention`` below, test scaffolding only: exact
causal softmax attention within each padded sequence). It will be replaced by the test bed's, and
extended to CP=2 and TP2xCP2+SP.

What it shows on stock megatron-core 0.19.2: a packed batch of padded sequences, labels=None (MTP
labels derived from input_ids), the loss mask on real tokens, trains the MTP head exactly like the
same sequences run one by one unpacked (MTP loss, token count, and the MTP block's gradients, the
packed gradient being the token-weighted mean of the per-sequence ones) with the fix on; stock
(fix off) differs.
"""

import pytest

from mtp_overlay.testing.launcher import run_ranks_checked

REAL, PADDED = (5, 9, 3, 12), (8, 12, 4, 12)
VOCAB = 32


def packed_attention(original):
    """DotProductAttention.forward that also takes THD packs (query [t, np, hn]): causal attention
    within each padded sequence of ``packed_seq_params``; anything else goes to ``original``."""
    import torch

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        tokens = query.shape[0]
        position = torch.arange(tokens)
        sequence = torch.bucketize(position, cu[1:].long(), right=True)
        allowed = (sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None])
        scores = torch.einsum("qhd,khd->hqk", query, key) * self.softmax_scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, value).reshape(tokens, -1)

    return forward


def packed_vs_unpacked():
    """Rank worker (TP1): the packed step with the fix on and off, and each sequence alone."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    import mtp_overlay
    from mtp_overlay.testing.packed_reference import packed_params
    from mtp_overlay.testing.tiny_gpt import build_tiny_gpt, train_step

    original = DotProductAttention.forward
    DotProductAttention.forward = packed_attention(original)
    try:
        model = build_tiny_gpt(vocab_size=VOCAB)
        generator = torch.Generator().manual_seed(7)
        texts = [torch.randint(1, VOCAB, (length + 1,), generator=generator) for length in REAL]

        def mtp_grads():  # plain lists: tensors would travel back through shared memory the rank frees
            return {name: p.grad.tolist() for name, p in model.named_parameters() if name.startswith("mtp.")}

        alone = []
        for text in texts:
            batch = dict(input_ids=text[None, :-1], labels=text[None, 1:], loss_mask=torch.ones(1, len(text) - 1),
                         position_ids=torch.arange(len(text) - 1)[None])
            step = train_step(model, batch, labels=None)
            alone.append((step.mtp_losses[0], step.mtp_tokens[0], mtp_grads()))

        def pack(pieces, fill):
            return torch.cat([torch.cat([p, p.new_full((slots - len(p),), fill)]) for p, slots in zip(pieces, PADDED)])[None]

        packed = dict(
            input_ids=pack([t[:-1] for t in texts], 0), labels=pack([t[1:] for t in texts], 0),
            loss_mask=pack([torch.ones(len(t) - 1) for t in texts], 0.0),
            position_ids=pack([torch.arange(len(t) - 1) for t in texts], 0),
        )
        params = packed_params(REAL, PADDED)
        fixed = train_step(model, packed, labels=None, packed_seq_params=params)
        fixed = (fixed.mtp_losses[0], fixed.mtp_tokens[0], mtp_grads())
        mtp_overlay.uninstall(only=["mtp-packed-roll"])
        stock = train_step(model, packed, labels=None, packed_seq_params=params)
        stock = (stock.mtp_losses[0], stock.mtp_tokens[0], mtp_grads())
    finally:
        DotProductAttention.forward = original
    return alone, fixed, stock


@pytest.mark.slow
def test_packed_padded_thd_trains_the_mtp_head_like_unpacked_sequences():
    # mtp-loss-mask stays off: it refuses cu_seqlens_q != cu_seqlens_q_padded until it learns of this fix
    import torch

    def tensors(run):
        loss, count, grads = run
        return loss, count, {name: torch.tensor(grad) for name, grad in grads.items()}

    alone, fixed, stock = run_ranks_checked(packed_vs_unpacked, 1, fixes=["mtp-packed-roll", "mtp-sp-scatter"])[0]
    alone, fixed, stock = [tensors(run) for run in alone], tensors(fixed), tensors(stock)
    tokens = sum(count for _, count, _ in alone)
    loss = sum(value * count for value, count, _ in alone) / tokens
    grads = {name: sum(g[name] * count for _, count, g in alone) / tokens for name in alone[0][2]}

    def gap(run):
        return max(float((run[2][name] - grads[name]).abs().max()) for name in grads)

    assert fixed[1] == tokens == sum(length - 2 for length in REAL)
    assert fixed[0] == pytest.approx(loss, abs=1e-5) and gap(fixed) < 1e-5
    assert abs(stock[0] - loss) > 1e-3 or stock[1] != tokens
    assert gap(stock) > 1e-3
