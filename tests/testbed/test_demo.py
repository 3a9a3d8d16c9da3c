"""The main job (`mtp-overlay demo`): what a newcomer reads first shows each fix off and on, and the
ranks' own warnings stay out of it (in the log file it names)."""

from mtp_overlay.bed.engines import demo


def test_demo_shows_each_fix_off_and_on_and_keeps_rank_noise_in_its_log(tmp_path):
    lines = []
    log = tmp_path / "ranks.log"
    assert demo.main(out=lines.append, log=log) == 0
    text = "\n".join(lines)
    assert "fix off: CRASH: RuntimeError: Sizes of tensors must match" in text and "(matches TP1)" in text
    assert "(only the response tokens)" in text and "(prompts and the filtered sample too)" in text
    assert "pairs wrong or missed)" in text and "(all right)" in text
    assert "fix off: CRASH: TypeError: embedding(): argument 'indices'" in text
    assert "(exactly those, no image slot)" in text
    off, on = (line for line in lines if "router is_mtp_layer=" in line)
    assert "is_mtp_layer=False, its aux-loss gradient 2.000x" in off and "logged in slot [2]" in off
    assert "is_mtp_layer=True, its aux-loss gradient 1.000x" in on and "logged in slot [3]" in on
    assert "DEPRECATED" not in text and "W1201" not in text
    assert "GPTModel IS DEPRECATED" in log.read_text()  # where the ranks' output went
