"""The test bed on a machine with a GPU: no CUDA before a fork, CUDA ranks of their own, the overlay on CUDA.

On the first GPU run every forked rank failed ("Cannot re-initialize CUDA in forked subprocess",
"CUDA error: initialization error"): the preloaded server's imports probe CUDA (flashinfer,
tvm_ffi: ``torch.cuda.is_available()`` / ``device_count()`` run ``cuInit``), and a fork after that
cannot use the device. The CPU tests here hold on any machine; the GPU-marked ones run where CUDA is.
"""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from mtp_overlay.bed.engines import gpu_check
from mtp_overlay.bed.runtime import device, preloaded
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.runtime.syncs import origin_of

# a fresh interpreter that counts the CUDA-initialising calls (cudaGetDeviceCount, cuda init) made by
# importing what the preloaded server preloads, then megatron-core's GPT model
PROBES = textwrap.dedent("""
    import importlib, sys, torch
    calls = []
    for name in ("_cuda_getDeviceCount", "_cuda_init"):
        def counted(*args, _original=getattr(torch._C, name), _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        setattr(torch._C, name, counted)
    for module in sys.argv[1:]:
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # as the forkserver's preload does
    print("CUDA PROBES", len(calls))
""")


def cuda_probes(environment):
    modules = [*preloaded.PRELOAD, "megatron.core.models.gpt.gpt_model"]
    result = subprocess.run([sys.executable, "-c", PROBES, *modules], capture_output=True, text=True,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split("CUDA PROBES")[-1])


@pytest.mark.parametrize("hidden", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_what_the_server_preloads_probes_cuda_only_when_cuda_is_visible(hidden):
    """The fork rule, emulated on CPU: a probe in the server would make every rank's CUDA unusable on a
    GPU host. With CUDA hidden (the server's environment) nothing probes; visible, the preload does."""
    environment = {key: value for key, value in os.environ.items() if key not in device.HIDE_CUDA}
    if hidden:
        assert cuda_probes({**environment, **device.HIDE_CUDA}) == 0
    else:
        assert cuda_probes(environment) > 0  # flashinfer / tvm_ffi ask torch.cuda at import


def cuda_facts():
    """Rank worker: what this rank sees of CUDA."""
    import os

    import torch

    facts = dict(visible=os.environ.get("CUDA_VISIBLE_DEVICES"), available=torch.cuda.is_available(),
                 initialized=torch.cuda.is_initialized())
    if facts["available"]:
        product = torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
        facts.update(product=float(product[0, 0]), name=torch.cuda.get_device_name())
    return facts


def test_cpu_ranks_and_fresh_interpreters_never_see_cuda():
    facts = run_ranks_checked(cuda_facts, 2)
    assert facts == [dict(visible="", available=False, initialized=False)] * 2
    child = preloaded.run_python("import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                                 "torch.cuda.is_available())", dict(os.environ), timeout=120)
    assert child.returncode == 0 and child.stdout.split() == ["''", "False"], child.stderr


def test_thd_attention_matches_the_test_beds_exact_attention():
    """The CUDA stand-in for TE's varlen attention, against the CPU stand-in's exact attention."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from mtp_overlay.bed.runtime.cp_attention import exact_attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(24, 4, 8, generator=generator) for _ in range(3))
    key, value = key[:, :2], value[:, :2]  # grouped-query attention: 2 K/V heads for 4 query heads
    bounds = torch.tensor([0, 8, 13, 24], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds - torch.tensor([0, 1, 1, 2], dtype=torch.int32),
                             cu_seqlens_q_padded=bounds, cu_seqlens_kv=None, cu_seqlens_kv_padded=bounds)
    attention = types.SimpleNamespace(
        softmax_scale=8 ** -0.5, scale_mask_softmax=types.SimpleNamespace(scale=None), cpu_shim_cp_group=None,
        attn_mask_type=AttnMaskType.causal, attention_dropout=torch.nn.Identity(), hidden_size_per_partition=32)
    expected = exact_attention(attention, query, key, value, None, packed_seq_params=params)
    got = gpu_check.thd_attention(attention, query, key, value, None, packed_seq_params=params)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_its_table_reads_right():
    """``scripts/gpu_check.sh --cpu``: every row passes and the overlay's MTP loss is the same in every
    layout while stock's is not (so the script does not rot between GPU runs)."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_check.sh")
    result = subprocess.run(["bash", script, "--cpu"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    spread = {line.split()[0]: float(line.split()[-1]) for line in result.stdout.splitlines()
              if "MTP loss spread" in line}
    assert spread["overlay"] < 1e-5 < spread["stock"], result.stdout
    for name in ("demo", "verify nemotron_h_like", "hot path"):
        assert any(line.startswith(name) and " ok " in line for line in result.stdout.splitlines()), result.stdout


# ------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_cuda_ranks_start_after_the_caller_used_cuda():
    torch.ones(1, device="cuda").sum().item()  # the caller's CUDA is initialised: a fork would be poisoned
    (facts,) = run_ranks_checked(cuda_facts, 1, device="cuda", fresh=True)
    assert facts["available"] and facts["product"] == 64.0, facts
    # and CPU ranks on this GPU host still train (forked from a server that never touched CUDA)
    assert run_ranks_checked(cuda_facts, 1, fresh=True)[0]["available"] is False


@pytest.mark.gpu
def test_packed_thd_runs_on_cuda_with_the_overlay_and_its_mtp_loss_equals_bshds():
    results = gpu_check.run("cuda", ["22M"], iterations=2)
    rows, _ = results["22M"]
    by = {(row.layout, row.side): row for row in rows}
    assert gpu_check.loss_spread(rows, "overlay") < 2e-3 < gpu_check.loss_spread(rows, "stock"), rows
    for layout in ("THD padded", "THD real-lengths"):  # the overlay removes stock's roll syncs, adds none
        assert by[layout, "overlay"].cuda_syncs < by[layout, "stock"].cuda_syncs, by[layout, "overlay"]
        row = by[layout, "overlay"]
        places = [*row.sync_sites, *row.cuda_sites]
        assert not any(origin_of(place.rpartition(":")[0]) == "overlay" for place in places), row
    assert by["BSHD", "overlay"].cuda_syncs <= by["BSHD", "stock"].cuda_syncs  # stock's first step may sync once


FAILING_CHECK = textwrap.dedent("""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from mtp_overlay import mtp

    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])
    packed = mtp.pack_sequences(ids, [3, 4], (ids != 0).float(), pad_multiple=4)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens.cuda(),
                             cu_seqlens_q_padded=packed.cu_seqlens_padded.cuda())
    mask = packed.loss_mask.cuda()
    mask[0, 3] = 1.0  # a padding slot weighted
    mtp.assert_loss_mask_layout(packed.input_ids.cuda(), mask, params)
    print("QUEUED", flush=True)
    torch.cuda.synchronize()
""")


@pytest.mark.gpu
def test_a_failing_device_check_on_cuda_stops_the_process_and_names_the_check_on_stderr():
    result = subprocess.run([sys.executable, "-c", FAILING_CHECK], capture_output=True, text=True, timeout=300)
    assert "QUEUED" in result.stdout  # queuing the message is accepted (under CUDA's 255 bytes)
    assert result.returncode != 0 and "device-side assert triggered" in result.stderr, result.stderr[-2000:]
    assert "mtp-overlay: loss_mask is nonzero in a padding slot" in result.stderr, result.stderr[-2000:]


@pytest.mark.gpu
def test_the_demo_runs_on_a_gpu_host():
    torch.ones(1, device="cuda").sum().item()
    result = subprocess.run([sys.executable, "-m", "mtp_overlay.cli", "demo"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("fix on") >= 5, result.stdout
