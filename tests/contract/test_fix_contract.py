"""The lifecycle guarantees, checked on every registered fix against its real upstream targets.

A new fix gets these for free by being in the generated table (`mtp_overlay.table`, written from its
declaration): installed before its targets' import and after it (late), installed twice without
stacking, uninstalled with every original restored by identity, disabled (by ``install(skip=...)``
and by ``MTP_OVERLAY_DISABLE``), and, when a wrapped attribute disappears from upstream, drift that
warns and, in strict mode, raises. One fresh interpreter per fix.
"""

import json
import os

import pytest

from mtp_overlay import declarations, registry
from mtp_overlay.contract import distribution_version
from mtp_overlay.bed.runtime.preloaded import run_python

SCENARIOS = r"""
import importlib, json, os, sys, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay import OverlayError, OverlayWarning, State, registry

life = registry.lifecycle(name)
facts = {"pending": life.state()[0]}
from mtp_overlay.bed.models.bridge import import_stand_ins  # Bridge's optional imports on this machine
with import_stand_ins():
    modules = [importlib.import_module(target) for target in life.targets]  # the hooks fire here
facts["before"] = [life.state()[0], life.late]
facts["why"] = life.state()[1]
import wrapt
wrapped = life.wrapped()
originals = {key: life._originals[key][0] for key in wrapped}
facts["wrapped"] = len(wrapped)
if not wrapped:  # not installed (its probe or hook failed: "why" says so): nothing else to check
    print("FACTS " + json.dumps(facts))
    sys.exit(0)

def chain(key):
    # the attribute's wrapt wrappers, outermost first (other fixes may wrap the same attribute), and
    # what they end at
    found, current = [], vars(key[0])[key[1]]
    while isinstance(current, wrapt.BaseObjectProxy):
        found.append(current)
        current = current.__wrapped__
    return found, current

def reaches(key, target):
    found, end = chain(key)
    return end is target or any(w is target for w in found)

def chain_ok():
    # each attribute: exactly one wrapper of ours in its chain (which another fix's may share), and
    # the chain still reaches what was there before
    ours = {key: life._originals[key][1] for key in life.wrapped()}
    return all(sum(w is ours[k] for w in chain(k)[0]) == 1 and reaches(k, originals[k]) for k in wrapped)

ever = []  # every wrapper of ours so far

def remember():
    ever.extend(ours for _, ours in life._originals.values())

def restored():
    # none of ours left anywhere in the chain, which still reaches what was there before
    return all(reaches(k, originals[k]) and not any(w is o for w in chain(k)[0] for o in ever) for k in wrapped)

remember()

facts["chain"] = chain_ok()
registry.uninstall(only=[name])
facts["uninstalled"] = [life.state()[0], restored()]
registry.install(only=[name])
remember()
facts["late"] = [life.state()[0], life.late, chain_ok()]
registry.install(only=[name])
remember()
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


# a fix on Megatron-Bridge imports Bridge in its interpreter (~20-45 s here): heavy, marked slow
HEAVY_DISTRIBUTIONS = ("megatron-bridge",)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if declarations.load(name).distribution in HEAVY_DISTRIBUTIONS else name
    for name in registry.names()
])
def test_fix_lifecycle_on_its_real_targets(name):
    fix = registry.get(name)
    if distribution_version(fix.distribution) is None:
        pytest.skip(f"{fix.distribution} is not installed")
    result = run_python(f"name = {name!r}\n" + SCENARIOS, dict(os.environ), timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("FACTS ")]
    assert lines, result.stderr[-3000:]
    facts = json.loads(lines[-1][len("FACTS "):])
    assert facts["pending"] == "pending"
    assert facts["before"] == ["installed", False] and facts["wrapped"] > 0 and facts["chain"], facts["why"]
    assert facts["uninstalled"] == ["disabled", True]
    assert facts["late"] == ["installed", True, True]
    assert facts["twice"] == [True, True]
    assert facts["skipped"] == ["disabled", True]
    assert facts["env_disabled"] == ["disabled", True]
    assert facts["drift_warns"][0] in ("drifted", "failed") and facts["drift_warns"][1]
    assert facts["strict"] == "OverlayError"
