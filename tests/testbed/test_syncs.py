"""The test bed's sync counter counts every kind of data-dependent host read, once, and says whose it was.

Each kind is made once in this file: the counter must record exactly one read of that kind, here;
each neighbouring call that reads nothing on the host must add none. Attribution: the overlay's
product code, megatron-core, the test bed's stand-ins and the caller each get their own reads.
"""

import numpy
import pytest
import torch

from mtp_overlay import mtp
from mtp_overlay.bed.runtime import cp_attention, mamba_kernels, syncs
from mtp_overlay.bed.runtime.syncs import SyncCounter

T = torch.tensor([1.0, 2.0, 3.0])
I = torch.tensor(1)
MASK = T > 1

SCALAR = "aten::_local_scalar_dense"  # what every scalar read dispatches, from Python or C++
READS = {  # a call that makes exactly one host read -> the kind recorded
    "bool": (lambda: bool(T.any()), SCALAR),
    "item": (lambda: T.sum().item(), SCALAR),
    "int": (lambda: int(I), SCALAR),
    "float": (lambda: float(I), SCALAR),
    "list index": (lambda: [0, 1, 2][I], SCALAR),
    "slice bound": (lambda: T[:I], SCALAR),  # C++ converts the 0-dim tensor: no Python method runs
    "arange(tensor)": (lambda: torch.arange(I), SCALAR),
    "in": (lambda: 2.0 in T, SCALAR),
    "Tensor.nonzero": (lambda: T.nonzero(), "aten::nonzero"),
    "torch.nonzero": (lambda: torch.nonzero(T), "aten::nonzero"),
    "torch.argwhere": (lambda: torch.argwhere(T), "aten::nonzero"),
    "torch.where(c)": (lambda: torch.where(MASK), "aten::nonzero"),
    "torch.equal": (lambda: torch.equal(T, T), "aten::equal"),
    "torch.allclose": (lambda: torch.allclose(T, T), "aten::allclose"),
    "boolean index": (lambda: T[MASK], "aten::index.Tensor"),
    "boolean index set": (lambda: T.clone().__setitem__(MASK, 0), "aten::index_put_"),
    "masked_select": (lambda: T.masked_select(MASK), "aten::masked_select"),
    "unique": (lambda: torch.unique(T), "aten::_unique2"),
    "torch.repeat_interleave": (lambda: torch.repeat_interleave(T, torch.tensor([1, 2, 1])), "aten::repeat_interleave.Tensor"),
    "Tensor.repeat_interleave": (lambda: T.repeat_interleave(torch.tensor([1, 2, 1])), "aten::repeat_interleave.Tensor"),
    "bincount": (lambda: torch.bincount(torch.tensor([0, 2])), "aten::bincount"),
    "tolist": (lambda: T.tolist(), "Tensor.tolist"),  # these dispatch nothing for a host tensor
    "numpy": (lambda: T.numpy(), "Tensor.numpy"),
    "numpy.asarray": (lambda: numpy.asarray(T), "Tensor.__array__"),
    "cpu": (lambda: T.cpu(), "Tensor.cpu"),
    "to(cpu)": (lambda: T.to("cpu"), "Tensor.to"),
    "repr": (lambda: repr(T), "Tensor.__repr__"),
    "format": (lambda: f"{T.sum():.2f}", "Tensor.__format__"),
}
NO_READS = {  # device work only: nothing read on the host
    "any": lambda: T.any(),
    "where(c, a, b)": lambda: torch.where(MASK, T, T),
    "integer index": lambda: T[1],
    "index_select": lambda: T.index_select(0, torch.tensor([0, 2])),
    "to(dtype)": lambda: T.to(torch.float64),
    "arange(int)": lambda: torch.arange(3),
    "repeat_interleave(int)": lambda: T.repeat_interleave(2),
    "repeat_interleave(output_size)": lambda: torch.repeat_interleave(T, torch.tensor([1, 2, 1]), output_size=4),
    "assert_async": lambda: torch._assert_async(torch.tensor(True)),
    "searchsorted": lambda: torch.searchsorted(T, T),
}


@pytest.mark.parametrize("what", sorted(READS))
def test_each_kind_of_host_read_is_counted_once_and_here(what):
    call, kind = READS[what]
    with SyncCounter() as counted:
        call()
    assert [event.kind for event in counted.events] == [kind], counted.events
    event = counted.events[0]
    assert event.origin == "other" and event.file == __file__ and event.function == "<lambda>"


@pytest.mark.parametrize("what", sorted(NO_READS))
def test_device_work_counts_nothing(what):
    with SyncCounter() as counted:
        NO_READS[what]()
    assert counted.events == []


def test_cuda_synchronize_and_streams_are_counted_and_everything_is_put_back():
    before = {name: vars(torch.Tensor).get(name) for name in ("item", "__bool__", "__getitem__", "__repr__", "to")}
    calls = []
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: calls.append(device)  # no device here: what it would call
    try:
        with SyncCounter() as counted:
            torch.cuda.synchronize()
    finally:
        torch.cuda.synchronize = saved
    assert [event.kind for event in counted.events] == ["torch.cuda.synchronize"] and calls == [None]
    assert {name: vars(torch.Tensor).get(name) for name in before} == before
    assert torch.Tensor.item is torch._C.TensorBase.item


def test_a_read_inside_another_is_one_read_and_backward_is_counted():
    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            grad.sum().item()  # a host read inside the autograd engine's backward
            return 2 * grad

    weight = torch.ones(3, requires_grad=True)
    with SyncCounter() as counted:
        repr(torch.arange(6.0).reshape(2, 3))  # reads every element inside: one read
        Doubling.apply(weight).sum().backward()
    assert [event.kind for event in counted.events] == ["Tensor.__repr__", SCALAR]
    assert counted.events[1].function == "backward"


def test_reads_are_attributed_to_the_overlay_megatron_and_the_test_bed():
    from megatron.core import rerun_state_machine
    from megatron.core.packed_seq_params import PackedSeqParams

    packed = mtp.pack_sequences(torch.arange(1, 9).reshape(2, 4), [3, 4], torch.ones(2, 4), pad_multiple=4)
    params = mtp.packed_seq_params(packed)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens)
    with SyncCounter() as counted:
        mtp.check_loss_mask_layout(packed.input_ids, packed.loss_mask, params)  # the host-side check
        rerun_state_machine._compare_floats(torch.tensor(1.0), torch.tensor(1.0))  # stock's two item() calls
        cp_attention.self_attention_boundaries(thd)  # a stand-in's torch.equal
        mtp.assert_loss_mask_layout(packed.input_ids, packed.loss_mask, params)  # the device-side one: nothing
    by_origin = counted.by_origin()
    assert by_origin["overlay"] > 0 and by_origin["megatron"] == 2 and by_origin["test bed"] == 1, counted.events
    assert by_origin["other"] == 0
    assert {event.file.rsplit("/", 2)[-2] for event in counted.of("overlay")} == {"mtp"}
    assert all(event.file.endswith("rerun_state_machine.py") for event in counted.of("megatron"))
    assert counted.of("test bed")[0].kind == "aten::equal" and counted.of("test bed")[0].file == cp_attention.__file__
    assert sum(counted.summary("overlay").values()) == counted.overlay


def test_one_counter_at_a_time_and_checks_mode_is_scoped(monkeypatch):
    with SyncCounter(), pytest.raises(RuntimeError, match="already counting"):
        with SyncCounter():
            pass
    monkeypatch.setenv("MTP_OVERLAY_CHECKS", "default")
    with syncs.checks_mode("full"):
        assert mtp.checks.full()
    assert mtp.checks.mode() == "default"


def test_an_unknown_checks_mode_warns_and_stays_default(monkeypatch):
    import warnings

    monkeypatch.setenv("MTP_OVERLAY_CHECKS", "ful")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mtp.checks.mode() == "default"
    assert [str(w.message) for w in caught] == [
        "mtp-overlay: MTP_OVERLAY_CHECKS='ful' is not one of default, full: the default mode stays (no host read per "
        "forward; value checks run on the device)"]
    monkeypatch.setenv("MTP_OVERLAY_CHECKS", " FULL ")
    assert mtp.checks.full()


def test_the_sync_free_row_positions_equal_cp_local_indices():
    """The attention and THD-partitioning stand-ins' positions (`cp_attention.row_positions`) against
    the host-checked `mtp.cp_local_indices` they replace, on every CP rank of odd packs."""
    generator = torch.Generator().manual_seed(0)
    for cp_size in (1, 2, 4):
        multiple = 2 * cp_size if cp_size > 1 else 1
        for _ in range(30):
            padded = torch.randint(0, 5, (int(torch.randint(0, 6, (1,), generator=generator)),), generator=generator)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), (padded * multiple).cumsum(0)])
            for rank in range(cp_size):
                want = mtp.cp_local_indices(cu, cp_size, rank)
                assert torch.equal(cp_attention.row_positions(cu, int(cu[-1]) // cp_size, cp_size, rank), want)
                assert torch.equal(mamba_kernels.thd_get_partitioned_indices(cu, int(cu[-1]), cp_size, rank), want)
