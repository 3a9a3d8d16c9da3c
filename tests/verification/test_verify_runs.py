"""``mtp_overlay.verify`` on real runs: the test bed's engine in this process (`testing.verify.Engine`, the
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

from mtp_overlay import verification
from mtp_overlay.testing.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.verification import data

CONFIG = Path(__file__).parent / "configs" / "nemotron_h_like"
needs_bridge = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)


def engine(lines=None):
    from mtp_overlay.testing.verify import Engine

    return Engine(2, progress=(lines.append if lines is not None else None))


@pytest.mark.parametrize("packing", verification.PACKINGS)
def test_the_engines_microbatch_holds_the_products_sequences_where_its_slot_map_says(packing):
    """Every slot the engine's slot map puts at (sequence, position) holds that token, its label and the
    mask of the oracle's convention; every other slot is padding (token 0, masks 0)."""
    from mtp_overlay.testing.verify import microbatch

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
    from mtp_overlay.testing.verify import staged_pattern

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
    thd-real-lengths`` with ``scatter_embedding_sequence_parallel: false`` in the config (Nemotron
    VL/Omni's language model): stock crashes; the overlay equals both references (exit 0); the fixes it
    needs are named with the rows that show why."""
    values = json.loads((CONFIG / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "scatter_embedding_sequence_parallel": False}))
    lines = []
    report = verification.verify(tmp_path, tp=2, sp=True, cp=1, packing="thd-real-lengths", engine=engine(lines),
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
    assert any("through Megatron's own step" in line for line in lines)


@pytest.mark.slow
@needs_bridge
def test_every_family_the_test_bed_builds_verifies_and_what_it_cannot_build_is_named(tmp_path):
    """Qwen3 through Bridge (a Hugging Face config, CP2), GPT (a provider in a Python file, TP1) and
    NemotronH with M, E and * layers (the previous test) verify; a family Bridge cannot build is a
    ValueError naming Bridge's refusal."""
    from transformers import Qwen3Config

    qwen3 = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=64, num_hidden_layers=28,
                        vocab_size=151936, num_nextn_predict_layers=1, tie_word_embeddings=True).to_dict()
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(qwen3))
    report = verification.verify(tmp_path / "qwen3", cp=2, packing="thd-padded", engine=engine(), search=False)
    assert report.ok and report.built["model"] == "GPTModel", report.text()
    assert report.built["share_embeddings_and_output_weights"] is True
    assert [need.fix for need in report.needs] == ["mtp-cp-loss-scale"]

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
