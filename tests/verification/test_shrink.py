"""verify's shrink keeps the shape: every structural choice of the config survives, every size it shrinks
still satisfies what megatron-core asserts at build time for the layout, and a layout the real model
cannot run is refused before anything starts, naming the flag. Pure Python, no ranks (~2 s)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.verification.layout import Layout
from mtp_overlay.verification.shrink import distinct_runs, shrink

NEMOTRON_H = json.loads((Path(__file__).parent / "configs" / "nemotron_h_like" / "config.json").read_text())
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=36, vocab_size=151936,
             layer_types=["full_attention"] * 36, tie_word_embeddings=False, num_nextn_predict_layers=1)


def megatron_refusals(values, layout):
    """What megatron-core would assert about a (shrunk) NemotronH/Qwen3 config at ``layout``, written from
    its checks (transformer_config.py:1323-1339, ssm/mamba_mixer.py:260-268,
    ssm/mamba_context_parallel.py:106-131, the expert-parallel split), independently of the shrink."""
    found = []
    heads, groups = values["num_attention_heads"], values["num_key_value_heads"]
    if heads % layout.tp or groups % layout.tp or heads % groups:
        found.append("attention heads")
    experts = values.get("n_routed_experts")
    if experts and (experts % layout.ep or values["num_experts_per_tok"] > experts):
        found.append("experts")
    mamba, mamba_groups = values.get("mamba_num_heads"), values.get("n_groups")
    if mamba:
        local_heads, local_groups = mamba // layout.tp, mamba_groups // layout.tp
        if mamba % layout.tp or mamba_groups % layout.tp or mamba % mamba_groups or local_heads % layout.cp:
            found.append("mamba heads")
        elif (local_groups < layout.cp and layout.cp % local_groups) or \
                (local_groups >= layout.cp and local_groups % layout.cp):
            found.append("mamba groups")
    return found


def test_the_nemotron_h_like_config_keeps_its_shape_at_tp2_sp():
    shrunk = shrink(NEMOTRON_H, Layout(tp=2, sp=True))
    values, kept = shrunk.values, dict(shrunk.kept)
    assert set(values["hybrid_override_pattern"]) == set(NEMOTRON_H["hybrid_override_pattern"])  # every layer kind
    assert values["hybrid_override_pattern"] == distinct_runs(NEMOTRON_H["hybrid_override_pattern"])
    for key in ("mtp_hybrid_override_pattern", "num_nextn_predict_layers", "mtp_use_repeated_layer",
                "num_experts_per_tok", "n_shared_experts", "tie_word_embeddings", "conv_kernel", "mlp_hidden_act"):
        assert values[key] == NEMOTRON_H[key], key
    ratio = NEMOTRON_H["num_attention_heads"] // NEMOTRON_H["num_key_value_heads"]
    assert values["num_attention_heads"] // values["num_key_value_heads"] == ratio
    assert kept["GQA ratio (heads per query group)"] == ratio and kept["MoE top-k"] == NEMOTRON_H["num_experts_per_tok"]
    assert values["hidden_size"] <= 64 and values["vocab_size"] <= 128 and values["chunk_size"] <= 8
    assert shrunk.mtp_depth == 2 and shrunk.repeated_layer is True and shrunk.mtp_pattern == "*E"
    assert megatron_refusals(values, Layout(tp=2, sp=True)) == []
    assert {change.key for change in shrunk.changes} >= {"hidden_size", "n_routed_experts", "mamba_num_heads"}


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["nemotron_h", "qwen3"]))
def test_a_layout_the_real_model_runs_is_run_by_the_shrunk_one(tp, cp, ep, family):
    """Whenever the real config can run the layout (megatron-core's checks pass on it), the shrunk one can
    too, with the same layer kinds, GQA ratio, top-k and MTP settings; otherwise the shrink refuses it."""
    config = NEMOTRON_H if family == "nemotron_h" else QWEN3
    layout = Layout(tp=tp, cp=cp, ep=ep if family == "nemotron_h" else 1, sp=tp > 1)
    if megatron_refusals(config, layout):
        with pytest.raises(ValueError, match=r"--(tp|cp|ep) \d"):
            shrink(config, layout)
        return
    shrunk = shrink(config, layout)
    assert megatron_refusals(shrunk.values, layout) == []
    assert shrunk.values["num_attention_heads"] * config["num_key_value_heads"] == \
        config["num_attention_heads"] * shrunk.values["num_key_value_heads"]
    assert shrunk.values.get("num_experts_per_tok") == config.get("num_experts_per_tok")
    assert shrunk.values["num_nextn_predict_layers"] == config["num_nextn_predict_layers"]
    for smaller in layout.smaller():  # the search reruns the overlay on these: they must build too
        assert megatron_refusals(shrunk.values, smaller) == [], smaller


def test_a_gpt_config_keeps_one_run_of_its_layers_and_its_layer_kinds_in_step():
    shrunk = shrink(QWEN3, Layout(), layers="runs")
    assert shrunk.values["num_hidden_layers"] == 2 and shrunk.values["layer_types"] == ["full_attention"] * 2
    assert shrink(QWEN3, Layout(), layers="all").values["num_hidden_layers"] == 36
    assert shrink(QWEN3, Layout()).values["num_hidden_layers"] == 2  # auto: 36 > 16 layers
    assert shrunk.pattern is None and shrunk.mtp_depth == 1


@pytest.mark.parametrize("pattern, runs", [
    ("MEMEM*EMEMEM*E-", "ME*-"),
    ("MM-MM-M*", "MM-M*"),
    ("MMMM*", "MM*"),
    ("M*E-", "M*E-"),
])
def test_distinct_runs(pattern, runs):
    """Each distinct run of one layer kind (at most two long) once, in order of first appearance."""
    assert distinct_runs(pattern) == runs


def test_the_pattern_as_a_list_of_layer_names_is_read_and_written_as_such():
    listed = dict(NEMOTRON_H)
    names = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    listed["layers_block_type"] = [names[s] for s in listed.pop("hybrid_override_pattern")]
    listed["mtp_layers_block_type"] = [names[s] for s in listed.pop("mtp_hybrid_override_pattern")]
    shrunk = shrink(listed, Layout())
    runs = distinct_runs(NEMOTRON_H["hybrid_override_pattern"])
    assert shrunk.values["layers_block_type"] == [names[s] for s in runs]
    assert shrunk.mtp_pattern == "*E" and "hybrid_override_pattern" not in shrunk.values


def test_overrides_and_the_provider_key_space():
    provider = dict(hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=2048, num_layers=6,
                    vocab_size=32000, mtp_num_layers=None, share_embeddings_and_output_weights=True)
    shrunk = shrink(provider, Layout(cp=2), keyspace="provider", mtp_num_layers=2, repeated_layer=True,
                    scatter_embedding_sequence_parallel=False)
    values = shrunk.values
    assert (values["mtp_num_layers"], values["mtp_use_repeated_layer"]) == (2, True)
    assert values["scatter_embedding_sequence_parallel"] is False and values["kv_channels"] == 16
    assert values["num_attention_heads"] == 2 * values["num_query_groups"]
    assert values["share_embeddings_and_output_weights"] is True


@pytest.mark.parametrize("change, layout, message", [
    (dict(num_nextn_predict_layers=0), Layout(), "no MTP layers .*--mtp-num-layers"),
    (dict(hybrid_override_pattern="MGM*"), Layout(), "no CPU stand-in for layer 'G' \\(gated delta net\\)"),
    (dict(kv_lora_rank=512), Layout(), "no CPU stand-in for multi-latent attention"),
    ({}, Layout(tp=4), "--tp 4: the model's 2 query groups"),
    ({}, Layout(ep=3), "--ep 3: the model's 128 experts"),
    ({}, Layout(tp=2), "--tp 2 with MoE layers needs --sp"),
    (dict(n_groups=4, num_key_value_heads=8), Layout(tp=8, sp=True), "--tp 8: the model.s 64 Mamba heads in 4 groups"),
    (dict(mamba_num_heads=8, n_groups=8), Layout(cp=16), "--cp 16: the model.s 8 Mamba heads"),
])
def test_what_cannot_run_is_refused_naming_it(change, layout, message):
    with pytest.raises(ValueError, match=message):
        shrink({**NEMOTRON_H, **change}, layout)


def test_layout_errors_name_the_flag():
    with pytest.raises(ValueError, match="--sp .*needs --tp > 1"):
        Layout(sp=True)
    with pytest.raises(ValueError, match="--world-size 6 cannot hold TP4: .*multiple of TP x CP x PP = 4"):
        Layout(tp=4, world=6)
    with pytest.raises(ValueError, match="--world-size 2 cannot hold TP2xEP2xETP2.*ETP x EP x PP = 4"):
        Layout(tp=2, ep=2, etp=2, sp=True, world=2)
    with pytest.raises(ValueError, match="--cp must be a positive integer"):
        Layout(cp=0)
    assert Layout(tp=2, ep=2, etp=1, sp=True).world_size == 2 and Layout(ep=2).world_size == 2
    assert [small.name for small in Layout(tp=2, cp=2, sp=True).smaller()] == ["TP1", "CP2", "TP2+SP"]


def test_what_verify_does_not_run_is_said():
    from mtp_overlay.verification import layout_to_run

    run, not_run = layout_to_run(Layout(tp=8, cp=4, sp=True), 8)
    assert run.name == "TP2xCP4+SP"
    assert "TP8xCP4+SP: 32 ranks, above --max-ranks 8; TP2xCP4+SP ran instead" in not_run[0]
    assert layout_to_run(Layout(tp=2, pp=2, sp=True, world=8), 8) == (Layout(tp=2, pp=2, sp=True, world=8), [])
    assert layout_to_run(Layout(tp=2, cp=2, sp=True), 8) == (Layout(tp=2, cp=2, sp=True), [])


def test_pipeline_stages_get_a_layer_each():
    shrunk = shrink(NEMOTRON_H, Layout(pp=4))
    assert shrunk.pattern == "ME*ME*" and shrunk.values["hybrid_override_pattern"] == "ME*ME*"
    assert shrink(QWEN3, Layout(pp=4)).values["num_hidden_layers"] == 4
    staged = dict(NEMOTRON_H, hybrid_override_pattern="M*E|-M*")
    assert shrink(staged, Layout(), layers="all").pattern == "M*E-M*"  # the stage marks are the engine's to place
    assert [small.name for small in Layout(tp=2, pp=2, sp=True).smaller()] == ["TP1", "PP2", "TP2+SP"]
