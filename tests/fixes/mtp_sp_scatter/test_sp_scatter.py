"""mtp-sp-scatter on real megatron-core: the crash without the fix, TP1 parity with it.

A plain GPTModel built with ``scatter_embedding_sequence_parallel=False`` scatters its decoder input
in its own forward (megatron-core 0.19, PR #5628) but its MTP layer never does: under TP2 with
sequence parallelism the MTP concat fails. Every case runs the installed megatron-core on gloo ranks.
"""

import subprocess
from pathlib import Path

import pytest

from mtp_overlay.bed.runtime.launcher import run_ranks, run_ranks_checked
from mtp_overlay.bed.runtime.releases import copy_installed, release_site, run_with_release

FIX = "mtp-sp-scatter"
NOT_SCATTERING = dict(sequence_parallel=True, scatter_embedding_sequence_parallel=False)
PATCHES = Path(__file__).resolve().parents[3] / "patches" / FIX / "megatron-core"


def train(**model_kwargs):
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch, train_step

    return train_step(build_tiny_gpt(**model_kwargs), make_batch())


def assert_same_losses(result, reference, rel=1e-5):
    assert result.lm_loss == pytest.approx(reference.lm_loss, rel=rel)
    assert result.mtp_losses == pytest.approx(reference.mtp_losses, rel=rel)
    assert result.mtp_tokens == reference.mtp_tokens


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(train, 1, fixes=[])[0]


def test_tp2_sp_crashes_without_the_fix_and_matches_tp1_with_it(tp1):
    stock = run_ranks(train, 2, tp=2, kwargs=NOT_SCATTERING, fixes=[])
    assert all(r.error and "Sizes of tensors must match except in dimension 2" in r.error for r in stock), stock

    fixed = run_ranks_checked(train, 2, tp=2, kwargs=NOT_SCATTERING, fixes=[FIX])
    assert_same_losses(fixed[0], tp1)
    assert fixed[0].grad_norm == pytest.approx(tp1.grad_norm, rel=1e-5)
    assert fixed[0].zero_grad_params == ()  # MTP parameters are trained


@pytest.mark.slow
def test_tp2_cp2_sp_crashes_without_the_fix_and_matches_tp1_with_it(tp1):
    stock = run_ranks(train, 4, tp=2, cp=2, kwargs=NOT_SCATTERING, fixes=[])
    assert any(r.error and "Sizes of tensors must match" in r.error for r in stock), stock
    # with mtp-cp-loss-scale: stock megatron-core logs (and weights) the MTP loss per CP rank
    # (Megatron-LM PR #7498); both fixes together match TP1 in losses and gradients
    fixed = run_ranks_checked(train, 4, tp=2, cp=2, kwargs=NOT_SCATTERING, fixes=[FIX, "mtp-cp-loss-scale"])
    assert_same_losses(fixed[0], tp1)
    assert fixed[0].grad_norm == pytest.approx(tp1.grad_norm, rel=1e-5)


def test_embedding_that_scatters_itself_is_left_alone():
    scattering = dict(sequence_parallel=True, scatter_embedding_sequence_parallel=True)
    stock = run_ranks_checked(train, 2, tp=2, kwargs=scattering, fixes=[])
    hooked = run_ranks_checked(train, 2, tp=2, kwargs=scattering, fixes=[FIX])
    assert hooked == stock  # bit-identical: the hook adds nothing


def test_hook_equals_upstream_fix_under_detached_heads(tmp_path, monkeypatch):
    """The hook and the upstream behaviour (our patch of PR #6256 on a copy) give identical steps."""
    options = dict(NOT_SCATTERING, mtp_detach_heads=True)
    hooked = run_ranks_checked(train, 2, tp=2, kwargs=options, fixes=[FIX])
    site = copy_installed("megatron-core", tmp_path / "site")
    subprocess.run(["git", "apply", "-p1", str(PATCHES / "0.19.patch")], cwd=site, check=True)
    monkeypatch.syspath_prepend(str(site))  # spawned ranks import the patched copy
    patched = run_ranks_checked(train, 2, tp=2, kwargs=options, fixes=[])
    assert patched == hooked
    assert hooked[0].group_grad_norms["mtp"] > 0
    # the hook on an upstream that has the fix stands down: the same step, not a double scatter
    both = run_ranks_checked(train_with_status, 2, tp=2, kwargs=options, fixes=[FIX])
    assert [step for step, _ in both] == patched
    assert all(state == "redundant" for _, state in both)


def train_with_status(**model_kwargs):
    import mtp_overlay

    step = train(**model_kwargs)
    return step, mtp_overlay.status(only=[FIX])[0].state


def mtp_embeddings(decoder_input_index):
    """Worker: the MTP layer's decoder input, stock and hooked, on this TP rank."""
    import torch
    from megatron.core import __version__, parallel_state
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch

    model = build_tiny_gpt(**NOT_SCATTERING)
    batch = make_batch()
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    seq, size = batch["input_ids"].shape[1], model.config.hidden_size
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], embedding=model.embedding,
                  hidden_states=torch.zeros(seq // tp, batch["input_ids"].shape[0], size))
    layer = model.mtp.layers[0]
    stock = MultiTokenPredictionLayer._get_embeddings.__wrapped__(layer, **inputs)[decoder_input_index]
    hooked = layer._get_embeddings(**inputs)[decoder_input_index]
    chunk = seq // tp
    return __version__, tuple(stock.shape), tuple(hooked.shape), torch.equal(hooked, stock[rank * chunk : (rank + 1) * chunk])


@pytest.mark.slow
@pytest.mark.parametrize(("version", "decoder_input_index"), [("0.16.1", 2), ("0.18.2", 3)])
def test_hook_scatters_on_older_releases(version, decoder_input_index, monkeypatch):
    """0.16/0.18 GPTModel do not scatter a non-scattering embedding themselves (multimodal wrappers
    do), so the check is at the MTP layer: its decoder input becomes this TP rank's sequence chunk."""
    monkeypatch.syspath_prepend(str(release_site("megatron-core", version)))
    results = run_ranks_checked(mtp_embeddings, 2, tp=2, args=(decoder_input_index,), fixes=[FIX])
    for release, stock_shape, hooked_shape, is_chunk in results:
        assert release == version
        assert stock_shape == (32, 2, 64)  # stock: the full sequence against 16-token hidden states
        assert hooked_shape == (16, 2, 64) and is_chunk


# upstream carrying the fix in another spelling than the marker the probe reads: through an alias
ALIAS_SPELLING = (
    "        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)\n",
    (
        "        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)\n"
        "        if self.config.sequence_parallel and not getattr(embedding, 'scatter_to_sequence_parallel', True):\n"
        "            decoder_input = _scatter_for_mtp(decoder_input, group=self.tp_group)\n"
    ),
)


@pytest.mark.slow
def test_upstream_fix_in_another_spelling_is_never_applied_twice_and_check_run_says_they_disagree(
    tp1, tmp_path, monkeypatch
):
    """The probe misses the fix (the marker reads `scatter_to_sequence_parallel_region`, upstream calls
    an alias) and installs the hook: the hook checks the tensor, sees it already scattered and leaves
    it (the step equals TP1's); `mtp-overlay check --run` runs the stock path, finds no bug, and says
    the probe and the run disagree (exit 1)."""
    site = copy_installed("megatron-core", tmp_path / "site")
    module = site / "megatron" / "core" / "transformer" / "multi_token_prediction.py"
    source = module.read_text()
    old, new = ALIAS_SPELLING
    assert source.count(old) == 1
    module.write_text(source.replace(old, new) + "\n_scatter_for_mtp = scatter_to_sequence_parallel_region\n")
    checked = run_with_release(site, f"import sys; from mtp_overlay.cli import main; "
                                     f"sys.exit(main(['check', '--only', {FIX!r}, '--run']))")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "disagrees" in checked.stdout and "the probe says needed" in checked.stdout
    monkeypatch.syspath_prepend(str(site))  # spawned ranks import the edited copy
    hooked = run_ranks_checked(train_with_status, 2, tp=2, kwargs=NOT_SCATTERING, fixes=[FIX])
    assert all(state == "installed" for _, state in hooked)
    assert_same_losses(hooked[0][0], tp1)
