"""mtp-packed-roll against what a cached roll plan got wrong: inference tensors and boundary buffers rewritten in place.

The roll's plan used to be cached by the boundary tensors' identity and ``_version``: under
``torch.inference_mode()`` (eval and logprob passes) the key itself raised (inference tensors track
no version), and a reused buffer rewritten where the version does not move (``dist.broadcast`` into
it, numpy, ``.data``) was rolled on the previous step's packing. Every case runs megatron-core's
installed ``roll_tensor`` with the fix on (and a real HybridModel forward for inference mode) against
the per-sequence reference (`packed_reference`), on this process (CP=1) and on gloo ranks (CP=2,
and two ranks whose boundaries arrive by broadcast). Wall time on 2 shared cores (load ~7), alone:
26 s, the CP=2 forward (slow) 23 s more; most of it starting ranks.
"""

import pytest
import torch

import mtp_overlay
from mtp_overlay import registry
from mtp_overlay.bed.oracles import packed_reference as ref
from mtp_overlay.bed.runtime.launcher import run_ranks_checked

FIX = "mtp-packed-roll"
STEPS = ((5, 7), (2, 9), (8, 3))  # real lengths of three consecutive packings, all padded to 12 slots
PADDED = (12, 12)


@pytest.fixture(scope="module")
def mtp_module():
    import megatron.core.transformer.multi_token_prediction as module

    mtp_overlay.install(only=[FIX])
    assert registry.lifecycle(FIX).state()[0] == "installed"
    return module


def row_of(padded=PADDED, rows=1):
    return torch.arange(1, rows * sum(padded) + 1).reshape(rows, -1)


def test_inference_tensors_are_rolled(mtp_module):
    with torch.inference_mode():
        params = ref.packed_params([5, 7], list(PADDED))
        row = row_of()
        assert params.cu_seqlens_q.is_inference()
        rolled, count = mtp_module.roll_tensor(row, -1, -1, None, params)
    assert torch.equal(rolled, ref.reference_roll(row, [5, 7], PADDED)) and int(count) == int(rolled.sum())


@pytest.mark.parametrize("how", ["numpy", "from_numpy", "data"])
def test_boundary_buffers_rewritten_in_place_are_rolled_on_their_new_values(how, mtp_module):
    """One PackedSeqParams reused step after step, its cu_seqlens_q rewritten where ``_version``
    does not move: each step's roll follows that step's packing."""
    import numpy

    params = ref.packed_params(list(STEPS[0]), list(PADDED))
    if how == "from_numpy":
        shared = numpy.asarray(params.cu_seqlens_q.tolist(), dtype=numpy.int32)
        params.cu_seqlens_q = torch.from_numpy(shared)
    row = row_of()
    for real in STEPS:
        values = [0, real[0], real[0] + real[1]]
        before = params.cu_seqlens_q._version
        if how == "numpy":
            params.cu_seqlens_q.numpy()[:] = values
        elif how == "from_numpy":
            shared[:] = values
        else:
            for index, value in enumerate(values):
                params.cu_seqlens_q.data[index] = value
        assert params.cu_seqlens_q._version == before  # invisible to a version-keyed cache
        rolled, _ = mtp_module.roll_tensor(row, -1, -1, None, params)
        assert torch.equal(rolled, ref.reference_roll(row, real, PADDED)), (how, real)


def broadcast_steps():
    """Rank worker (two ranks, CP=1 each): rank 0 broadcasts each step's boundaries into rank 1's
    preallocated buffer, which one PackedSeqParams holds across steps; both roll with it. Returns
    per step whether the roll equals the reference, and whether the buffer's version moved."""
    import torch.distributed as dist

    params = ref.packed_params(list(STEPS[0]), list(PADDED))
    buffer = params.cu_seqlens_q
    row, results = row_of(), []
    for real in STEPS:
        if dist.get_rank() == 0:
            buffer.copy_(torch.tensor([0, real[0], real[0] + real[1]], dtype=buffer.dtype))
        version = buffer._version
        dist.broadcast(buffer, src=0)
        moved = buffer._version != version
        rolled, _ = torch_mtp().roll_tensor(row, -1, -1, None, params)
        results.append((torch.equal(rolled, ref.reference_roll(row, real, PADDED)), moved))
    return results


def torch_mtp():
    from megatron.core.transformer import multi_token_prediction

    return multi_token_prediction


def test_boundaries_broadcast_into_a_reused_buffer_are_rolled_on_each_step():
    ranks = run_ranks_checked(broadcast_steps, 2, fixes=[FIX])
    assert [moved for _, moved in ranks[1]] == [False] * len(STEPS)  # the broadcast leaves _version alone
    for rank, results in enumerate(ranks):
        assert [right for right, _ in results] == [True] * len(STEPS), (rank, results)


def inference_forward():
    """Rank worker: the tiny HybridModel's packed forward (real-lengths flavour, RL: logits) under
    ``torch.inference_mode()``, every tensor made inside it as an eval/logprob pass makes them,
    against the same forward under ``torch.no_grad()``; and the CP=2 packed rolls of inference tensors."""
    from megatron.core import parallel_state

    from mtp_overlay.bed.engines import parity
    from mtp_overlay.bed.models.packed import cp_local

    model = parity.build("hybrid")
    model.eval()

    def logits(context):
        with context():
            row = parity.packed_row(4, "unpadded")
            local = cp_local(row)
            output = model(local["input_ids"], local["position_ids"], None, packed_seq_params=row.packed_seq_params)
            return output.detach().clone(), row.packed_seq_params.cu_seqlens_q.is_inference()

    (eval_logits, inference), (reference, _) = logits(torch.inference_mode), logits(torch.no_grad)
    group = parallel_state.get_context_parallel_group()
    with torch.inference_mode():
        params = ref.packed_params([5, 7], [8, 8])
        full = row_of((8, 8))
        local = ref.cp_local(full, [8, 8], group.size(), group.rank())
        rolled, _ = torch_mtp().roll_tensor(local, -1, -1, group, params)
    want = ref.cp_local(ref.reference_roll(full, [5, 7], [8, 8]), [8, 8], group.size(), group.rank())
    return inference, torch.equal(eval_logits, reference), torch.equal(rolled, want)


@pytest.mark.parametrize("cp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_packed_forward_under_inference_mode_runs_and_equals_no_grad(cp):
    for inference, same_logits, rolled_right in run_ranks_checked(inference_forward, cp, cp=cp, fixes=[FIX]):
        assert inference and same_logits and rolled_right
