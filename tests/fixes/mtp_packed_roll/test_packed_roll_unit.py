"""mtp-packed-roll at unit level: the pinned megatron-core's installed roll on hand-built padded packs.

Every case runs the installed ``roll_tensor`` with the fix on and the stock function (the installed
upstream code, unwrapped) in the same test, position by position against an independent
per-sequence reference (``mtp_overlay.bed.oracles.packed_reference``). CP=1 runs in this process under
hypothesis; CP=2 and CP=4 replay batches of hypothesis-drawn packs inside one spawned gloo run each.
"""

import inspect
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import mtp_overlay
from mtp_overlay import registry
from mtp_overlay.bed.oracles import packed_reference as ref
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.fixes import mtp_packed_roll as reproducer
from mtp_overlay.bed.runtime.syncs import checks_mode

FIX = "mtp-packed-roll"
DTYPES = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool}


# --- packs -----------------------------------------------------------------------------------------
@st.composite
def packs(draw, cp_size):
    """A padded pack as a plain dict: real and padded lengths, whether cu_seqlens_q_padded is
    given, rows, dtype, and a seed for the values."""
    count = draw(st.integers(0, 6))
    multiple = 2 * cp_size * draw(st.integers(1, 3)) if cp_size > 1 else draw(st.integers(1, 8))
    real = draw(st.lists(st.integers(0, 40), min_size=count, max_size=count))
    padded = [-(-length // multiple) * multiple + multiple * draw(st.integers(0, 1)) for length in real]
    padded_given = draw(st.booleans())
    if not padded_given:  # laid out on cu_seqlens_q alone: the real boundaries are the padded ones
        real = list(padded)
    return dict(real=real, padded=padded, padded_given=padded_given, rows=draw(st.integers(1, 2)),
                dtype=draw(st.sampled_from(sorted(DTYPES))), seed=draw(st.integers(0, 2**16)))


def full_row(pack):
    """The pack's global [rows, T] row: int values 1..999 (never 0), float 0/1 masks that are
    nonzero on padding too, random bools."""
    generator = torch.Generator().manual_seed(pack["seed"])
    shape = (pack["rows"], sum(pack["padded"]))
    if pack["dtype"] == "int64":
        return torch.randint(1, 1000, shape, generator=generator)
    values = torch.randint(0, 2, shape, generator=generator)
    return values.bool() if pack["dtype"] == "bool" else values.float()


def params(pack):
    return ref.packed_params(pack["real"], pack["padded"] if pack["padded_given"] else None)


def draw_packs(strategy, count):
    """``count`` hypothesis-drawn examples of ``strategy``, to replay inside one spawned run."""
    drawn = []

    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn


def stock_roll(module):
    """The installed upstream roll functions, seen through the overlay's wrappers."""
    return inspect.unwrap(module.roll_tensor), inspect.unwrap(module._roll_tensor_packed_seq)


# --- CP=1, in this process --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_module():
    import megatron.core.transformer.multi_token_prediction as module

    mtp_overlay.install(only=[FIX])
    state = registry.lifecycle(FIX).state()
    assert state[0] == "installed", state
    return module


@settings(max_examples=300, deadline=None)
@given(pack=packs(1))
def test_cp1_roll_matches_the_per_sequence_reference_and_stock_only_without_padding(pack, mtp_module):
    row = full_row(pack)
    want = ref.reference_roll(row, pack["real"], pack["padded"])
    got, count = mtp_module.roll_tensor(row, -1, -1, None, params(pack))
    assert torch.equal(got, want), (pack, got, want)
    assert torch.equal(count, got.sum())

    _, stock_packed = stock_roll(mtp_module)
    stock, _ = stock_packed(row, -1, -1, params(pack), None)
    if pack["real"] == pack["padded"]:
        assert torch.equal(stock, got)  # no padding: stock was right, the fix changes nothing
    elif pack["dtype"] == "int64":
        assert not torch.equal(stock, want)  # padding: stock rolls on the real boundaries


def test_measured_case_stock_trains_padding_and_misses_a_real_target(mtp_module):
    """lengths 3,5 padded to 4,8: MTP depth 1 with labels=None, process_mtp_loss's order of rolls."""
    small = reproducer.SMALL
    ids = torch.tensor([small["tokens"]])
    mask = (ids != reproducer.PAD).float()
    packed = ref.packed_params(small["real"], small["padded"])
    _, stock_packed = stock_roll(mtp_module)

    def stock(tensor, **kwargs):
        return stock_packed(tensor, kwargs["shifts"], kwargs["dims"], kwargs["packed_seq_params"], None)

    def expected(tensor, **_):
        return ref.reference_roll(tensor, small["real"], small["padded"]), None

    pad = reproducer.PAD
    want = ref.trained_pairs(ids, *ref.mtp_targets(expected, ids, mask, 1)[:2])
    assert want == {(0, 11, 13), (4, 21, 23), (5, 22, 24), (6, 23, 25)}
    stock_pairs = ref.trained_pairs(ids, *ref.mtp_targets(stock, ids, mask, 1, packed_seq_params=packed)[:2])
    assert stock_pairs - want == {(3, pad, 22), (8, 25, 25)} and want - stock_pairs == {(6, 23, 25)}

    labels, rolled_mask, count = ref.mtp_targets(mtp_module.roll_tensor, ids, mask, 1, packed_seq_params=packed)
    assert ref.trained_pairs(ids, labels, rolled_mask) == want
    assert float(count) == len(want)  # process_mtp_loss divides the depth-1 loss by this count


def test_7278_semantics_last_real_token_and_padding_are_masked(mtp_module):
    ones = torch.ones(1, 8)
    rolled, count = mtp_module.roll_tensor(ones, -1, -1, None, ref.packed_params([7], [8]))
    assert rolled.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]] and float(count) == 6
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 1, 0]])
    assert mtp_module.roll_tensor(mask, -1, -1, None, ref.packed_params([7], [8]))[0].tolist() == rolled.tolist()


@pytest.mark.parametrize(
    ("real", "padded", "length", "message", "on_device"),
    [
        ([3, 5], [4], 12, r"cu_seqlens_q_padded has 2 entries, shorter than cu_seqlens_q \(3\)", False),
        ([3, 5], [4, 4], 8, r"cu_seqlens_q_padded is inconsistent with cu_seqlens_q: sequence 1 has 5 real tokens but a padded slot of 4", True),
        ([3, 5], [4, 8], 10, r"tensor to roll has 10 slots on this CP rank.*cu_seqlens_q_padded .* ends at 12", True),
    ],
)
def test_bad_boundaries_are_refused_naming_the_argument(real, padded, length, message, on_device, mtp_module):
    def roll():
        return mtp_module.roll_tensor(torch.ones(1, length), -1, -1, None, ref.packed_params(real, padded))

    with checks_mode("full"), pytest.raises(ValueError, match=message):
        roll()
    if not on_device:  # a shape: refused on the host in every mode
        with pytest.raises(ValueError, match=message):
            roll()
        return
    # the default mode refuses values on the device (MTP_OVERLAY_CHECKS=full names the detail)
    with pytest.raises(RuntimeError, match=r"^mtp-overlay: cu_seqlens_q(_padded)?: start 0, never decrease.*MTP_OVERLAY_CHECKS=full"):
        roll()


def test_non_integer_boundaries_are_refused(mtp_module):
    packed = ref.packed_params([3], [4])
    packed.cu_seqlens_q_padded = packed.cu_seqlens_q_padded.float()
    with pytest.raises(ValueError, match="cu_seqlens_q_padded must hold integers"):
        mtp_module.roll_tensor(torch.ones(1, 4), -1, -1, None, packed)


# --- CP=2 and CP=4, spawned gloo ranks ---------------------------------------------------------------
def roll_packs(batch):
    """Rank worker: every pack through the installed roll (fix on); where stock is defined (no
    padding) through stock too; unpacked rows through roll_tensor's CP path, hooked and stock.
    Returns, per pack, (positions that differ from the reference, count right, stock agrees)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    group = parallel_state.get_context_parallel_group()
    size, rank = group.size(), group.rank()
    stock_tensor, stock_packed = stock_roll(mtp)
    results = []
    for pack in batch:
        row = full_row(pack)
        local = ref.cp_local(row, pack["padded"], size, rank)
        want = ref.cp_local(ref.reference_roll(row, pack["real"], pack["padded"]), pack["padded"], size, rank)
        got, count = mtp.roll_tensor(local, -1, -1, group, params(pack))
        stock_agrees = None
        if pack["real"] == pack["padded"]:
            stock_agrees = torch.equal(stock_packed(local, -1, -1, params(pack), group)[0], got)
        results.append(((got != want).nonzero().tolist(), torch.equal(count, got.sum()), stock_agrees))
    for length in (2, 6, 16):  # unpacked rows [2, length] per rank: one sequence of length * size
        row = torch.arange(1, 2 * length * size + 1).reshape(2, -1)
        local = ref.cp_local(row, [length * size], size, rank)
        want = ref.cp_local(ref.reference_roll(row, [length * size], [length * size]), [length * size], size, rank)
        got, count = mtp.roll_tensor(local, -1, -1, group, None)
        stock = stock_tensor(local, -1, -1, group, None)[0]
        results.append(((got != want).nonzero().tolist(), torch.equal(count, got.sum()), torch.equal(stock, got)))
    return results


def assert_batch(batch, per_rank):
    unpacked = len(per_rank[0]) - len(batch)
    for rank, results in enumerate(per_rank):
        for index, (wrong, count_ok, stock_agrees) in enumerate(results):
            what = batch[index] if index < len(batch) else f"unpacked row {index - len(batch)}"
            assert wrong == [] and count_ok, f"rank {rank}: {what}: positions {wrong[:8]} differ from the reference"
            assert stock_agrees in (None, True), f"rank {rank}: {what}: stock and the fix disagree without padding"
    assert unpacked == 3
    return sum(pack["real"] == pack["padded"] for pack in batch)


@pytest.mark.slow
def test_cp4_roll_matches_the_per_sequence_reference_on_hypothesis_packs():
    batch = draw_packs(packs(4), 200)
    per_rank = run_ranks_checked(roll_packs, 4, cp=4, args=(batch,), fixes=[FIX], timeout=600)
    unpadded = assert_batch(batch, per_rank)
    assert len(batch) >= 150 and unpadded >= 10  # hypothesis drew enough of both kinds


def cp2_worker(batch):
    """Rank worker (CP=2, fix on): the hypothesis batch, the reproducer's packs, then stock's
    failures (last: stock leaves the ranks' exchanges out of step)."""
    return {"batch": roll_packs(batch), "reproducer": reproducer.packed_rolls(), "stock": stock_breaks_under_cp2()}


@pytest.fixture(scope="module")
def cp2_run():
    """One spawned CP=2 run for every CP=2 assertion below (a spawn costs seconds of imports); a fresh
    pool, never a shared one: stock's failure leaves its ranks' exchanges out of step."""
    batch = draw_packs(packs(2), 200)
    return batch, run_ranks_checked(cp2_worker, 2, cp=2, args=(batch,), fixes=[FIX], timeout=600, fresh=True)


def test_cp2_roll_matches_the_per_sequence_reference_on_hypothesis_packs(cp2_run):
    batch, ranks = cp2_run
    unpadded = assert_batch(batch, [out["batch"] for out in ranks])
    assert len(batch) >= 150 and unpadded >= 10  # hypothesis drew enough of both kinds


def stock_breaks_under_cp2():
    """Rank worker (CP=2): the fix's roll, then stock, on lengths 5,7 padded to 8 (stock runs,
    silently wrong) and on lengths 3,5 padded to 4,8 (stock fails); bad input; which groups the
    hooked roll and stock communicate on."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    group = parallel_state.get_context_parallel_group()
    size, rank = group.size(), group.rank()
    _, stock_packed = stock_roll(mtp)
    out = {}

    calls = []
    originals = {name: getattr(dist, name) for name in ("isend", "irecv", "all_gather_single", "all_gather_into_tensor")}

    def recording(name):
        def call(*args, **kwargs):
            calls.append((name, kwargs.get("group")))
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, recording(name))
    try:
        for key, real, padded in (("5,7->8", [5, 7], [8, 8]), ("3,5->4,8", [3, 5], [4, 8])):
            row = torch.tensor([list(range(1, sum(padded) + 1))])
            local = ref.cp_local(row, padded, size, rank)
            want = ref.cp_local(ref.reference_roll(row, real, padded), padded, size, rank)
            calls.clear()
            fixed = mtp.roll_tensor(local, -1, -1, group, ref.packed_params(real, padded))[0]
            out[key] = {"fixed_wrong": int((fixed != want).sum()),
                        "fixed_groups": sorted({(n, g is group) for n, g in calls})}
        row = torch.tensor([list(range(1, 17))])
        local = ref.cp_local(row, [8, 8], size, rank)
        calls.clear()
        stock = stock_packed(local, -1, -1, ref.packed_params([5, 7], [8, 8]), group)[0]
        want = ref.cp_local(ref.reference_roll(row, [5, 7], [8, 8]), [8, 8], size, rank)
        out["5,7->8"].update(stock_wrong=int((stock != want).sum()), stock_groups=sorted({(n, g is group) for n, g in calls}))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

    uneven = ref.packed_params([5, 6], [6, 6])  # 6 and 6 is a multiple of 2, not of 2*cp_size = 4
    with checks_mode("full"):
        try:
            mtp.roll_tensor(torch.ones(1, 6), -1, -1, group, uneven)
        except ValueError as exc:
            out["uneven"] = str(exc)
    try:  # the default mode: the same refusal, asserted on the device
        mtp.roll_tensor(torch.ones(1, 6), -1, -1, group, uneven)
    except RuntimeError as exc:
        out["uneven_default"] = str(exc)

    row = torch.tensor([list(range(1, 13))])  # stock last: it leaves the pairs of ranks out of step
    try:
        stock_packed(ref.cp_local(row, [4, 8], size, rank), -1, -1, ref.packed_params([3, 5], [4, 8]), group)
        out["stock_small"] = "ran"
    except Exception as exc:  # what stock raises is the point of the test
        out["stock_small"] = f"{type(exc).__name__}: {exc}"
    return out


def test_cp2_stock_breaks_or_is_silently_wrong_and_the_fix_is_exact(cp2_run):
    ranks = [out["stock"] for out in cp2_run[1]]
    for out in ranks:
        assert out["5,7->8"]["fixed_wrong"] == 0 and out["3,5->4,8"]["fixed_wrong"] == 0
        # one all-gather on the CP group per roll; stock: one isend/irecv pair per sequence, world group
        assert out["5,7->8"]["fixed_groups"] == [("all_gather_single", True)]
        assert out["5,7->8"]["stock_groups"] == [("irecv", False), ("isend", False)]
        assert re.search(r"cu_seqlens_q_padded: padded sequence 0 has length 6, not divisible by 2\*cp_size=4", out["uneven"])
        assert re.search(r"cu_seqlens_q_padded: start 0, never decrease, lengths multiples of 4, end 12.*MTP_OVERLAY_CHECKS=full",
                         out["uneven_default"])
        assert re.search(r"IndexError|Received data size|size doesn't match|Connection closed|Connection reset", out["stock_small"]), out
    assert sum(out["5,7->8"]["stock_wrong"] for out in ranks) > 0  # ran without error, wrong targets


def test_reproducer_shows_the_stock_bug():
    shows, evidence = reproducer.reproduce()
    assert shows
    assert "stock trains (3, pad -> 22), (8, 25 -> 25) and misses (6, 23 -> 25)" in evidence
    assert re.search(r"under CP=2: [1-9]\d* of 16 stock label slots differ", evidence)


def test_reproducer_packs_with_the_fix_on_train_exactly_the_expected_pairs(cp2_run):
    for out in cp2_run[1]:
        trained, expected, wrong = out["reproducer"]
        assert trained == expected and wrong == 0
