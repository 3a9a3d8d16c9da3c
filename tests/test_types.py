"""The typed public API: mypy (pinned in scripts/constraints.txt, installed by scripts/setup.sh) passes
on it under pyproject.toml's ``[tool.mypy]`` strictness (every function fully annotated, Any returns
refused), and the hints mean something to a user's type checker: a misuse is an error.

By hand: ``python -m mypy --config-file pyproject.toml mtp_overlay/__init__.py mtp_overlay/fixes ...`` (the
paths of ``TYPED``) from the repository root.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the modules whose annotations are checked (paths from the repository root): the product, every module of
# it but the test bed (mtp_overlay/bed) and the shipped upstream tests
TYPED = ("mtp_overlay/__init__.py", "mtp_overlay/calls.py", "mtp_overlay/cli.py", "mtp_overlay/contract.py",
         "mtp_overlay/declarations.py", "mtp_overlay/generated.py", "mtp_overlay/hooks.py", "mtp_overlay/lifecycle.py",
         "mtp_overlay/registry.py", "mtp_overlay/scaffold.py", "mtp_overlay/startup.py", "mtp_overlay/table.py",
         "mtp_overlay/fixes", "mtp_overlay/mtp", "mtp_overlay/patching", "mtp_overlay/verification")
CACHE = ROOT / ".cache" / "mypy"  # git-ignored: a second run reads torch's analysis from it

MISUSE = """
import torch

import mtp_overlay
from mtp_overlay.mtp import PackedBatch, fingerprint, pack_sequences, rollout_mtp_metrics

packed: PackedBatch = pack_sequences(torch.zeros(2, 4, dtype=torch.long), [3, 4], pad_multiple="2")
digests = fingerprint([("w", torch.ones(2))])
shape: str = digests["w"].shape
rate = rollout_mtp_metrics([]) + 1
try:
    mtp_overlay.install()
except mtp_overlay.OverlayError as exc:
    print(exc)
"""
UNTYPED = """
def helper(value):
    return value
"""


def mypy(*paths):
    """``python -m mypy PATHS`` with the repository's config, from the repository root (this checkout's
    ``mtp_overlay``, not an installed one, answers imports)."""
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(CACHE), *paths]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)


def test_the_typed_modules_pass_mypy():
    result = mypy(*TYPED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found")


def test_every_product_module_is_checked():
    """A new product module is checked from its first commit: only the test bed and the shipped upstream
    tests lie outside ``TYPED``."""
    unchecked = [path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "mtp_overlay").rglob("*.py"))
                 if path.relative_to(ROOT).parts[1] not in ("bed", "upstream_tests")
                 and not any(path.relative_to(ROOT).as_posix() == typed or
                             path.relative_to(ROOT).as_posix().startswith(typed + "/") for typed in TYPED)]
    assert unchecked == []


def test_mypy_refuses_a_misuse_of_the_api_and_an_unannotated_function(tmp_path):
    """The same run under the same config: what a wrong call or an untyped def costs. Without the hints
    the misuse would pass (every argument Any); without the config the untyped def would."""
    (tmp_path / "user.py").write_text(MISUSE)
    (tmp_path / "untyped.py").write_text(UNTYPED)
    result = mypy(str(tmp_path / "user.py"), str(tmp_path / "untyped.py"))
    errors = sorted(line.split(": error: ", 1)[1] for line in result.stdout.splitlines() if ": error: " in line)
    assert result.returncode == 1, result.stdout + result.stderr
    assert errors == sorted([
        'Argument "pad_multiple" to "pack_sequences" has incompatible type "str"; expected "int"  [arg-type]',
        'Incompatible types in assignment (expression has type "tuple[int, ...]", variable has type "str")  [assignment]',
        'Unsupported operand types for + ("dict[str, float]" and "int")  [operator]',
        "Function is missing a type annotation  [no-untyped-def]",
    ]), result.stdout
