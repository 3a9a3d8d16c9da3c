"""End to end on a GPU: speculative decoding with a tiny Nemotron-H MTP model through vLLM's LLM API.

Written for a CUDA machine with vLLM installed; skipped elsewhere (not run yet: no GPU was lent).
A random tiny Nemotron-H (attention and MLP blocks only, so no Mamba kernel constraints) with one MTP
layer in ``mtp.*`` naming is served with ``speculative_config={"method": "mtp"}``; rollout metrics
come from vLLM's own spec-decode counters, and a refit of the drafter in the other naming, run in the
worker, is reported by the fix. Freshness: acceptance after a target-only refit (vLLM's own
``reload_weights``, which the drafter misses: the fix says so at the next step) against acceptance
after the drafter's refit too.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 4, 2, 64, 512


def write_checkpoint(directory):
    from safetensors.torch import save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, layers_block_type=["attention", "mlp", "attention", "mlp"], intermediate_size=512,
        num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*", max_position_embeddings=256,
        torch_dtype="bfloat16", architectures=["NemotronHForCausalLM"])
    torch.manual_seed(0)
    NemotronHForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    shapes = {
        "mixer.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN), "mixer.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "mixer.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "mixer.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "norm.weight": (HIDDEN,), "enorm.weight": (HIDDEN,), "hnorm.weight": (HIDDEN,),
        "eh_proj.weight": (HIDDEN, 2 * HIDDEN), "final_layernorm.weight": (HIDDEN,),
    }
    mtp = {f"mtp.layers.0.{name}": (torch.ones(shape) if len(shape) == 1 else torch.randn(shape) * 0.02)
           for name, shape in shapes.items()}
    save_file({name: t.to(torch.bfloat16).contiguous() for name, t in mtp.items()}, str(directory / "mtp.safetensors"))
    return mtp


def stale_refit_in_the_worker(worker):
    """Runs in vLLM's worker: refit the drafter with its head in positional naming, as one refit."""
    import mtp_overlay
    from mtp_overlay.fixes.vllm_mtp_drafter_load import drafter_refit

    mtp_overlay.install(only=["vllm-mtp-drafter-load"])
    drafter = worker.get_draft_model()
    names = [(name.replace("model.layers.0.", "model.layers.4."), p.detach().clone())
             for name, p in drafter.named_parameters() if name.startswith("model.layers.0.")]
    with drafter_refit(drafter) as block:
        drafter.load_weights(iter(names))
    return {"missing": block.report.missing, "dropped": block.report.dropped}


def test_speculative_decoding_with_a_tiny_mtp_model(tmp_path, monkeypatch):
    import mtp_overlay  # noqa: F401  (the engine's workers import it through the refit function)
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from mtp_overlay.mtp import rollout_mtp_metrics, with_prefix

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    write_checkpoint(tmp_path)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.3, disable_log_stats=False,  # get_metrics asserts stat logging on
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(8)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, detokenize=False))
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)

    counters = {metric.name: metric for metric in llm.get_metrics()}
    stats = SpecDecodingStats.new(1)
    stats.num_drafts = int(counters["vllm:spec_decode_num_drafts"].value)
    stats.num_accepted_tokens = int(counters["vllm:spec_decode_num_accepted_tokens"].value)
    stats.num_accepted_tokens_per_pos = [int(v) for v in counters["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
    metrics = with_prefix(rollout_mtp_metrics([stats]))
    assert stats.num_drafts > 0 and 0.0 <= metrics["mtp/rollout_acceptance_pos_1"] <= 100.0
    assert 1.0 <= metrics["mtp/rollout_mean_acceptance_length"] <= 2.0

    [report] = llm.collective_rpc(stale_refit_in_the_worker)
    assert len(report["missing"]) == len(report["dropped"]) == 7  # qkv fused: 7 parameters, 7 names


# --- freshness: acceptance after a target-only refit vs a draft refit --------------------------------
# The refits make acceptance predictable with random weights: a zero final norm makes a model's
# hidden state 0, hence its logits 0 and its greedy token 0 (argmax takes the first maximum). The
# target refit zeroes the target's final norm (it then always says 0); a drafter left stale keeps its
# own random final norm and rarely drafts 0; the draft refit zeroes the MTP head's final norm too, and
# every draft (0) is accepted.

NAME = "vllm-mtp-drafter-load"


def watch_in_the_worker(worker):
    """Runs in vLLM's worker: install the fix (late: the classes are wrapped where they are) and keep
    what it says."""
    import warnings

    import mtp_overlay
    from mtp_overlay import OverlayWarning

    mtp_overlay.install(only=[NAME])
    said = worker.__dict__.setdefault("_test_overlay_said", [])
    shown = warnings.showwarning

    def keep(message, category, *args, **kwargs):
        if issubclass(category, OverlayWarning):
            said.append(str(message))
        return shown(message, category, *args, **kwargs)

    warnings.showwarning = keep
    warnings.simplefilter("always", OverlayWarning)
    return mtp_overlay.status(only=[NAME])[0].state


def target_only_refit_in_the_worker(worker, directory):
    """vLLM's own reload_weights with the full export (the MTP head's mtp.* names included, which the
    target drops), the target's final norm zeroed: a target refit the drafter never gets."""
    import os

    import torch
    from safetensors.torch import load_file

    from mtp_overlay.fixes.vllm_mtp_drafter_load import refits_behind

    export = {**load_file(os.path.join(directory, "model.safetensors")), **load_file(os.path.join(directory, "mtp.safetensors"))}
    export["backbone.norm_f.weight"] = torch.zeros_like(export["backbone.norm_f.weight"])
    worker.model_runner.reload_weights(weights_iterator=iter(export.items()))
    return refits_behind(worker)


def draft_refit_in_the_worker(worker, directory):
    """The drafter's own load_weights of the MTP head (final norm zeroed), as one refit."""
    import os

    import torch
    from safetensors.torch import load_file

    from mtp_overlay.fixes.vllm_mtp_drafter_load import drafter_refit, refits_behind

    head = load_file(os.path.join(directory, "mtp.safetensors"))
    head["mtp.layers.0.final_layernorm.weight"] = torch.zeros_like(head["mtp.layers.0.final_layernorm.weight"])
    drafter = worker.get_draft_model()
    with drafter_refit(drafter) as block:
        drafter.load_weights(iter(head.items()))
    return {"behind": refits_behind(worker), "ok": block.report.ok}


def said_in_the_worker(worker):
    return list(worker.__dict__.get("_test_overlay_said", []))


def acceptance(llm, prompts):
    """(drafts, accepted) of one greedy generate, from vLLM's own spec-decode counters."""
    from vllm import SamplingParams

    def counters():
        found = {metric.name: metric for metric in llm.get_metrics()}
        return int(found["vllm:spec_decode_num_drafts"].value), int(found["vllm:spec_decode_num_accepted_tokens"].value)

    drafts, accepted = counters()
    llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, detokenize=False))
    after = counters()
    return after[0] - drafts, after[1] - accepted


def test_acceptance_after_a_target_only_refit_and_after_a_draft_refit(tmp_path, monkeypatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    write_checkpoint(tmp_path)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.3, disable_log_stats=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(8)]
    assert llm.collective_rpc(watch_in_the_worker) == ["installed"]
    acceptance(llm, prompts)  # the starting checkpoint: whatever it accepts

    assert llm.collective_rpc(target_only_refit_in_the_worker, args=(str(tmp_path),)) == [1]
    assert llm.collective_rpc(said_in_the_worker) == [[]]
    stale_drafts, stale_accepted = acceptance(llm, prompts)
    [said] = llm.collective_rpc(said_in_the_worker)
    assert len(said) == 1 and "is 1 target refit behind" in said[0] and "execute_model" in said[0]

    [draft] = llm.collective_rpc(draft_refit_in_the_worker, args=(str(tmp_path),))
    assert draft == {"behind": 0, "ok": True}
    fresh_drafts, fresh_accepted = acceptance(llm, prompts)
    assert llm.collective_rpc(said_in_the_worker) == [said]  # nothing more: the drafter is fresh
    assert stale_drafts > 0 and fresh_drafts > 0
    assert fresh_accepted / fresh_drafts >= 0.9 > 0.5 >= stale_accepted / stale_drafts
