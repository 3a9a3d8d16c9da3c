"""The test bed itself: stock megatron-core 0.19.x MTP on spawned gloo ranks (mtp_overlay.bed).

Parity is the proof that the launcher, the CPU shims and train_step are right: the same weights and
batch give the same LM and MTP loss (and gradients) at TP1, TP2+SP, CP2 and TP2xCP2+SP.
"""

import math
import os
import subprocess
import sys
import time

import pytest

from mtp_overlay.bed.runtime.launcher import RankResult, RanksFailed, run_ranks, run_ranks_checked

SEQ_LENGTH = 32  # make_batch's default
BATCH_SIZE = 2


# Masking MTP position 8 (its depth-1 target, token 9, sits on CP rank 1) balances the sequence's last
# position, which has no target and sits on CP rank 0: both CP ranks then hold 15 valid MTP positions
# per row, so even stock megatron-core's per-rank MTP normalisation agrees with the global one.
BALANCING_MASK_ZERO = 9
STEPS = ("default", "balanced", "rl")


def train(**model_kwargs):
    """Worker: build the tiny GPT, then three train_steps on the default batch.

    "default": the batch as made (the MTP loss_mask is the batch's all-ones mask).
    "balanced": the MTP loss_mask (CP-sliced, passed to GPTModel.forward) is 0 at BALANCING_MASK_ZERO.
    "rl": no labels (as an RL trainer calls it): the model returns logits, Megatron derives the MTP
    labels from input_ids.
    """
    import torch

    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, cp_slice, make_batch, train_step

    model = build_tiny_gpt(**model_kwargs)
    batch = make_batch(batch_size=BATCH_SIZE, seq_length=SEQ_LENGTH)
    mask = torch.ones(BATCH_SIZE, SEQ_LENGTH)
    mask[:, BALANCING_MASK_ZERO] = 0
    return {
        "default": train_step(model, batch),
        "balanced": train_step(model, batch, loss_mask=cp_slice(mask)),
        "rl": train_step(model, batch, labels=None),
    }


def assert_same_step(result, reference, *, rel=1e-5, grads=True):
    assert result.lm_loss == pytest.approx(reference.lm_loss, rel=rel)
    assert result.mtp_losses == pytest.approx(reference.mtp_losses, rel=rel)
    assert result.mtp_tokens == reference.mtp_tokens
    assert result.zero_grad_params == ()
    if grads:
        assert result.grad_norm == pytest.approx(reference.grad_norm, rel=rel)
        assert result.group_grad_norms == pytest.approx(reference.group_grad_norms, rel=rel)


def assert_ranks_agree(values):
    assert all(value == values[0] for value in values[1:]), values


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(train, 1)[0]


@pytest.fixture(scope="module")
def cp2():
    results = run_ranks_checked(train, 2, cp=2)
    assert_ranks_agree(results)
    return results[0]


def test_tp1_trains_lm_and_mtp(tp1):
    default, balanced = tp1["default"], tp1["balanced"]
    # a random-init model predicts uniformly: cross entropy near ln(vocab)
    assert default.lm_loss == pytest.approx(math.log(128), abs=0.3)
    assert len(default.mtp_losses) == 1 and default.mtp_loss == pytest.approx(math.log(128), abs=0.3)
    # depth 1 scores position i against token i+2: the last position of each row has none
    assert default.mtp_tokens == (BATCH_SIZE * (SEQ_LENGTH - 1),)
    assert balanced.mtp_tokens == (BATCH_SIZE * (SEQ_LENGTH - 2),)
    assert balanced.lm_loss == default.lm_loss and balanced.mtp_loss != default.mtp_loss
    # without labels the LM loss is the same, computed here from the logits; MTP labels rolled out of
    # input_ids lack the text's last token, so one more position per row has no target
    rl = tp1["rl"]
    assert rl.lm_loss == pytest.approx(default.lm_loss, rel=1e-6)
    assert rl.mtp_tokens == (BATCH_SIZE * (SEQ_LENGTH - 2),)
    for result in (default, balanced, rl):
        assert result.zero_grad_params == ()
        assert all(norm > 0 for norm in result.group_grad_norms.values()), result.group_grad_norms


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_tp1(tp1):
    results = run_ranks_checked(train, 2, tp=2, kwargs=dict(sequence_parallel=True))
    assert_ranks_agree(results)
    for step in STEPS:
        assert_same_step(results[0][step], tp1[step])


@pytest.mark.slow
def test_cp2_matches_tp1(tp1, cp2):
    # every step, gradients included: the overlay's mtp-cp-loss-scale normalises the MTP loss by the
    # whole sequence's token counts (stock megatron-core uses each CP rank's own: rank 0 holds the
    # positions without a target; tests/fixes/mtp_cp_loss_scale shows both)
    for step in STEPS:
        assert_same_step(cp2[step], tp1[step])


@pytest.mark.slow
def test_tp2_cp2_sequence_parallel_matches_tp1_and_cp2(tp1, cp2):
    results = run_ranks_checked(train, 4, tp=2, cp=2, kwargs=dict(sequence_parallel=True))
    assert_ranks_agree(results)
    assert_same_step(results[0]["balanced"], tp1["balanced"])
    assert_same_step(results[0]["default"], cp2["default"])
    assert_same_step(results[0]["rl"], cp2["rl"])


@pytest.mark.gpu
def test_cuda_tp1_matches_cpu(tp1):
    result = run_ranks_checked(train, 1, device="cuda")[0]
    for step in STEPS:
        assert_same_step(result[step], tp1[step], rel=1e-4)


def fail_on_rank(rank_to_fail, how):
    """Worker: rank ``rank_to_fail`` raises (how="raise") or dies (how="exit"); after a death the
    other ranks wait in a barrier for it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == rank_to_fail:
        if how == "raise":
            raise ValueError(f"boom on rank {rank}")
        os._exit(3)
    if how == "exit":
        dist.barrier()
    return rank


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RanksFailed) as failure:
        run_ranks_checked(fail_on_rank, 2, args=(1, "raise"), timeout=120)
    results = failure.value.results
    assert results[0] == RankResult(0, value=0)
    assert results[1].rank == 1 and results[1].value is None
    assert "ValueError: boom on rank 1" in results[1].error and "fail_on_rank" in results[1].error
    assert "1 of 2 ranks failed" in str(failure.value) and "boom on rank 1" in str(failure.value)


def test_crashed_rank_does_not_hang_the_others():
    started = time.monotonic()
    results = run_ranks(fail_on_rank, 2, args=(1, "exit"), timeout=300)
    assert time.monotonic() - started < 120  # far below the timeout: the barrier did not hang us
    assert results[1] == RankResult(1, error="rank 1 died without a result (exit code 3)")
    assert not results[0].ok  # its barrier partner died: gloo fails it, or it is killed


def test_timeout_kills_the_ranks():
    results = run_ranks(fail_on_rank, 1, args=(-1, "raise"), timeout=0.5, fresh=True)  # startup alone takes longer
    assert results == [RankResult(0, error="rank 0 was killed after the 0.5 s timeout: it never returned")]


def fix_states():
    """Worker: the state of each megatron-core fix once its target module is imported."""
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    import mtp_overlay

    return {row.name: row.state for row in mtp_overlay.status() if row.distribution == "megatron-core"}


def test_fixes_selects_what_the_workers_install():
    states = run_ranks_checked(fix_states, 1, fixes=["mtp-sp-scatter"])[0]
    assert states.pop("mtp-sp-scatter") == "installed"
    assert states and all(state == "disabled" for state in states.values()), states


# the upstream modules the megatron-core fixes hook (stock megatron-core's names): importing them runs
# the post-import hook of every megatron-core fix installed, and of none that is not
MEGATRON_TARGETS = (
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.hybrid.hybrid_model",
)
MEGATRON_FIXES = ("mtp-sp-scatter", "mtp-packed-roll", "mtp-loss-mask", "mtp-cp-loss-scale", "mtp-moe-router")


def fix_modules_after_targets():
    """Worker: import every megatron-core fix's target; the fix modules this process has imported, and
    the overlay switch its environment holds."""
    import importlib

    for target in MEGATRON_TARGETS:
        importlib.import_module(target)
    # a fix is its package: mtp_overlay.fixes.<fix_id> with its declaration and other modules
    fixes = sorted({".".join(name.split(".")[:3]) for name in sys.modules if name.startswith("mtp_overlay.fixes.")})
    return fixes, os.environ.get("MTP_OVERLAY_DISABLE")


def fix_modules(*fix_ids):
    return sorted("mtp_overlay.fixes." + fix_id.replace("-", "_") for fix_id in fix_ids)


def test_a_rank_imports_the_fixes_its_run_asks_for_and_no_other(monkeypatch):
    """Ranks are born with the overlay off: a ``fixes=[]`` rank never imports a fix module, though every
    target is imported; ``["mtp-sp-scatter"]`` imports that one alone (the caller's MTP_OVERLAY_DISABLE,
    which names it, does not apply to a list); None installs what the caller's switch leaves on, which
    loads every other megatron-core fix here (the worker does see them load). The run itself sees the
    caller's switch."""
    monkeypatch.setenv("MTP_OVERLAY_DISABLE", "mtp-sp-scatter")
    stock = run_ranks_checked(fix_modules_after_targets, 1, fixes=[], fresh=True)[0]
    assert stock == ([], "mtp-sp-scatter")
    one = run_ranks_checked(fix_modules_after_targets, 1, fixes=["mtp-sp-scatter"], fresh=True)[0]
    assert one == (fix_modules("mtp-sp-scatter"), "mtp-sp-scatter")
    default, switch = run_ranks_checked(fix_modules_after_targets, 1, fresh=True)[0]
    assert switch == "mtp-sp-scatter"
    assert set(fix_modules(*MEGATRON_FIXES[1:])) <= set(default)
    assert not set(fix_modules("mtp-sp-scatter")) & set(default)


STOCK_CHECK = """
import importlib, json, os, sys
for target in %r:
    importlib.import_module(target)
import mtp_overlay
print(json.dumps({"fixes": sorted({".".join(name.split(".")[:3]) for name in sys.modules
                                   if name.startswith("mtp_overlay.fixes.")}),
                  "installed": [row.name for row in mtp_overlay.status() if row.state == "installed"],
                  "switch": os.environ.get("MTP_OVERLAY_DISABLE")}))
""" % (MEGATRON_TARGETS,)


@pytest.mark.parametrize("interpreter", ["forked", pytest.param("subprocess", marks=pytest.mark.slow)])  # two interpreter starts
def test_a_fresh_interpreter_installs_exactly_the_fixes_asked_for(interpreter):
    """run_python(fixes=...): ``[]`` a stock interpreter (every target imported, no fix module), a list
    exactly those, None what ``import mtp_overlay`` installs there (the environment's choice), as
    ``python -c`` does; the code sees the caller's environment. A variable only interpreter start-up
    reads (PYTHONWARNINGS) makes it a real subprocess, born stock the same way."""
    import json

    from mtp_overlay.bed.runtime.preloaded import run_python

    env = {**os.environ, "MTP_OVERLAY_DISABLE": "mtp-loss-mask"}
    asked = [[], ["mtp-sp-scatter"], None]
    if interpreter == "subprocess":  # (None there is subprocess.run itself)
        env["PYTHONWARNINGS"], asked = "ignore", asked[:2]
    found = {}
    for fixes in asked:
        result = run_python(STOCK_CHECK, env, timeout=300, fixes=fixes)
        assert result.returncode == 0, result.stderr[-3000:]
        found[repr(fixes)] = json.loads(result.stdout.splitlines()[-1])
    assert {row["switch"] for row in found.values()} == {"mtp-loss-mask"}
    # "fixes": imported by the targets' import; "installed": after status(), which imports every fix module
    assert found["[]"]["fixes"] == [] and found["[]"]["installed"] == []
    assert found["['mtp-sp-scatter']"]["fixes"] == fix_modules("mtp-sp-scatter")
    assert found["['mtp-sp-scatter']"]["installed"] == ["mtp-sp-scatter"]
    if interpreter == "forked":
        # the switch leaves out mtp-loss-mask; mtp-moe-router installs on hybrid_model's HybridStack import
        assert set(found["None"]["installed"]) == {"mtp-sp-scatter", "mtp-packed-roll", "mtp-cp-loss-scale",
                                                   "mtp-moe-router", "mtp-logprob-skip"}


def test_fixes_must_be_a_list_of_known_fix_ids():
    from mtp_overlay.bed.runtime.preloaded import run_python

    with pytest.raises(TypeError, match="got the string 'mtp-sp-scatter'"):
        run_python("pass", dict(os.environ), timeout=60, fixes="mtp-sp-scatter")
    with pytest.raises(ValueError, match="unknown fix 'no-such-fix'"):
        run_python("pass", dict(os.environ), timeout=60, fixes=["no-such-fix"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(world_size=3, tp=2), "world_size (3) must be a multiple of tp * cp * pp (2 * 1 * 1)"),
        (dict(world_size=2, pp=4), "world_size (2) must be a multiple of tp * cp * pp (1 * 1 * 4)"),
        (dict(world_size=2, pp=0), "pp must be a positive int, got 0"),
        (dict(world_size=0), "world_size must be a positive int"),
        (dict(world_size=2, ep=0), "ep must be a positive int"),
        (dict(world_size=2, etp=True), "etp must be a positive int, got True (or None: tp)"),
        (dict(world_size=2, tp=2, ep=2), "world_size (2) must be a multiple of etp * ep (2 * 2; etp defaults to tp)"),
        (dict(world_size=1, fixes=["no-such-fix"]), "unknown fix 'no-such-fix'"),
        (dict(world_size=1, device="tpu"), "device must be one of"),
        (dict(world_size=1, timeout=0), "timeout must be a positive number"),
    ],
)
def test_bad_arguments_are_refused_before_spawning(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        run_ranks(fail_on_rank, **options)


def test_cpu_shims_install_and_restore_the_originals():
    from mtp_overlay.bed.runtime import cpu_shims

    shims = cpu_shims.shims()
    originals = [vars(shim.owner)[shim.attribute] for shim in shims]
    with cpu_shims.cpu_shims():
        assert cpu_shims.installed()
        import torch

        assert torch.cuda.current_device() == torch.device("cpu")
        assert all(vars(s.owner)[s.attribute] is not o for s, o in zip(shims, originals))
    assert not cpu_shims.installed()
    assert all(vars(s.owner)[s.attribute] is o for s, o in zip(shims, originals))


MAIN_INFERENCE_CHECK = """

from megatron.core.tensor_parallel import inference_layers as _inference_layers


def is_inference_column_parallel_linear(module):  # Megatron-LM main's test (d98e8a64 inference_layers.py:564)
    return isinstance(
        module, (_inference_layers.InferenceColumnParallelLinear, _inference_layers.InferenceLayerNormColumnParallelLinear)
    )
"""

MAIN_SHIM_CHECK = """
import torch
from megatron.core.transformer import multi_token_prediction as mtp
from mtp_overlay.bed.runtime import cpu_shims
linear = torch.nn.Linear(2, 2)
original = mtp.is_inference_column_parallel_linear
try:
    original(linear)
except TypeError as exc:
    print("stock:", exc)
with cpu_shims.cpu_shims():
    print("shimmed:", mtp.is_inference_column_parallel_linear(linear))
print("restored:", mtp.is_inference_column_parallel_linear is original)
"""


@pytest.mark.slow
def test_main_inference_linear_shim_applies_only_where_upstream_has_the_check(tmp_path):
    """Megatron-LM main asks every MTP layer ``is_inference_column_parallel_linear``, whose isinstance
    fails without Transformer Engine. The pinned release has no such check (the shim is skipped); a
    copy of it given main's check fails the same way, and the shim answers False and is taken back."""
    from megatron.core.transformer import multi_token_prediction

    from mtp_overlay.bed.runtime import cpu_shims
    from mtp_overlay.bed.runtime.releases import copy_installed, run_with_release

    assert "is_inference_column_parallel_linear" not in vars(multi_token_prediction)
    assert not [s for s in cpu_shims.shims() if s.attribute == "is_inference_column_parallel_linear"]
    site = copy_installed("megatron-core", tmp_path / "site")
    with open(site / "megatron" / "core" / "transformer" / "multi_token_prediction.py", "a") as module:
        module.write(MAIN_INFERENCE_CHECK)
    result = run_with_release(site, MAIN_SHIM_CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "stock: isinstance() arg 2 must be a type, a tuple of types, or a union", "shimmed: False", "restored: True",
    ]


@pytest.mark.slow
def test_plugin_is_opt_in_then_skips_gpu_tests_and_serves_the_launcher(tmp_path):
    """An environment with mtp-overlay installed leaves a user's own pytest run unpatched, unless asked."""
    import torch

    (tmp_path / "test_user.py").write_text(
        "import sys\n"
        "import pytest\n"
        "def test_stock_upstream():\n"
        "    assert ('mtp_overlay' in sys.modules) == pytest.OPTED_IN\n"
        "@pytest.mark.gpu\n"
        "def test_needs_gpu():\n"
        "    import torch\n"
        "    assert torch.cuda.is_available()\n"
    )
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_configure(config):\n"
        "    pytest.OPTED_IN = config.pluginmanager.has_plugin('mtp_overlay.bed.plugin')\n"
    )

    def pytest_run(*options):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *options, str(tmp_path)],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )

    plain = pytest_run()  # no plugin: the overlay is not imported, and the gpu marker means nothing
    assert "PASSED test_user.py::test_stock_upstream" in plain.stdout, plain.stdout
    assert "SKIPPED" not in plain.stdout
    (tmp_path / "test_fixture.py").write_text(
        "from mtp_overlay.bed.runtime.launcher import run_ranks\n"
        "def test_fixture(mtp_run_ranks):\n"
        "    assert mtp_run_ranks is run_ranks\n"
    )
    opted = pytest_run("-p", "mtp_overlay.bed.plugin")
    expected = "3 passed" if torch.cuda.is_available() else "2 passed, 1 skipped"
    assert expected in opted.stdout, opted.stdout + opted.stderr


def test_unpicklable_function_is_refused_before_any_rank_starts():
    with pytest.raises(Exception, match="pickle"):
        run_ranks(lambda: 0, 2)


FRESH = """
import json, os, sys
print(json.dumps({"ours": sorted(m for m in sys.modules if m.split(".")[0] in ("mtp_overlay", "megatron", "vllm")),
                  "path": sys.path, "cwd": os.getcwd(), "marker": os.environ.get("MARKER"), "main": __name__}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("STATUS", "0")))
"""


@pytest.mark.parametrize("status", ["0", "3"])
def test_preloaded_child_is_a_fresh_interpreter_as_subprocess_would_start_it(status, tmp_path):
    """run_python against `python -c` itself: the environment, PYTHONPATH first on sys.path, the working
    folder, ``__main__``, stdout, stderr and the exit status; nothing of ours or of a fixed upstream
    imported before the code runs (only torch's stack is)."""
    import json

    from mtp_overlay.bed.runtime.preloaded import run_python

    env = {**os.environ, "MARKER": "m", "STATUS": status, "PYTHONPATH": str(tmp_path)}
    forked = run_python(FRESH, env, timeout=120, cwd=tmp_path)
    real = subprocess.run([sys.executable, "-c", FRESH], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert forked.returncode == real.returncode == int(status)
    seen = json.loads(real.stdout)
    assert json.loads(forked.stdout) == seen
    assert seen["ours"] == [] and seen["path"][0] == "" and str(tmp_path) in seen["path"]
    assert (seen["cwd"], seen["marker"], seen["main"]) == (str(tmp_path), "m", "__main__")
    assert forked.stderr.endswith("to stderr\n") and real.stderr.endswith("to stderr\n")


def test_preloaded_child_reports_an_exception_and_a_timeout():
    from mtp_overlay.bed.runtime.preloaded import run_python

    failed = run_python("raise ValueError('bad')", dict(os.environ), timeout=120)
    assert failed.returncode == 1 and "ValueError: bad" in failed.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("import time; time.sleep(60)", dict(os.environ), timeout=2)
