"""verify on the configs users have: folders the installed transformers saves (``save_pretrained``), every
family verify builds, up to the plan the engine gets, read back by the engine's own loader
(``bed.engines.verify_model.hf_config``, transformers' ``AutoConfig.from_pretrained``). No ranks (~10 s: transformers'
config classes); Bridge's providers of the same plans are built in one rank (slow), and the NemotronH folder
runs at TP2+SP through Megatron's step in test_verify_runs.py."""

import math

import pytest
from saved_by_transformers import nemotron_h, nemotron_omni, saved

from mtp_overlay import cli, verification
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed


class Planned(Exception):
    """What `PlanOnly` raises with the plan verify would run."""


class PlanOnly:
    """An engine that stops verify at its first request, with the plan."""

    def request(self, message):
        raise Planned(message["plan"])

    def close(self):
        pass


def qwen3(folder):
    from transformers import Qwen3Config

    return saved(Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=256, num_attention_heads=6,
                             num_key_value_heads=2, head_dim=32, intermediate_size=512, num_hidden_layers=3,
                             num_nextn_predict_layers=1), folder)


def qwen3_moe(folder):
    from transformers import Qwen3MoeConfig

    return saved(Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                                num_nextn_predict_layers=2), folder)


# family -> (folder maker, verify's arguments, the config class the engine reads, the shrunk pattern / MTP pattern)
FAMILIES = {
    "nemotron_h, MTP *E at 2 depths": (nemotron_h, dict(tp=2, sp=True, packing="thd-real-lengths"), "NemotronHConfig",
                                       ("ME*", "*E")),
    "nemotron_h M*E-, MTP *- at 1 depth": (
        lambda folder: nemotron_h(folder, hybrid_override_pattern="M*E-M*E-", mtp_hybrid_override_pattern="*-",
                                  num_nextn_predict_layers=1, mtp_use_repeated_layer=False),
        dict(cp=2), "NemotronHConfig", ("M*E-M*E-", "*-")),
    "nemotron omni": (nemotron_omni, dict(tp=2, sp=True), "NemotronHConfig", ("ME*", "*E")),
    "qwen3": (qwen3, dict(tp=2), "Qwen3Config", (None, None)),
    "qwen3 moe": (qwen3_moe, dict(ep=2), "Qwen3MoeConfig", (None, None)),
}


def planned(folder, **arguments):
    with pytest.raises(Planned) as stopped:
        verification.verify(folder, engine=PlanOnly(), **arguments)
    return stopped.value.args[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_config_of_every_family_is_planned_and_read_back_by_the_engines_loader(tmp_path, family):
    """verify takes the folder as transformers saved it; the engine's loader reads the shrunk config back as
    the family's transformers class, with the pattern, the MTP depth and pattern verify planned, and
    transformers' own encoding of inf decoded (the loader of ``AutoConfig.for_model(type, **json)`` refused
    NemotronH's ``time_step_limit``: shown here on the same plan)."""
    from transformers import AutoConfig

    from mtp_overlay.bed.engines.verify_model import hf_config

    make, arguments, kind, (pattern, mtp_pattern) = FAMILIES[family]
    plan = planned(make(tmp_path / "model"), **arguments)
    values = plan["model"]["config"]
    config = hf_config(values)
    language = getattr(config, "llm_config", config)
    llm_values = values.get("llm_config", values)
    assert type(language).__name__ == kind
    assert language.num_nextn_predict_layers == llm_values["num_nextn_predict_layers"] >= 1
    assert language.hidden_size == 64 and language.vocab_size == 128
    if pattern is not None:
        assert (language.hybrid_override_pattern, language.mtp_hybrid_override_pattern) == (pattern, mtp_pattern)
        assert list(language.time_step_limit) == [0.0, math.inf]
        assert llm_values["time_step_limit"] == [0.0, {"__float__": "Infinity"}]  # as the folder has it
        with pytest.raises(Exception, match="time_step_limit"):
            AutoConfig.for_model(llm_values["model_type"], **{k: v for k, v in llm_values.items() if k != "model_type"})


def test_a_saved_deepseek_v3_config_is_refused_naming_what_has_no_stand_in(tmp_path, capsys):
    from transformers import DeepseekV3Config

    folder = saved(DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=1), tmp_path)
    code = cli.main(["verify", "--hf-config", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "no CPU stand-in for multi-latent attention (MLA) (kv_lora_rank=512)" in err, err


def providers_of(plans):
    """Rank worker: per plan, what Megatron-Bridge's provider of the engine's loader's config says."""
    from mtp_overlay.bed.engines.verify_model import check_buildable, family, provided

    found = []
    for plan in plans:
        provider = provided(plan["model"])[0]
        check_buildable(provider)
        found.append(dict(provider=type(provider).__name__, family=family(provider),
                          mtp_num_layers=provider.mtp_num_layers, experts=provider.num_moe_experts,
                          pattern=getattr(provider, "hybrid_layer_pattern", None),
                          mtp_pattern=getattr(provider, "mtp_hybrid_override_pattern", None)))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)
def test_bridge_builds_the_provider_of_every_saved_familys_plan(tmp_path):
    """The same plans through the engine's ``provided`` in a rank (it imports Megatron-Bridge): each family's
    provider, with the planned MTP depth, patterns and experts; the Omni provider with the MTP pattern of
    the llm_config's ``mtp_layers_block_type`` (Bridge's Omni bridge maps none: without it no MTP block)."""
    from mtp_overlay.bed.runtime.launcher import run_ranks_checked

    plans = [planned(make(tmp_path / str(index)), **arguments)
             for index, (make, arguments, _, _) in enumerate(FAMILIES.values())]
    found = run_ranks_checked(providers_of, 1, args=(plans,), fixes=[], timeout=600)[0]
    assert [(f["provider"], f["family"]) for f in found] == [
        ("HybridModelProvider", "hybrid"), ("HybridModelProvider", "hybrid"),
        ("NemotronOmniModelProvider", "multimodal"), ("GPTModelProvider", "gpt"), ("GPTModelProvider", "gpt")]
    for plan, built, (_, _, _, patterns) in zip(plans, found, FAMILIES.values()):
        values = plan["model"]["config"].get("llm_config", plan["model"]["config"])
        experts = next((values[key] for key in ("n_routed_experts", "num_local_experts") if key in values), None)
        assert (built["pattern"], built["mtp_pattern"]) == patterns
        assert (built["mtp_num_layers"], built["experts"]) == (values["num_nextn_predict_layers"], experts)
