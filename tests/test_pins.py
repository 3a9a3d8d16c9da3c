"""The pins helper (tests/pins.py): scripts/constraints.txt is what the venv holds, and no test or
test-bed module spells a pinned version of the stack itself."""

import re
import sysconfig
from importlib import metadata
from pathlib import Path

import pins
import pytest

ROOT = Path(__file__).resolve().parents[1]
STACK = {
    "megatron-core": pins.MEGATRON_CORE, "megatron-bridge": pins.MEGATRON_BRIDGE, "vllm": pins.VLLM,
    "transformers": pins.TRANSFORMERS, "ray": pins.RAY, "torch": pins.TORCH,
}
# where a pin must not be spelled out: the tests and the test bed (tests/pins.py reads it from the file)
SEARCHED = ("tests", "mtp_overlay/bed", "mtp_overlay/upstream_tests")


def test_the_venv_holds_what_the_constraints_pin():
    """Every pinned distribution that is installed has its pinned version (a venv built by scripts/setup.sh
    from the file); the stack the tests name is installed. Only the venv's own site-packages is read: a
    package's vendored copies (setuptools/_vendor holds packaging's dist-info) join sys.path once that
    package is imported, and are not what the venv installed."""
    site = [sysconfig.get_paths()["purelib"]]
    installed = {pins.normalized(dist.metadata["Name"]): dist.version for dist in metadata.distributions(path=site)}
    assert {name: installed.get(name) for name in STACK} == STACK
    wrong = {name: (version, installed[name]) for name, version in pins.PINS.items()
             if name in installed and installed[name] != version}
    assert wrong == {}, "installed versions differ from scripts/constraints.txt (pinned, installed)"


def test_a_pin_is_found_by_any_spelling_of_its_name_and_a_missing_one_is_named():
    assert pins.pinned("Megatron_Core") == pins.pinned("megatron.core") == pins.MEGATRON_CORE
    with pytest.raises(KeyError, match="'no-such-dist' is not pinned in .*constraints.txt"):
        pins.pinned("no-such-dist")


def test_a_line_that_is_not_a_pin_is_refused_with_its_place(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# comment\nwrapt==1.2.3  # why\n\ntorch>=2\n")
    with pytest.raises(ValueError, match=r"constraints.txt:4: expected a 'name==version' pin, got 'torch>=2'"):
        pins.read(constraints)
    constraints.write_text("# comment\nWrapt==1.2.3  # why\n")
    assert pins.read(constraints) == {"wrapt": "1.2.3"}


def test_no_test_or_test_bed_module_spells_a_pinned_version():
    """Bumping a pin is one edit of scripts/constraints.txt: the stack's versions appear nowhere else in
    the tests and the test bed (releases installed side by side on purpose are other versions)."""
    spelled = re.compile("|".join(rf"(?<![\w.]){re.escape(version)}(?![\w.]*\d)" for version in STACK.values()))
    assert spelled.search(f'site_of("{pins.MEGATRON_CORE}", tmp_path)') and spelled.search(f"vLLM {pins.VLLM}.")
    assert not spelled.search(f"1{pins.MEGATRON_CORE}") and not spelled.search(f"{pins.MEGATRON_CORE}1")
    found = []
    for folder in SEARCHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".txt", ".json", ".toml", ".cfg", ".ini"):
                for number, line in enumerate(path.read_text().splitlines(), 1):
                    if spelled.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
