"""The main job (`mtp-overlay demo`): what a newcomer reads first shows each fix off and on, and the
ranks' own warnings stay out of it (in the log file it names)."""

from mtp_overlay.testing import demo


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
    assert "DEPRECATED" not in text and "W1201" not in text
    assert "GPTModel IS DEPRECATED" in log.read_text()  # where the ranks' output went
