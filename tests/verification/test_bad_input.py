"""Bad input to ``mtp-overlay verify`` is a clear error naming the argument, exit 2, before any rank starts
(each case here would otherwise spawn the engine: a test that hangs or takes seconds has failed). ~2 s."""

import functools
import importlib
import json
import shutil
from pathlib import Path

import pytest

from mtp_overlay import cli, verification

CONFIG = Path(__file__).parent / "configs" / "nemotron_h_like"
OMNI = Path(__file__).parent / "configs" / "nemotron_omni_like"


class NoEngine:
    """An engine that fails the test if verify reaches it."""

    def request(self, message):
        raise AssertionError(f"verify started the engine for bad input: {message.get('op')}")

    def close(self):
        pass


@pytest.fixture(autouse=True)
def no_child_engine(monkeypatch):
    monkeypatch.setattr(verification, "_child", lambda *args: NoEngine())


def run(capsys, *arguments):
    code = cli.main(["verify", *arguments])
    return code, capsys.readouterr().err


def test_a_config_folder_without_config_json(tmp_path, capsys):
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and f"--hf-config {tmp_path}: the folder has no config.json" in err
    (tmp_path / "config.json").mkdir()
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and f"--hf-config {tmp_path}: the folder holds a config.json that is not a file" in err


def test_a_config_that_is_not_one(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2]")
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and "a config is a JSON object" in err
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert "no model_type" in run(capsys, "--hf-config", str(tmp_path / "config.json"))[1]


def test_a_layout_the_world_size_cannot_hold(capsys):
    code, err = run(capsys, "--hf-config", str(CONFIG), "--tp", "2", "--sp", "--cp", "2", "--world-size", "6")
    assert code == 2 and "--world-size 6 cannot hold TP2xCP2+SP" in err and "multiple of TP x CP x PP = 4" in err
    code, err = run(capsys, "--hf-config", str(CONFIG), "--tp", "4", "--sp")
    assert code == 2 and "--tp 4: the model's 2 query groups (key/value heads) do not split over 4" in err


def test_cp_that_does_not_divide_the_padded_lengths(capsys):
    code, err = run(capsys, "--hf-config", str(CONFIG), "--cp", "2", "--pad-multiple", "2")
    assert code == 2
    assert "--cp 2 cuts each sequence into 2·CP = 4 chunks, but --pad-multiple 2 pads sequence 0 (9 tokens) to 10" \
        in err
    code, err = run(capsys, "--hf-config", str(CONFIG), "--cp", "2", "--pad-multiple", "5", "--packing", "none")
    assert code == 2 and "--cp 2 cuts each row into 2·CP = 4 chunks" in err


def test_a_multimodal_config_of_another_family_names_what_verify_builds(tmp_path, capsys):
    values = json.loads((CONFIG / "config.json").read_text())
    values["vision_config"] = {"hidden_size": 1280}
    (tmp_path / "config.json").write_text(json.dumps(values))
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and "a multimodal config (vision_config) without llm_config" in err
    assert "Nemotron VL / Omni layout" in err and "megatron-core's LLaVAModel" in err


@pytest.mark.parametrize("flags, message", [
    (["--packing", "thd-padded"], "--packing thd-padded: a VL / Omni model is verified with BSHD rows"),
    (["--forward", "rl"], "--forward rl: a VL / Omni model is verified with labels"),
    (["--pp", "2"], "--pp 2: the test bed runs a VL / Omni model without pipeline stages"),
    (["--scatter-embedding", "on"], "--scatter-embedding: LLaVAModel builds its language model with"),
    (["--pad-multiple", "4"], "--pad-multiple: LLaVAModel pads the combined sequence"),
    (["--tp", "4", "--sp"], "--tp 4: the model's 2 query groups (key/value heads) do not split over 4"),
])
def test_a_vl_config_refuses_what_its_steps_cannot_be_naming_the_flag(capsys, flags, message):
    code, err = run(capsys, "--hf-config", str(OMNI), *flags)
    assert code == 2 and message in err, err


def test_images_in_the_data_of_a_config_without_a_vision_tower(tmp_path, capsys):
    sample = tmp_path / "sample.jsonl"
    sample.write_text('{"tokens": 12, "prompt": 3, "images": [4]}\n')
    code, err = run(capsys, "--hf-config", str(CONFIG), "--data", str(sample))
    assert code == 2 and f"--data {sample}: the sample has image placeholders, but the config has no vision" in err
    sample.write_text('{"tokens": 12, "prompt": 3, "images": [12]}\n')
    code, err = run(capsys, "--hf-config", str(OMNI), "--data", str(sample))
    assert code == 2 and f"--data {sample}:1: images must be a list of distinct positions in [0, 12)" in err


def test_a_layer_without_a_stand_in_and_a_config_without_mtp(tmp_path, capsys):
    values = json.loads((CONFIG / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "hybrid_override_pattern": "M*GE"}))
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and "no CPU stand-in for layer 'G' (gated delta net)" in err
    (tmp_path / "config.json").write_text(json.dumps({**values, "num_nextn_predict_layers": 0}))
    assert "give --mtp-num-layers N" in run(capsys, "--hf-config", str(tmp_path))[1]


def test_flags_that_do_not_go_together(tmp_path, capsys):
    assert "--sp (sequence parallelism) needs --tp > 1" in run(capsys, "--hf-config", str(CONFIG), "--sp")[1]
    assert "--mtp-mask scoped needs --forward rl" in run(capsys, "--hf-config", str(CONFIG), "--mtp-mask", "scoped",
                                                          "--forward", "sft")[1]
    code, err = run(capsys, "--provider", "no_colon_here")
    assert code == 2 and "--provider must be MODULE:NAME or FILE.py:NAME" in err
    assert f"no such file {tmp_path}/p.py" in run(capsys, "--provider", f"{tmp_path}/p.py:make")[1]
    with pytest.raises(SystemExit):  # argparse: one of the two sources, not both
        cli.main(["verify", "--hf-config", str(CONFIG), "--provider", "a:b"])


def test_data_sample_errors_name_the_line(tmp_path, capsys):
    sample = tmp_path / "sample.jsonl"
    sample.write_text('{"tokens": 12, "prompt": 3}\n{"tokens": -1}\n')
    code, err = run(capsys, "--hf-config", str(CONFIG), "--data", str(sample))
    assert code == 2 and f"--data {sample}:2: tokens must be a positive integer" in err


def test_the_api_takes_the_same_arguments_and_raises_the_same_errors(tmp_path):
    shutil.copy(CONFIG / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="--packing must be one of none, thd-padded, thd-real-lengths"):
        verification.verify(tmp_path, packing="thd")
    with pytest.raises(ValueError, match="give exactly one of --hf-config"):
        verification.verify()
    import mtp_overlay

    assert mtp_overlay.verify is verification.verify


def test_files_that_are_not_utf8_are_named_by_their_flag(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "nemotron_h", "name": "\xff"}')
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and f"--hf-config {tmp_path / 'config.json'}: not UTF-8 text (byte 0xff at offset 38)" in err
    sample = tmp_path / "sample.jsonl"
    sample.write_bytes(b'{"tokens": 12, "prompt": 3}\n\xfe\n')
    code, err = run(capsys, "--hf-config", str(CONFIG), "--data", str(sample))
    assert code == 2 and f"--data {sample}: not UTF-8 text (byte 0xfe at offset 28)" in err
    assert "codec" not in err and "Traceback" not in err


def test_a_hybrid_config_with_mtp_depth_and_no_mtp_layers_is_named(tmp_path, capsys):
    """The list form transformers 5 writes (``mtp_layers_block_type``), empty, and the string form, empty."""
    values = json.loads((CONFIG / "config.json").read_text())
    names = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    listed = {key: value for key, value in values.items() if not key.endswith("hybrid_override_pattern")}
    listed.update(layers_block_type=[names[s] for s in values["hybrid_override_pattern"]], mtp_layers_block_type=[])
    (tmp_path / "config.json").write_text(json.dumps(listed))
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and "num_nextn_predict_layers is 2, but its mtp_layers_block_type is []" in err, err
    (tmp_path / "config.json").write_text(json.dumps({**values, "mtp_hybrid_override_pattern": ""}))
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and "num_nextn_predict_layers is 2, but its mtp_hybrid_override_pattern is ''" in err, err


def test_zero_key_value_heads_is_refused_not_reshaped(tmp_path, capsys):
    values = json.loads((CONFIG / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "num_key_value_heads": 0}))
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and f"--hf-config {tmp_path}: the config's num_key_value_heads must be a positive integer, got 0" in err, err


def test_a_provider_file_with_a_syntax_error_is_named_with_its_line_before_any_rank(tmp_path, capsys):
    recipe = tmp_path / "f.py"
    recipe.write_text("import os\n\ndef provider():\n    return dict(a=1,\n\nx = 3\n")
    code, err = run(capsys, "--provider", f"{recipe}:provider")
    assert code == 2 and f"--provider {recipe}:provider: {recipe}:4: SyntaxError: '(' was never closed" in err, err
    recipe.write_bytes(b"name = '\xff'\n")
    code, err = run(capsys, "--provider", f"{recipe}:provider")
    assert code == 2 and f"{recipe}:1: SyntaxError" in err and "utf-8" in err.lower(), err


def test_a_provider_that_raises_is_named_with_the_flag_and_its_line(tmp_path):
    """The engine runs the user's provider code in its ranks (it imports Megatron-Bridge): what it raises
    comes back as the engine's named error (a PlanError: the product prints its message, exit 2) with the
    user's file and line, not the engine's traceback. The loader itself, without ranks or Bridge."""
    from mtp_overlay.bed.engines.verify_model import PlanError, users_code

    recipe = tmp_path / "f.py"
    recipe.write_text("def helper(size):\n    return 1 // size\n\n\ndef provider():\n    return helper(0)\n")
    namespace = {}
    exec(compile(recipe.read_text(), str(recipe), "exec"), namespace)
    with pytest.raises(PlanError) as raised:
        users_code(f"{recipe}:provider", "provider()", namespace["provider"])
    message = str(raised.value)
    assert message == (f"--provider {recipe}:provider: provider() raised ZeroDivisionError: integer division or "
                       f"modulo by zero (at {recipe}:2)")
    with pytest.raises(ValueError, match=f"^--provider {recipe}:provider: provider\\(\\) raised"):
        verification._raise_plan_error({"error": message})  # named as it is, not as "cannot build"
    # raised before any of the user's code ran: no line of the engine's (or importlib's) is named as theirs
    with pytest.raises(PlanError) as raised:
        users_code(f"{recipe}:helper", "helper()", namespace["helper"])
    assert str(raised.value).endswith("missing 1 required positional argument: 'size'")
    with pytest.raises(PlanError) as raised:
        users_code("no_such_module:provider", "importing no_such_module",
                   functools.partial(importlib.import_module, "no_such_module"))
    assert str(raised.value).endswith("No module named 'no_such_module'")


def test_etp_is_named_wherever_it_is_set():
    from mtp_overlay.verification.layout import Layout

    assert Layout(etp=2).name == "TP1xETP2" and Layout(etp=2).world_size == 2
    assert Layout(tp=2, ep=2, etp=1, sp=True).name == "TP2xEP2xETP1+SP"
    assert Layout(tp=2, sp=True).name == "TP2+SP"
