"""With every fix installed, the overlay adds no host read (no device sync on a GPU) to Megatron's step.

Megatron's own training step on the tiny HybridModel, a packed THD row in NeMo-RL's real-lengths
flavour (then a BSHD batch), an RL forward with the MTP mask scoped: every megatron-core fix's hook
on the path (`mtp_overlay.bed.engines.hot_path`), at TP1, CP2 and TP2+SP. `SyncCounter` counts every
host read of the forward+backward by who made it, at the aten level (the reads C++ makes, such as a
0-dim tensor used as a slice bound, included). In the default mode the overlay's count is 0
from the second step on; the first step makes the one-time checks (the mask's alignment: one
read); ``MTP_OVERLAY_CHECKS=full`` makes the host-side checks (so the counter sees the overlay's
reads when there are any) and trains the same gradients. The same steps' aten ops (a kernel launch
each on a GPU) hold the overlay's budget: on the packed row no more than stock's, at most 4 device
asserts, and at most 10 more than stock on BSHD. Wall time on 2 shared cores (load ~7), alone: 23 s for CP2, 20 s more for TP1 and
TP2+SP (slow); with the suite's shared pools a few seconds per layout.
"""

import numpy
import pytest

from mtp_overlay.mtp.checks import MESSAGE_LIMIT
from mtp_overlay.bed.engines import hot_path


def overlay(summary):
    return {key: count for key, count in summary.items() if key[0] == "overlay"}


@pytest.fixture(scope="module", params=[pytest.param("CP2"), pytest.param("TP1", marks=pytest.mark.slow),
                                        pytest.param("TP2+SP", marks=pytest.mark.slow)])
def layout(request):
    return request.param, hot_path.run(request.param)


def test_the_overlay_adds_no_host_read_per_step_by_default(layout):
    name, ranks = layout
    for rank, out in enumerate(ranks):
        for step in ("warm", "bshd"):
            assert overlay(out[step][0]) == {}, (name, rank, step, overlay(out[step][0]))
        # the first step: the one-time alignment check of the scoped mask, one read, nothing else
        first = overlay(out["first"][0])
        assert list(first.values()) == [1], (name, rank, first)
        (origin, kind, place), = first
        assert kind == "Tensor.tolist" and "mtp_overlay/mtp/layout.py" in place, first
        # stock makes its own reads; the counter sees them, apart from the overlay's
        assert sum(out["stock"][0].values()) > 0 and overlay(out["stock"][0]) == {}
        # stock's per-sequence roll slices by 0-dim boundary tensors: C++ reads them, and they count
        assert any(kind == "aten::_local_scalar_dense" and "transformer/multi_token_prediction.py" in place
                   for (_, kind, place) in out["stock"][0]), out["stock"][0]
        assert {origin for origin, _, _ in out["warm"][0]} <= {"megatron", "test bed"}
        # the device checks ran (default mode) and every message they queued fits CUDA's buffer
        size, message = out["longest assert message"]
        assert 0 < size < MESSAGE_LIMIT and message.startswith("mtp-overlay: "), message


def test_the_full_checks_read_on_the_host_and_train_the_same(layout):
    name, ranks = layout
    for out in ranks:
        full = overlay(out["full"][0])
        assert sum(full.values()) >= 3, (name, full)  # the layout check, the roll's boundaries, the alignment
        assert {kind for _, kind, _ in full} >= {"aten::_local_scalar_dense"}
        for part in ("mtp", "lm"):
            assert numpy.array_equal(out["full"][1][part], out["warm"][1][part]), (name, part)
        assert out["full"][2] == out["warm"][2] == out["first"][2]


ASSERT = "aten::_assert_async.msg"


def test_the_overlay_issues_no_more_aten_ops_than_stock_on_the_packed_row(layout):
    """One plan per forward, shared by every roll of every depth and by the checks: the packed row's
    forward+backward issues fewer ops than stock's per-sequence roll, with at most 4 device asserts
    (the boundaries, the mask's weights, its padding slots); BSHD adds at most 10 (the weights'
    check; under CP the loss scale's all-reduce)."""
    name, ranks = layout
    for rank, out in enumerate(ranks):
        ops = {step: out[step][3]["ops"] for step in ("warm", "stock", "bshd", "stock bshd")}
        total = {step: sum(counts.values()) for step, counts in ops.items()}
        assert total["warm"] <= total["stock"], (name, rank, total)
        assert 1 <= ops["warm"].get(ASSERT, 0) <= 4 and ops["stock"].get(ASSERT, 0) == 0, (name, rank, ops["warm"].get(ASSERT))
        assert total["bshd"] - total["stock bshd"] <= 10, (name, rank, total)
