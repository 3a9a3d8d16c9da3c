"""Bad input to ``mtp-overlay verify`` is a clear error naming the argument, exit 2, before any rank starts
(each case here would otherwise spawn the engine: a test that hangs or takes seconds has failed). ~2 s."""

import json
import shutil
from pathlib import Path

import pytest

from mtp_overlay import cli, verification

CONFIG = Path(__file__).parent / "configs" / "nemotron_h_like"


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


def test_a_multimodal_config_says_what_it_waits_for(tmp_path, capsys):
    values = json.loads((CONFIG / "config.json").read_text())
    values["vision_config"] = {"hidden_size": 1280}
    (tmp_path / "config.json").write_text(json.dumps(values))
    code, err = run(capsys, "--hf-config", str(tmp_path))
    assert code == 2 and "a multimodal config (vision_config)" in err and "multimodal MTP fix" in err


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
