"""The lifecycle guarantees, checked on every registered fix against its real upstream targets.

A new fix gets these for free by being in `registry.FIXES`: installed before its targets' import and
after it (late), installed twice without stacking, uninstalled with every original restored by
identity, disabled (by ``install(skip=...)`` and by ``MTP_OVERLAY_DISABLE``), and, when a wrapped
attribute disappears from upstream, drift that warns and, in strict mode, raises. One fresh
interpreter per fix.
"""

import json
import subprocess
import sys

import pytest

from mtp_overlay import registry
from mtp_overlay.contract import distribution_version

SCENARIOS = r"""
import importlib, json, os, sys, warnings
warnings.simplefilter("ignore")
name = sys.argv[1]
import mtp_overlay
from mtp_overlay import OverlayError, OverlayWarning, State, registry

life = registry.lifecycle(name)
facts = {"pending": life.state()[0]}
modules = [importlib.import_module(target) for target in life.targets]  # the hooks fire here
facts["before"] = [life.state()[0], life.late]
wrapped = life.wrapped()
originals = {key: vars(key[0])[key[1]].__wrapped__ for key in wrapped}
facts["wrapped"] = len(wrapped)

def chain_ok():
    # each attribute: exactly one wrapper of ours, around the original object
    return all(vars(o)[a].__wrapped__ is originals[(o, a)] for o, a in wrapped)

def restored():
    return all(vars(o)[a] is originals[(o, a)] for o, a in wrapped)

facts["chain"] = chain_ok()
registry.uninstall(only=[name])
facts["uninstalled"] = [life.state()[0], restored()]
registry.install(only=[name])
facts["late"] = [life.state()[0], life.late, chain_ok()]
registry.install(only=[name])
facts["twice"] = [sorted(map(repr, life.wrapped())) == sorted(map(repr, wrapped)), chain_ok()]
registry.install(only=[name], skip=[name])
facts["skipped"] = [life.state()[0], restored()]
os.environ["MTP_OVERLAY_DISABLE"] = name
registry.install(only=[name])
facts["env_disabled"] = [life.state()[0], restored()]
del os.environ["MTP_OVERLAY_DISABLE"]

owner, attribute = wrapped[0]
delattr(owner, attribute)  # upstream renamed what the fix wraps
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    registry.uninstall(only=[name])
    registry.install(only=[name])
facts["drift_warns"] = [life.state()[0], any(issubclass(w.category, OverlayWarning) for w in caught)]
registry.uninstall(only=[name])
try:
    registry.install(only=[name], strict=True)
    facts["strict"] = "no error"
except OverlayError as exc:
    facts["strict"] = "OverlayError"
setattr(owner, attribute, originals[wrapped[0]])
print("FACTS " + json.dumps(facts))
"""


@pytest.mark.parametrize("name", registry.names())
def test_fix_lifecycle_on_its_real_targets(name):
    fix = registry.get(name)
    if distribution_version(fix.distribution) is None:
        pytest.skip(f"{fix.distribution} is not installed")
    result = subprocess.run([sys.executable, "-c", SCENARIOS, name], capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("FACTS ")]
    assert lines, result.stderr[-3000:]
    facts = json.loads(lines[-1][len("FACTS "):])
    assert facts["pending"] == "pending"
    assert facts["before"] == ["installed", False] and facts["wrapped"] > 0 and facts["chain"]
    assert facts["uninstalled"] == ["disabled", True]
    assert facts["late"] == ["installed", True, True]
    assert facts["twice"] == [True, True]
    assert facts["skipped"] == ["disabled", True]
    assert facts["env_disabled"] == ["disabled", True]
    assert facts["drift_warns"][0] in ("drifted", "failed") and facts["drift_warns"][1]
    assert facts["strict"] == "OverlayError"
