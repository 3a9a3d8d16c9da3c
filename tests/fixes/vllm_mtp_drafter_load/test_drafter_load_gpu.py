"""End to end on a GPU: speculative decoding with a tiny Nemotron-H MTP model through vLLM's LLM API.

Written for a CUDA machine with vLLM installed; skipped elsewhere (not run yet: no GPU was lent).
A random tiny Nemotron-H (attention and MLP blocks only, so no Mamba kernel constraints) with one MTP
layer in ``mtp.*`` naming is served with ``speculative_config={"method": "mtp"}``; rollout metrics
come from vLLM's own spec-decode counters, and a refit of the drafter in the other naming, run in the
worker, is reported by the fix.
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
              gpu_memory_utilization=0.3, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
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
