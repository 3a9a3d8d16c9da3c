"""mtp-loss-mask against what it let through: a boundary guard that needed a mask, a label-aligned mask, other devices, bad config values.

* Real-lengths packing (``cu_seqlens_q`` apart from ``cu_seqlens_q_padded``) with mtp-packed-roll off
  and no ``loss_mask``: stock trains shifted (position, target) pairs at CP=1 (pad tokens among the
  targets) and raises an IndexError at CP=2; the guard refuses the forward, mask or none.
* The LM loss's label-aligned mask handed to an RL forward as the MTP mask trains every MTP target
  one token early, silently; refused where the alignment is not said, converted where it is.
* A mask on another device than the tokens, and ``apply_mtp_config`` values of the wrong kind.

The packed cases run the tiny HybridModel's real forward+backward (`packed.run_packed`) on gloo
ranks, at CP=1 and CP=2, fix off and on, against what each sequence alone trains
(`packed.expected_mtp`). Wall time on 2 shared cores (load ~7), alone: 20 s, CP=2 (slow) 18 s more.
"""

import dataclasses

import pytest
import torch

from mtp_overlay import mtp
from mtp_overlay.bed.runtime.launcher import run_ranks_checked

ROLL, MASK, SCALE = "mtp-packed-roll", "mtp-loss-mask", "mtp-cp-loss-scale"
LENGTHS, PROMPTS = (9, 12, 6, 4), (2, 0, 3, 1)
PAD_MULTIPLE = 4
STARTS = tuple(sum(-(-n // PAD_MULTIPLE) * PAD_MULTIPLE for n in LENGTHS[:i]) for i in range(len(LENGTHS) + 1))


def trained_pairs(result):
    return sorted(result.trained()) if result.error is None else result.error


def expected_pairs(row):
    from mtp_overlay.bed.models.packed import expected_mtp

    weights, targets = expected_mtp(row, labels=False)
    return sorted((slot, int(targets[slot])) for slot in range(len(weights)) if weights[slot] != 0)


def packed_cases(cases):
    """Rank worker: each (name, fixes, row kwargs, mask, route, aligned) case's packed RL forward on
    the tiny HybridModel with exactly those fixes; per case (trained pairs or the error, expected pairs)."""
    import mtp_overlay
    from mtp_overlay.bed.engines import parity
    from mtp_overlay.bed.models.packed import make_packed_row, run_packed

    mtp_overlay.uninstall()
    model = parity.build("hybrid")
    out = {}
    for name, fixes, prompts, mask, route, aligned in cases:
        mtp_overlay.uninstall()
        mtp_overlay.install(only=list(fixes))
        row = make_packed_row(LENGTHS, pad_multiple=PAD_MULTIPLE, flavour="unpadded", prompts=prompts)
        if mask == "label-aligned":  # the LM loss's mask: label i is token i + 1
            row = dataclasses.replace(row, loss_mask=row.microbatch(labels=False)["loss_mask"])
        elif mask == "converted":  # the label-aligned mask turned back, full rows, before CP sharding
            label = row.microbatch(labels=False)["loss_mask"]
            row = dataclasses.replace(row, loss_mask=mtp.input_aligned_mask(label, row.cu_seqlens_padded))
        with mtp.loss_mask_scope(None, aligned=aligned):
            result = run_packed(model, row, labels=False, loss_mask=route)
        out[name] = (trained_pairs(result.portable()), expected_pairs(row))
    mtp_overlay.uninstall()
    padding = ~make_packed_row(LENGTHS, pad_multiple=PAD_MULTIPLE).real_slots()
    return out, set(padding.nonzero().flatten().tolist())


NO_MASK = [  # item 4: no loss_mask at all (every real token trains), packed-roll off
    ("no mask, stock", (), (0, 0, 0, 0), None, None, None),
    ("no mask, mtp-loss-mask", (MASK,), (0, 0, 0, 0), None, None, None),
    ("no mask, every fix", (MASK, ROLL, SCALE), (0, 0, 0, 0), None, None, None),
]
ALIGNED = [  # item 5: the response mask of PROMPTS, input- or label-aligned, with mtp-packed-roll
    ("input-aligned, every fix", (MASK, ROLL, SCALE), PROMPTS, "input-aligned", "explicit", None),
    ("label-aligned, without mtp-loss-mask", (ROLL, SCALE), PROMPTS, "label-aligned", "explicit", None),
    ("label-aligned, every fix", (MASK, ROLL, SCALE), PROMPTS, "label-aligned", "explicit", None),
    ("label-aligned scoped as such, every fix", (MASK, ROLL, SCALE), PROMPTS, "label-aligned", "scoped", "label"),
    ("converted, every fix", (MASK, ROLL, SCALE), PROMPTS, "converted", "explicit", None),
]


@pytest.fixture(scope="module", params=[pytest.param(1, id="CP1"), pytest.param(2, id="CP2", marks=pytest.mark.slow)])
def packed(request):
    cp = request.param
    ranks = run_ranks_checked(packed_cases, cp, cp=cp, fixes=[MASK, ROLL, SCALE], args=(NO_MASK + ALIGNED,), timeout=600)
    return (cp, *ranks[0])


def test_real_lengths_without_the_packed_roll_are_refused_with_no_mask_too(packed):
    cp, out, padding = packed
    stock, expected = out["no mask, stock"]
    # stock rolls on cu_seqlens_q while the row sits on the padded layout: it trains padding slots and
    # misses real targets (or, on other packings under CP, raises an IndexError)
    assert isinstance(stock, list), stock
    assert {slot for slot, _ in stock} & padding and set(expected) - set(stock), (stock, expected)
    refused, _ = out["no mask, mtp-loss-mask"]
    real = [sum(LENGTHS[:i]) for i in range(len(LENGTHS) + 1)]
    assert refused.startswith(f"ValueError: packed_seq_params.cu_seqlens_q {real} differs from cu_seqlens_q_padded "
                              f"{list(STARTS)}, and fix mtp-packed-roll is disabled"), refused
    fixed, expected = out["no mask, every fix"]
    assert fixed == expected  # with the packed roll: each sequence's own pairs


def test_a_label_aligned_mtp_mask_is_refused_unless_said_and_then_converted(packed):
    cp, out, _ = packed
    right, expected = out["input-aligned, every fix"]
    assert right == expected and len(expected) > 0  # no false alarm on the unshifted mask
    silent, _ = out["label-aligned, without mtp-loss-mask"]
    # one token early, no error: each sequence's last MTP target is never trained
    lasts = {max(pair for pair in expected if start <= pair[0] < end)
             for start, end in zip(STARTS, STARTS[1:]) if any(start <= pair[0] < end for pair in expected)}
    assert isinstance(silent, list) and set(expected) - set(silent) == lasts and len(lasts) == len(LENGTHS)
    refused, _ = out["label-aligned, every fix"]
    assert refused.startswith("ValueError: loss_mask looks label-aligned: each of the 4 weighted packed sequence(s) "
                              "is 0 on its last real token"), refused
    converted, _ = out["converted, every fix"]
    assert converted == expected  # input_aligned_mask on the full rows: exact at any CP size
    scoped, _ = out["label-aligned scoped as such, every fix"]
    if cp == 1:
        assert scoped == expected  # the hook shifts it
    else:
        assert scoped.startswith("ValueError: loss_mask_scope(aligned='label') in an RL forward (labels=None) under "
                                 "context parallelism"), scoped


def test_input_aligned_mask_is_the_unshifted_mask_on_rows_and_packed_sequences():
    tokens = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float)
    label = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # NeMo-RL's token_mask[:, 1:], padded back
    restored = mtp.input_aligned_mask(label)
    assert torch.equal(restored[:, 1:], tokens[:, 1:]) and not restored[:, 0].any()  # token 0 is never a target
    packed = mtp.pack_sequences(torch.ones(2, 6, dtype=torch.int64), [5, 6], tokens, pad_multiple=4)
    label_row = torch.cat([torch.cat([tokens[0, 1:5], torch.zeros(4)]), torch.cat([tokens[1, 1:], torch.zeros(3)])])
    back = mtp.input_aligned_mask(label_row[None], packed.cu_seqlens_padded)
    starts = packed.cu_seqlens_padded[:-1].long()
    want = packed.loss_mask.clone()
    want[0, starts] = 0
    assert torch.equal(back, want)
    with pytest.raises(ValueError, match=r"aligned must be one of \('input', 'label'\) or None"):
        with mtp.loss_mask_scope(tokens, aligned="labels"):
            pass


def test_a_mask_on_another_device_is_a_value_error_naming_both():
    ids = torch.arange(8).reshape(2, 4)
    elsewhere = torch.ones(2, 4, device="meta")
    for check in (mtp.check_loss_mask_layout, mtp.assert_loss_mask_layout):
        with pytest.raises(ValueError, match="loss_mask is on meta but input_ids on cpu: the MTP loss mask must be on "
                                             "the tokens' device"):
            check(ids, elsewhere)


@pytest.mark.parametrize(("key", "value"), [
    ("mtp_num_layers", "two"), ("mtp_num_layers", -1), ("mtp_num_layers", True), ("mtp_num_layers", 1.0),
    ("mtp_loss_scaling_factor", "0.1"), ("mtp_loss_scaling_factor", float("nan")), ("mtp_loss_scaling_factor", -0.5),
    ("mtp_detach_heads", "yes"), ("mtp_use_repeated_layer", 1),
])
def test_apply_mtp_config_refuses_values_of_the_wrong_kind_and_sets_nothing(key, value):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    before = dict(vars(config))
    with pytest.raises(ValueError, match=rf"mtp_config\[{key!r}\] must be .*, got {type(value).__name__}"):
        mtp.apply_mtp_config(config, {"mtp_num_layers": 2, key: value})
    assert vars(config) == before
    assert mtp.apply_mtp_config(config, {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}).mtp_num_layers == 2
