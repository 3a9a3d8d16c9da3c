"""`mtp-overlay new-fix` in a copy of the checkout: a scaffolded fix is in `status`, in the contract
test (which fails it until its probe is written) and in the support matrix's list of fixes, without
any other edit; bad input and an installed copy are refused before anything is written."""

import json
import textwrap

import pytest
from test_generated import copy_of_the_checkout, run_in

from mtp_overlay import generated, scaffold

TARGET = """
class Target:
    def compute(self, x):
        return x + 1
"""

WRITTEN = '''"""throwaway-done: a scaffolded fix whose probe and wrapper are written: Target.compute doubled."""

from ...contract import needed
from .. import Fix
from .declaration import DECLARATION


class ThrowawayDoneFix(Fix):
    declaration = DECLARATION

    def probe(self, module):
        return needed("Target.compute adds one")

    def wrappers(self, module):
        def doubled(wrapped, instance, args, kwargs):
            return 2 * wrapped(*args, **kwargs)

        yield module.Target, "compute", doubled


FIX = ThrowawayDoneFix()
'''

SUPPORT_LIST = ("import json, sys; sys.path.insert(0, 'scripts'); import support_matrix; "
                "print(json.dumps(support_matrix.fixes_by_distribution()))")
STATUS = "import json, mtp_overlay; print(json.dumps({r.name: [r.state, r.distribution] for r in mtp_overlay.status()}))"


@pytest.mark.slow
def test_a_scaffolded_fix_is_in_status_the_contract_test_and_the_support_matrix(tmp_path):
    copy = copy_of_the_checkout(tmp_path, ("mtp_overlay", "patches", "hooks", "scripts", "tests", "README.md", "pyproject.toml"))
    for name in ("stub", "done"):  # mtp-overlay: a distribution installed here; the targets: modules of the copy
        (copy / f"throwaway_{name}_target.py").write_text(TARGET)
        made = run_in(copy, "-m", "mtp_overlay.cli", "new-fix", f"throwaway-{name}", "--distribution", "mtp-overlay",
                      "--target", f"module=throwaway_{name}_target")
        assert made.returncode == 0, made.stderr
        assert "wrote mtp_overlay/fixes/throwaway_" in made.stdout and "wrote mtp_overlay/table.py" in made.stdout
    (copy / "mtp_overlay" / "fixes" / "throwaway_done" / "__init__.py").write_text(WRITTEN)

    status = json.loads(run_in(copy, "-c", STATUS).stdout)
    assert status["throwaway-stub"] == status["throwaway-done"] == ["pending", "mtp-overlay"]
    assert json.loads(run_in(copy, "-c", SUPPORT_LIST).stdout)["mtp-overlay"] == ["throwaway-done", "throwaway-stub"]
    assert run_in(copy, "scripts/generate.py", "--check").returncode == 0  # the scaffold regenerated everything

    contract = run_in(copy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/contract/test_fix_contract.py",
                      "-k", "throwaway", timeout=900)
    summary = contract.stdout.strip().splitlines()[-1]
    assert "1 failed, 1 passed" in summary, contract.stdout[-3000:]
    assert "FAILED tests/contract/test_fix_contract.py::test_fix_lifecycle_on_its_real_targets[throwaway-stub]" in contract.stdout
    assert "has no probe yet: write it in mtp_overlay/fixes/throwaway_stub/__init__.py" in contract.stdout


def test_new_fix_refuses_bad_input_and_a_taken_id_before_writing(tmp_path, monkeypatch):
    before = generated.stale()
    cases = [
        (("Bad_Id", "megatron-core", [("model", "a.b")]), "fix id must be lowercase words"),
        (("new-one", "not a name", [("model", "a.b")]), "--distribution must be a distribution name"),
        (("new-one", "megatron-core", []), "give at least one --target ROLE=MODULE"),
        (("new-one", "megatron-core", [("Model", "a.b")]), "targets must be a non-empty mapping of role"),
        (("new-one", "megatron-core", [("m", "a.b"), ("m", "a.c")]), "each role once"),
        (("mtp-sp-scatter", "megatron-core", [("mtp", "a.b")]), "fix 'mtp-sp-scatter' exists already"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            scaffold.new_fix(*arguments)
    with pytest.raises(ValueError, match="--target must be ROLE=MODULE"):
        scaffold.target_argument("model")
    assert scaffold.target_argument(" model = a.b ") == ("model", "a.b")
    assert not (generated.PACKAGE / "fixes" / "new_one").exists() and generated.stale() == before

    monkeypatch.setattr(generated, "ROOT", tmp_path)  # an installed copy: no checkout around the package
    with pytest.raises(ValueError, match="new-fix writes into a source checkout of mtp-overlay"):
        scaffold.new_fix("new-one", "megatron-core", [("model", "a.b")])


def test_the_scaffold_writes_what_every_fix_has(tmp_path):
    """The five files, and a module whose probe and wrappers refuse until written."""
    copy = copy_of_the_checkout(tmp_path, ("mtp_overlay", "patches", "hooks", "scripts", "tests", "README.md", "pyproject.toml"))
    made = run_in(copy, "-m", "mtp_overlay.cli", "new-fix", "bridge-thing", "--distribution", "megatron-bridge",
                  "--target", "bridge=megatron.bridge.models.gpt_provider", "--summary", "Fix the bridge's thing.")
    assert made.returncode == 0, made.stderr
    folder = copy / "mtp_overlay" / "fixes" / "bridge_thing"
    for path in (folder / "declaration.py", folder / "__init__.py", folder / "README.md",
                 copy / "tests" / "fixes" / "bridge_thing" / "test_bridge_thing.py",
                 copy / "mtp_overlay" / "bed" / "fixes" / "bridge_thing.py"):
        assert f"wrote {path.relative_to(copy)}" in made.stdout
    assert (folder / "declaration.py").read_text().startswith('"""bridge-thing: what it targets')
    readme = (folder / "README.md").read_text()
    assert readme.startswith(generated.FACTS_BEGIN) and "Fix the bridge's thing." in readme and "## Why" in readme
    probe = textwrap.dedent("""
        import json as target  # the stubs refuse whatever module they are handed
        from mtp_overlay.fixes.bridge_thing import FIX
        for method in (FIX.probe, lambda m: list(FIX.wrappers(m))):
            try:
                method(target)
            except NotImplementedError as exc:
                print(exc)
        """)
    said = run_in(copy, "-c", probe).stdout.splitlines()
    assert said == ["fix 'bridge-thing' has no probe yet: write it in mtp_overlay/fixes/bridge_thing/__init__.py",
                    "fix 'bridge-thing' has no wrappers yet: write them in mtp_overlay/fixes/bridge_thing/__init__.py"]
    again = run_in(copy, "-m", "mtp_overlay.cli", "new-fix", "bridge-thing", "--distribution", "megatron-bridge",
                   "--target", "bridge=megatron.bridge.models.gpt_provider")
    assert again.returncode == 2 and "exists already" in again.stderr
