"""Mamba ('M') layers on the real path: megatron-core's own MambaLayer / MambaMixer, kernels stood in.

The tiny HybridModel ``"M*M-/M*-"`` (Mamba, attention, Mamba, MLP; one MTP depth of Mamba, attention,
MLP) is built from megatron-core 0.19's own classes; only the ``mamba_ssm`` kernels, which have no
CPU build, are replaced by the pure-torch stand-ins of ``mamba_kernels.mamba_shims`` (checked against
the recurrence in test_mamba_stand_ins.py). It trains through Megatron's own step
(``megatron_step.MegatronStep``: DDP, ``get_forward_backward_func``, ``finalize_model_grads``) on one
packed THD row of four sequences, in both NeMo-RL flavours, and on the per-sequence reference (each
sequence alone in its own BSHD row, ``PackedRow.reference_microbatch``), at TP1, TP2+SP, CP2 (Mamba's
all-to-all context parallelism, ``ssm/mamba_context_parallel.py``) and TP2xCP2+SP; every layout's
losses and gradients equal the TP1 reference. The RL forward with a response-only MTP mask and the
per-token 3-output loss, as ``scripts/parity.py``; the unpadded flavour with mtp-packed-roll, CP with
mtp-cp-loss-scale (the MTP defects those fix are not Mamba's).

Sequence boundaries reach the Mamba kernels only as ``PackedSeqParams.seq_idx``, which
``PackedSeqParams.__post_init__`` computes only when ``total_tokens`` is given
(``packed_seq_params.py:30-68``; read at ``ssm/mamba_mixer.py:750``): without it the packed row's
sequences leak state into each other (shown below), so ``mtp.packed_seq_params`` sets it.
"""

import dataclasses

import numpy as np
import pytest

from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.models.tiny_hybrid import MAMBA_CHUNK_SIZE, MAMBA_SETTINGS

PATTERN = "M*M-/M*-"
MAMBA_LAYERS = 3  # two in the decoder, one in the MTP depth
LENGTHS, PROMPTS = (9, 12, 6, 4), (2, 0, 3, 1)
ROLL, CP_SCALE = "mtp-packed-roll", "mtp-cp-loss-scale"
EXACT = 1e-5  # float32 sums in another order: losses (relative), gradient relerr
MAX_GRAD = 1e-6  # largest |Δgrad| element against the reference (the float-noise bound)
# world size, TP, CP, sequence parallelism; per-sequence padding as NeMo-RL pads (2*CP*TP under CP,
# TP under SP; 4 at TP1 so that the two flavours differ)
LAYOUTS = {
    "TP1": (1, 1, 1, False, 4),
    "TP2+SP": (2, 2, 1, True, 2),
    "CP2": (2, 1, 2, False, 4),
    "TP2xCP2+SP": (4, 2, 2, True, 8),
}


def _rows(pad_multiple):
    from mtp_overlay.bed.models.packed import make_packed_row

    return {flavour: make_packed_row(LENGTHS, pad_multiple=pad_multiple, flavour=flavour, prompts=PROMPTS)
            for flavour in ("padded", "unpadded")}


def _use(fixes):
    import mtp_overlay

    mtp_overlay.uninstall()
    mtp_overlay.install(only=list(fixes))


def _step(step, microbatch, fixes):
    _use(fixes)
    try:
        return step.step([microbatch], loss="3-output", labels=False, update=False)
    finally:
        _use(())


@dataclasses.dataclass
class _Calls:
    """Counting wrappers around the kernel names MambaMixer calls (module attributes of mamba_mixer)."""

    names: tuple
    counts: dict = dataclasses.field(default_factory=dict)
    seq_idx: list = dataclasses.field(default_factory=list)

    def shims(self, module):
        from mtp_overlay.bed.runtime.shim import Shim

        def counted(name, function):
            def call(*args, **kwargs):
                self.counts[name] = self.counts.get(name, 0) + 1
                if "seq_idx" in kwargs:
                    seq_idx = kwargs["seq_idx"]
                    self.seq_idx.append(None if seq_idx is None else seq_idx.tolist())
                return function(*args, **kwargs)

            return call

        return [Shim(module, name, counted(name, vars(module)[name])) for name in self.names]


def layout_steps(layout):
    """Rank worker: the tiny Mamba HybridModel through Megatron's step on the packed row (both
    flavours) and on each sequence alone (BSHD); {name: MegatronStepResult}, plus at TP1 what the
    upstream modules are and which kernels they called, and under CP the THD partitioning calls."""
    import torch
    from megatron.core.ssm import mamba_context_parallel, mamba_mixer

    from mtp_overlay.bed.runtime import shim
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.packed import make_packed_row
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid

    _, tp, cp, sp, pad = LAYOUTS[layout]
    model = build_tiny_hybrid(hybrid_layer_pattern=PATTERN, sequence_parallel=sp, calculate_per_token_loss=True)
    step = MegatronStep(model, optimizer=None)
    rows = _rows(pad)
    reference = make_packed_row(LENGTHS, prompts=PROMPTS).reference_microbatch(labels=False)
    cp_fix = (CP_SCALE,) if cp > 1 else ()
    results, facts = {}, {}

    calls = _Calls(("mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined"))
    partitioning = _Calls(("thd_get_partitioned_indices",))
    counted = calls.shims(mamba_mixer) + (partitioning.shims(mamba_context_parallel.tex) if cp > 1 else [])
    with shim.swapped(counted):
        results["padded"] = _step(step, rows["padded"].microbatch(labels=False), cp_fix)
        facts["padded calls"], facts["padded seq_idx"] = dict(calls.counts), list(calls.seq_idx)
        facts["thd partitionings"] = dict(partitioning.counts)
        calls.counts.clear()
        calls.seq_idx.clear()
        results["reference"] = _step(step, reference, cp_fix)
        facts["reference calls"], facts["reference seq_idx"] = dict(calls.counts), list(calls.seq_idx)
    results["unpadded"] = _step(step, rows["unpadded"].microbatch(labels=False), (ROLL,) + cp_fix)
    facts["heads, groups, group repeats per rank"] = [
        (mixer.cp.nheads_local_tpcp, mixer.cp.ngroups_local_tpcp, getattr(mixer.cp, "group_repeat_count", 1))
        for mixer in model.modules() if isinstance(mixer, mamba_mixer.MambaMixer)]
    if layout != "TP1":
        return (results, facts) if torch.distributed.get_rank() == 0 else None

    # the packed row without total_tokens: PackedSeqParams computes no seq_idx
    leaking = rows["padded"].microbatch(labels=False)
    leaking["packed_seq_params"] = dataclasses.replace(leaking["packed_seq_params"], total_tokens=None, seq_idx=None)
    results["padded, no seq_idx"] = _step(step, leaking, ())
    # upstream's unfused path (use_mamba_mem_eff_path=False): its own F.conv1d, the scan, the gated norm
    unfused = build_tiny_hybrid(hybrid_layer_pattern=PATTERN, calculate_per_token_loss=True,
                                use_mamba_mem_eff_path=False)
    calls.counts.clear()
    with shim.swapped(calls.shims(mamba_mixer)):
        results["reference, unfused"] = _step(MegatronStep(unfused, optimizer=None), reference, ())
    facts["unfused calls"] = dict(calls.counts)
    facts["modules"] = _module_facts(model)
    padded = rows["padded"].cu_seqlens_padded.diff().tolist()
    facts["sequence starts"] = rows["padded"].cu_seqlens_padded[:-1].tolist()
    facts["expected seq_idx"] = [[sequence for sequence, slots in enumerate(padded) for _ in range(slots)]]
    return results, facts


def _module_facts(model):
    """What the Mamba layers are made of: upstream's classes, the stand-in norm, upstream's forward."""
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from mtp_overlay.bed.runtime import mamba_kernels

    layers = [module for module in model.modules() if isinstance(module, MambaLayer)]
    return dict(
        kernels=[vars(mamba_mixer)[name] is getattr(mamba_kernels, name)
                 for name in ("mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined")],
        layers=[type(layer) is MambaLayer for layer in layers],
        mixers=[type(layer.mixer) is MambaMixer for layer in layers],
        in_proj=[type(layer.mixer.in_proj) is ColumnParallelLinear for layer in layers],
        out_proj=[type(layer.mixer.out_proj) is RowParallelLinear for layer in layers],
        context_parallel=[type(layer.mixer.cp) is MambaContextParallel for layer in layers],
        norms=[type(layer.mixer.norm) is mamba_kernels.rms_norm_gated() for layer in layers],
        forwards=[(type(layer).forward.__module__, type(layer.mixer).forward.__module__) for layer in layers],
        chunk_sizes=[layer.mixer.chunk_size for layer in layers],
        in_mtp=sum(name.startswith("mtp.") for name, module in model.named_modules() if isinstance(module, MambaLayer)),
    )


STOOD_IN = ("HAVE_MAMBA_SSM", "mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined", "RMSNormGated",
            "ExtendedRMSNorm", "is_mamba_min_version", "is_causal_conv1d_min_version")


def test_stand_ins_are_scoped_to_the_shims_and_leave_nothing_behind():
    """Stock megatron-core without mamba_ssm refuses a MambaMixer; with the shims the mixer module's
    kernel names are the stand-ins (a packed training step's version check passes, inference's still
    does not: the stand-ins do not claim its kernels); after them every original is back, by
    identity, and no mamba_ssm, causal_conv1d or TE module was ever imported."""
    import sys
    from unittest.mock import MagicMock

    from megatron.core.ssm import mamba_context_parallel, mamba_mixer

    from mtp_overlay.bed.runtime import cpu_shims, mamba_kernels

    assert not cpu_shims.installed()
    stock = {name: vars(mamba_mixer)[name] for name in STOOD_IN}
    stock_te = (mamba_context_parallel.tex, mamba_context_parallel.is_te_min_version)
    assert stock["HAVE_MAMBA_SSM"] is False and stock["mamba_split_conv1d_scan_combined"] is None
    assert isinstance(stock["ExtendedRMSNorm"], MagicMock) and stock_te[0] is None
    with pytest.raises(ImportError, match="MambaSSM is not installed"):
        mamba_mixer.MambaMixer(None, None, d_model=64)
    with cpu_shims.cpu_shims():
        assert mamba_mixer.HAVE_MAMBA_SSM is True
        assert mamba_mixer.mamba_split_conv1d_scan_combined is mamba_kernels.mamba_split_conv1d_scan_combined
        assert mamba_mixer.mamba_chunk_scan_combined is mamba_kernels.mamba_chunk_scan_combined
        assert mamba_mixer.ExtendedRMSNorm is mamba_mixer.RMSNormGated is mamba_kernels.rms_norm_gated()
        assert mamba_mixer.causal_conv1d_fn is None  # the unfused path keeps upstream's own F.conv1d
        assert mamba_mixer._check_mamba_sequence_packing_support(for_inference_not_training=False) == (True, None)
        assert mamba_mixer._check_mamba_sequence_packing_support(for_inference_not_training=True)[0] is False
        assert mamba_context_parallel.tex.thd_get_partitioned_indices is mamba_kernels.thd_get_partitioned_indices
        assert mamba_context_parallel.is_te_min_version("1.10.0")
        assert not mamba_context_parallel.is_te_min_version("2.0")
        with pytest.raises(AttributeError, match="Transformer Engine is not installed"):
            mamba_context_parallel.tex.thd_read_half_tensor  # noqa: B018 - nothing else of TE stood in
    assert all(vars(mamba_mixer)[name] is value for name, value in stock.items())
    assert (mamba_context_parallel.tex, mamba_context_parallel.is_te_min_version) == stock_te
    kernels = ("mamba_ssm", "causal_conv1d", "transformer_engine", "transformer_engine_torch")
    assert not [name for name in sys.modules if name.split(".")[0] in kernels]
    with pytest.raises(ImportError, match="MambaSSM is not installed"):
        mamba_mixer.MambaMixer(None, None, d_model=64)


def test_tp_shards_follow_the_components_of_partition_sizes():
    """A parameter packing components (``partition_sizes``, per-rank rows of each: Mamba's in_proj
    z|x|B|C|dt) is sharded component by component, any other in contiguous blocks; tp_unshard inverts
    both (what the test bed's gradient gathering and TP-independent Mamba weights rely on)."""
    import torch

    from mtp_overlay.bed.oracles.tp_layout import tp_shard, tp_unshard

    full = torch.arange(16.0).reshape(8, 2)  # at TP2: a 6-row component, then a 2-row one
    packed, plain = torch.empty(4, 2), torch.empty(4, 2)
    packed.partition_sizes = [3, 1]
    shards = [tp_shard(full, packed, 2, rank) for rank in range(2)]
    assert torch.equal(shards[0], full[[0, 1, 2, 6]]) and torch.equal(shards[1], full[[3, 4, 5, 7]])
    assert torch.equal(tp_unshard(shards, packed), full)
    assert torch.equal(tp_shard(full, plain, 2, 1), full[4:])
    assert torch.equal(tp_unshard([tp_shard(full, plain, 2, rank) for rank in range(2)], plain), full)
    with pytest.raises(ValueError, match=r"does not shard into 2 ranks of \(4, 2\)"):
        tp_shard(full[:6], packed, 2, 0)


def assert_same(result, reference, name):
    assert result.lm_loss == pytest.approx(reference.lm_loss, rel=EXACT), name
    assert result.mtp_losses == pytest.approx(reference.mtp_losses, rel=EXACT), name
    assert result.mtp_tokens == reference.mtp_tokens, name
    assert result.zero_grad_params == (), (name, result.zero_grad_params)
    for part in ("mtp", "lm"):
        assert result.relative_error(reference, part) < EXACT, (name, part)
        largest = float(np.abs(result.grads[part].astype(np.float64) - reference.grads[part]).max())
        assert largest <= MAX_GRAD, (name, part, largest)


def run_layout(layout):
    world_size, tp, cp, _, _ = LAYOUTS[layout]
    return run_ranks_checked(layout_steps, world_size, tp=tp, cp=cp, fixes=[], args=(layout,), timeout=900)[0]


@pytest.fixture(scope="module")
def tp1():
    return run_layout("TP1")


def test_upstream_mamba_layers_run_with_only_the_kernels_stood_in(tp1):
    """Every 'M' layer is megatron-core's MambaLayer / MambaMixer with its own in_proj, out_proj and
    context-parallel helper and forward; the norm is the gated-RMSNorm stand-in; a training step calls
    the fused-kernel stand-in once per Mamba layer (never the unfused scan), with the packed row's
    sequence index; the unfused path calls the scan stand-in instead and trains identically."""
    results, facts = tp1
    modules = facts["modules"]
    assert modules["in_mtp"] == 1 and len(modules["layers"]) == MAMBA_LAYERS
    assert modules["kernels"] == [True, True]  # the names megatron-core calls hold the stand-ins themselves
    for key in ("layers", "mixers", "in_proj", "out_proj", "context_parallel", "norms"):
        assert modules[key] == [True] * MAMBA_LAYERS, key
    assert modules["forwards"] == [("megatron.core.ssm.mamba_layer", "megatron.core.ssm.mamba_mixer")] * MAMBA_LAYERS
    assert modules["chunk_sizes"] == [MAMBA_CHUNK_SIZE] * MAMBA_LAYERS
    assert any(start % MAMBA_CHUNK_SIZE for start in facts["sequence starts"])  # sequences start inside chunks too
    assert facts["padded calls"] == {"mamba_split_conv1d_scan_combined": MAMBA_LAYERS}
    assert facts["padded seq_idx"] == [facts["expected seq_idx"]] * MAMBA_LAYERS
    assert facts["reference calls"] == {"mamba_split_conv1d_scan_combined": MAMBA_LAYERS}
    assert facts["reference seq_idx"] == [None] * MAMBA_LAYERS
    assert facts["unfused calls"] == {"mamba_chunk_scan_combined": MAMBA_LAYERS}
    assert_same(results["reference, unfused"], results["reference"], "unfused path")


def test_tp1_packed_rows_equal_each_sequence_alone_and_need_the_sequence_index(tp1):
    """Both packed flavours train exactly like each sequence alone; the same row whose PackedSeqParams
    has no total_tokens (so no seq_idx) does not: its Mamba state runs from sequence to sequence."""
    results, _ = tp1
    for name in ("padded", "unpadded"):
        assert_same(results[name], results["reference"], name)
    leaking = results["padded, no seq_idx"]
    assert abs(leaking.lm_loss - results["reference"].lm_loss) > 1e-3
    assert leaking.relative_error(results["reference"], "lm") > 0.01


@pytest.mark.parametrize("layout", ["TP2+SP", "CP2", pytest.param("TP2xCP2+SP", marks=pytest.mark.slow)])
def test_layouts_equal_the_tp1_reference(tp1, layout):
    """TP2+SP (in_proj/conv sharded per component), CP2 and TP2xCP2+SP (Mamba's all-to-all over CP,
    the packed row un-balanced through the THD partitioning stand-in; at TP2xCP2 each CP rank holds
    half of a group's heads): the packed row in both flavours and each sequence alone (BSHD) equal
    each sequence alone at TP1."""
    results, facts = run_layout(layout)
    reference = tp1[0]["reference"]
    for name in ("padded", "unpadded", "reference"):
        assert_same(results[name], reference, f"{layout} {name}")
    _, tp, cp, _, _ = LAYOUTS[layout]
    # the heads (d_inner = 2 * hidden 64) and groups over TP x CP; where there are fewer groups than
    # TP x CP ranks (TP2xCP2) a group's heads are split over CP ranks, each repeating its state
    heads, groups = 2 * 64 // MAMBA_SETTINGS["mamba_head_dim"], MAMBA_SETTINGS["mamba_num_groups"]
    per_rank = (heads // (tp * cp), max(groups // (tp * cp), 1), max(tp * cp // groups, 1))
    assert facts["heads, groups, group repeats per rank"] == [per_rank] * MAMBA_LAYERS
    # per Mamba layer and forward, upstream un-balances the CP layout before the scan and re-balances it
    # after, asking the partitioning of every CP rank each time
    assert facts["thd partitionings"] == ({"thd_get_partitioned_indices": 2 * cp * MAMBA_LAYERS} if cp > 1 else {})


def test_a_gated_fc1_is_unsharded_by_its_partition_stride_as_megatron_core_draws_it():
    """A gated MLP's (SwiGLU) linear_fc1 carries ``partition_stride`` 2: megatron-core's own CPU
    initialisation (``_initialize_affine_weight_cpu``, called as ``MLP`` calls it, one TP rank at a time)
    gives rank r [gate_r; up_r] of the master weight. tp_unshard puts the shards back into the master
    weight, tp_shard draws them; concatenating the shards (the layout without the stride) does not."""
    import torch
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from mtp_overlay.bed.oracles.tp_layout import tp_shard, tp_unshard

    ffn, hidden, tp = 6, 4, 2
    shards, master = [], None
    for rank in range(tp):
        shard = torch.nn.Parameter(torch.empty(2 * ffn // tp, hidden), requires_grad=False)
        torch.manual_seed(7)
        master = _initialize_affine_weight_cpu(shard, 2 * ffn, hidden, 2 * ffn // tp, 0, torch.nn.init.normal_,
                                               stride=2, return_master_weight=True, rank=rank, world_size=tp)
        shards.append(shard)
    assert shards[0].partition_stride == 2
    gate, up = master.chunk(2)
    assert torch.equal(shards[1], torch.cat([gate.chunk(tp)[1], up.chunk(tp)[1]]))
    assert torch.equal(tp_unshard(shards, shards[0]), master)
    assert not torch.equal(torch.cat(shards), master)
    assert all(torch.equal(tp_shard(master, shards[0], tp, rank), shards[rank]) for rank in range(tp))
