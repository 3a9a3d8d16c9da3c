"""``mtp_overlay.verify`` on real runs: the test bed's engine in this process (`bed.engines.verify.Engine`, the
suite's shared rank pools) builds the shrunk configs with Megatron-Bridge's providers and runs Megatron's
own step; the product judges. What the CLI does, without the child process (the one run of the CLI
itself is tests/verification/test_verify_cli.py).

Wall times (2 cores, load ~10, a cold world-2 pool: Bridge's import in each rank): the data-path test
~10 s; the NemotronH folder at TP2+SP ~55 s; every family ~45 s more on the warm pool (slow).
"""

import json
from pathlib import Path

import pytest
import torch

from saved_by_transformers import nemotron_h, saved

from mtp_overlay import verification
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.verification import data

CONFIG = Path(__file__).parent / "configs" / "nemotron_h_like"
needs_bridge = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)


def engine(lines=None):
    from mtp_overlay.bed.engines.verify import Engine

    return Engine(2, progress=(lines.append if lines is not None else None))


@pytest.mark.parametrize("packing", verification.PACKINGS)
def test_the_engines_microbatch_holds_the_products_sequences_where_its_slot_map_says(packing):
    """Every slot the engine's slot map puts at (sequence, position) holds that token, its label and the
    mask of the oracle's convention; every other slot is padding (token 0, masks 0)."""
    from mtp_overlay.bed.engines.verify import microbatch

    sequences = data.draw([(9, 2), (12, 0), (6, 3), (4, 1)], 128, seed=5)
    plan = dict(sequences=[list(s.tokens) for s in sequences], prompts=[s.prompt for s in sequences], forward="rl",
                packing=packing, pad_multiple=None)
    batch, slots = microbatch(plan, dict(tp=2, cp=2, sp=True))
    assert batch["input_ids"].shape[1] % 8 == 0  # NeMo-RL's 2·CP·TP
    for row, columns in enumerate(slots):
        for column, (index, position) in enumerate(columns):
            sequence = sequences[index]
            real = position < sequence.length
            assert int(batch["input_ids"][row, column]) == (sequence.tokens[position] if real else 0)
            assert int(batch["labels"][row, column]) == (sequence.tokens[position + 1] if real else 0)
            assert float(batch["mtp_loss_mask"][row, column]) == float(real and position >= sequence.prompt)
            lm = real and position + 1 < sequence.length and position + 1 >= sequence.prompt
            assert float(batch["loss_mask"][row, column]) == float(lm)
    params = batch.get("packed_seq_params")
    if packing == "none":
        assert params is None and len(slots) == len(sequences)
    else:
        real = torch.tensor([0] + [s.length for s in sequences]).cumsum(0)
        assert torch.equal(params.cu_seqlens_q.long(), real if packing == "thd-real-lengths"
                           else params.cu_seqlens_q_padded.long())


@pytest.mark.parametrize("pattern, stages, staged", [("ME*-", 2, "ME|*-"), ("ME*", 2, "ME|*"), ("M*E-M", 3, "M*|E-|M"),
                                                     ("M|E*", 1, "ME*")])
def test_a_hybrid_pattern_is_cut_into_one_segment_per_stage(pattern, stages, staged):
    from mtp_overlay.bed.engines.verify import staged_pattern

    assert staged_pattern(pattern, stages) == staged


def test_the_engine_answers_a_bad_request_without_starting_ranks():
    """The child process's protocol: a JSON line in, a JSON line out, an error as its message."""
    from mtp_overlay.verification.engine import ChildEngine

    child = ChildEngine(1)
    try:
        answer = child.request({"op": "nothing"})
    finally:
        child.close()
    assert answer["error"] == "ValueError: op must be 'describe' or 'run', got 'nothing'"


@pytest.mark.slow
@needs_bridge
def test_a_nemotron_h_folder_at_tp2_sp_real_lengths_needs_sp_scatter_and_packed_roll(tmp_path):
    """The issue's command: ``verify --hf-config <NemotronH folder> --tp 2 --sp --cp 1 --packing
    thd-real-lengths`` on the folder ``NemotronHConfig(...).save_pretrained`` writes (``layers_block_type``
    lists, ``time_step_limit`` with transformers' encoding of inf), ``scatter_embedding_sequence_parallel:
    false`` in it (Nemotron VL/Omni's language model), no ``architectures`` (``NemotronHConfig(...)`` names
    none unless given): stock crashes; the overlay equals both references (exit 0); the fixes it needs
    are named with the rows that show why."""
    # as transformers saves it
    folder = nemotron_h(tmp_path, scatter_embedding_sequence_parallel=False, architectures=None)
    assert json.loads((folder / "config.json").read_text())["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    lines = []
    report = verification.verify(folder, tp=2, sp=True, cp=1, packing="thd-real-lengths", engine=engine(lines),
                                 progress=lines.append)
    assert report.exit_code == 0 and report.ok, report.text()
    assert report.built["model"] == "HybridModel" and report.built["hybrid_layer_pattern"] == "ME*/*E/*E"
    assert report.built["scatter_embedding_sequence_parallel"] is False and report.built["mtp_use_repeated_layer"]
    for depth in report.overlay.depths:
        assert depth.trained == depth.allowed and not depth.wrong and not depth.missed
    assert report.stock.error.startswith("RuntimeError: Sizes of tensors must match")
    needs = {need.fix: need for need in report.needs}
    assert set(needs) == {"mtp-sp-scatter", "mtp-packed-roll"}
    assert needs["mtp-sp-scatter"].case.error.startswith("RuntimeError: Sizes of tensors must match")
    # without mtp-packed-roll, mtp-loss-mask refuses the layout; without both, stock's roll trains shifted targets
    roll = needs["mtp-packed-roll"]
    assert roll.case.error.startswith("ValueError: packed_seq_params.cu_seqlens_q")
    assert roll.deeper is not None and roll.deeper.depths[0].wrong and roll.deeper.depths[0].missed
    text = report.text()
    assert "mtp-sp-scatter: without it, crash: RuntimeError" in text and "OK:" in text
    assert "architectures (config.json): None -> ['NemotronHForCausalLM']" in text
    assert any("through Megatron's own step" in line for line in lines)


@pytest.mark.slow
@needs_bridge
def test_every_family_the_test_bed_builds_verifies_and_what_it_cannot_build_is_named(tmp_path):
    """Qwen3 and Qwen3-MoE through Bridge (folders transformers saved), GPT (a provider in a Python file, TP1)
    and NemotronH with M, E and * layers (the previous test) verify; a family Bridge cannot build is a
    ValueError naming Bridge's refusal. Qwen3's gated MLP (SwiGLU) at TP2 (each rank's fc1 [gate_r; up_r]:
    gathered by its partition layout) and Qwen3-MoE at EP2 (every expert drawn on every rank: the EP2 model
    holds the reference's weights, its LM loss is the reference's; at TP2xEP2+SP too) are no false alarm."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    qwen3 = saved(Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=256, num_attention_heads=6,
                              num_key_value_heads=2, head_dim=32, intermediate_size=512, num_hidden_layers=3,
                              num_nextn_predict_layers=1, tie_word_embeddings=True), tmp_path / "qwen3")
    report = verification.verify(qwen3, tp=2, engine=engine(), search=False)
    assert report.ok and report.built["model"] == "GPTModel", report.text()
    assert report.built["share_embeddings_and_output_weights"] is True
    assert report.overlay.grad_relerr["lm"] <= 1e-6 and report.needs == ()
    moe = saved(Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                               num_nextn_predict_layers=2), tmp_path / "qwen3_moe")
    report = verification.verify(moe, ep=2, engine=engine(), search=False)
    assert report.ok and report.layout == "EP2" and report.built["num_moe_experts"] == 4, report.text()
    assert abs(report.stock.lm_loss - report.reference.lm_loss) <= 1e-6 * report.reference.lm_loss
    # TP2xEP2+SP with expert TP = TP (verify's default): the tokens routed to a rank's experts are
    # gathered over the expert-TP group with uneven counts (cpu_shims' gather on gloo)
    from mtp_overlay.bed.engines.verify import Engine

    report = verification.verify(moe, tp=2, ep=2, sp=True, engine=Engine(4), search=False)
    assert report.ok and report.layout == "TP2xEP2+SP", report.text()
    assert abs(report.stock.lm_loss - report.reference.lm_loss) <= 1e-6 * report.reference.lm_loss

    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "def provider():\n"
        "    from megatron.bridge.models.gpt_provider import GPTModelProvider\n"
        "    return GPTModelProvider(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=2,\n"
        "                            ffn_hidden_size=2048, vocab_size=32000, seq_length=4096, mtp_num_layers=2,\n"
        "                            normalization='RMSNorm', position_embedding_type='rope')\n")
    report = verification.verify(provider=f"{recipe}:provider", packing="none", engine=engine(), search=False)
    assert report.ok and report.built["model"] == "GPTModel" and report.built["mtp_num_layers"] == 2, report.text()
    assert report.needs == () and len(report.overlay.depths) == 2

    from transformers import GPT2Config

    (tmp_path / "gpt2").mkdir()
    gpt2 = GPT2Config(architectures=["GPT2LMHeadModel"], num_nextn_predict_layers=1).to_dict()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match="Megatron-Bridge .* cannot build this config"):
        verification.verify(tmp_path / "gpt2", engine=engine())


@pytest.mark.slow
@needs_bridge
def test_pipeline_stages_through_megatrons_pipelined_schedule(tmp_path):
    """PP2 (the NemotronH folder's pattern cut into two stages, MTP on the last; each stage holding the
    weights of the model without stages): with the packer's padding of 4, real lengths need
    mtp-packed-roll, and the overlay equals both references; tied embeddings under PP are refused,
    naming --pp."""
    report = verification.verify(CONFIG, pp=2, packing="thd-real-lengths", pad_multiple=4, engine=engine(),
                                 search=False)
    assert report.ok and report.layout == "PP2", report.text()
    assert [need.fix for need in report.needs] == ["mtp-packed-roll"]
    recipe = tmp_path / "tied.py"
    recipe.write_text(
        "def provider():\n"
        "    from megatron.bridge.models.gpt_provider import GPTModelProvider\n"
        "    return GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,\n"
        "                            seq_length=64, mtp_num_layers=1, share_embeddings_and_output_weights=True)\n")
    with pytest.raises(ValueError, match="--pp 2 with tied embeddings"):
        verification.verify(provider=f"{recipe}:provider", pp=2, engine=engine())
    recipe.write_text(recipe.read_text().replace("mtp_num_layers=1", "mtp_num_layers=None"))
    with pytest.raises(ValueError, match=f"^--provider {recipe}:provider: the config has no MTP layers"):
        verification.verify(provider=f"{recipe}:provider", engine=engine())


OMNI = Path(__file__).parent / "configs" / "nemotron_omni_like"
# what the CLIP stand-in changes of the LLaVAModel arguments Bridge's Omni provider passes
# (multimodal_stand_ins.bridge_vl_clip_vision)
CLIP_SUBSTITUTIONS = {"vision.vision_model_type", "vision.num_layers", "vision.num_attention_heads",
                      "vision.num_query_groups", "vision.kv_channels", "vision.hidden_size", "vision.ffn_hidden_size",
                      "img_h", "img_w", "pixel_shuffle", "dynamic_resolution"}
OMNI_PROVIDER = """
def provider():
    from megatron.bridge.models.nemotron_omni.nemotron_omni_provider import NemotronOmniModelProvider

    return NemotronOmniModelProvider(
        hybrid_layer_pattern="M*E-", mtp_hybrid_override_pattern="*E", mtp_num_layers=1, hidden_size=1024,
        num_attention_heads=8, num_query_groups=2, kv_channels=128, ffn_hidden_size=4096, num_moe_experts=16,
        moe_router_topk=2, moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=1024, mamba_num_heads=32,
        mamba_head_dim=64, mamba_num_groups=4, vocab_size=32000, seq_length=4096, image_token_index=18,
        language_model_type="nemotron6-moe", vision_proj_ffn_hidden_size=4096)
"""


def judged_positions_hold(case):
    """Every MTP depth of ``case`` trained exactly the combined-slot pairs the oracle allows, none at an
    image slot."""
    assert case.depths and all(depth.trained == depth.allowed > 0 and not depth.wrong and not depth.missed
                               and depth.image_targets == 0 for depth in case.depths), case.problems()


@pytest.mark.slow
@needs_bridge
def test_a_nemotron_omni_config_verifies_with_images_at_tp2_sp_and_an_omni_provider_at_cp2(tmp_path):
    """The Nemotron-Omni-like folder (its llm_config the NemotronH-like one: M, E and * layers, MTP "*E" at 2
    depths, one repeated layer) at TP2+SP: Megatron-Bridge's own Omni provider builds NemotronOmniModel
    around megatron-core's LLaVAModel (a CLIP ViT for RADIO, every other argument Bridge's), images in the
    microbatches; stock crashes; the overlay trains exactly the oracle's combined-slot pairs, none at an
    image slot, with the MTP loss and gradients of the language model run on the hand-built combined ids;
    mtp-multimodal and mtp-sp-scatter are needed with the rows that show why. A Bridge Omni provider in
    a Python file at CP2 verifies too and needs mtp-cp-loss-scale instead of mtp-sp-scatter; one that leaves
    ``language_model_type`` at its default is refused before any step, naming the field."""
    report = verification.verify(OMNI, tp=2, sp=True, engine=engine())
    assert report.ok and report.exit_code == 0 and report.packing == "none", report.text()
    built = report.built
    assert built["wrapper"] == "NemotronOmniModel around LLaVAModel" and built["model"] == "HybridModel"
    assert built["vision_model"] == "CLIPViTModel" and built["image_token_index"] == 18
    assert built["tokens_per_image"] == 4 and built["hybrid_layer_pattern"] == "ME*/*E/*E"
    assert {item["name"] for item in built["substituted"]} == CLIP_SUBSTITUTIONS
    settings = {item["field"]: item["set"] for item in built["provider_settings"]}
    # Bridge's Omni bridge drops the llm_config's MTP pattern: without it the model would have no MTP block
    assert settings["mtp_hybrid_override_pattern"] == "*E" and settings["sound_context_token_id"] == 27
    assert report.stock.error == "TypeError: '<' not supported between instances of 'NoneType' and 'int'"
    for case in (report.reference, report.overlay):
        judged_positions_hold(case)
    for depth in report.overlay.depths:
        assert depth.loss_relerr <= 1e-6 and depth.grad_relerr <= 1e-6
    assert report.overlay.grad_relerr["encoder"] <= 1e-6  # the vision tower and projector, through the MTP loss too
    needs = {need.fix: need for need in report.needs}
    assert set(needs) == {"mtp-multimodal", "mtp-sp-scatter", "mtp-loss-mask"}
    assert needs["mtp-multimodal"].case.error == report.stock.error
    assert needs["mtp-sp-scatter"].case.error.startswith("RuntimeError: Sizes of tensors must match")
    assert needs["mtp-loss-mask"].required_by == ("mtp-multimodal",)
    text = report.text()
    assert "LLaVAModel vision.vision_model_type: radio -> clip" in text and "not run: sound" in text
    assert "mtp-multimodal: without it, crash: TypeError" in text and "OK:" in text

    recipe = tmp_path / "omni_recipe.py"
    recipe.write_text(OMNI_PROVIDER)
    report = verification.verify(provider=f"{recipe}:provider", cp=2, engine=engine(), search=False)
    assert report.ok and report.layout == "CP2", report.text()
    judged_positions_hold(report.overlay)
    assert report.stock.error.startswith("TypeError: embedding(): argument 'indices'")
    assert {need.fix for need in report.needs} == {"mtp-multimodal", "mtp-cp-loss-scale", "mtp-loss-mask"}

    recipe.write_text(OMNI_PROVIDER.replace('language_model_type="nemotron6-moe", ', ""))
    with pytest.raises(ValueError, match=r"NemotronOmniModelProvider.language_model_type is '': LLaVAModel"):
        verification.verify(provider=f"{recipe}:provider", cp=2, engine=engine(), search=False)
