"""Is each fix still needed on the installed upstream? Measured by running it, never declared.

For every fix whose upstream distribution is installed: `mtp_overlay.check` with the test bed's
stock runs (the probe reads the code, the reproducer runs the stock path with the fix off; the two
must agree), then both compared with what the fix's provenance says for this version. A fix that
upstream has absorbed fails here with the fix, the package and version, and what to do; a stock path
the test bed cannot run on this upstream fails as its own outcome ("could not run the stock path on
<dist> <version>: <reason>; the test bed needs updating"), one line, no traceback.
"""

import pytest

from mtp_overlay import declarations, registry
from mtp_overlay.contract import State
from mtp_overlay.bed.models.bridge import import_stand_ins
from mtp_overlay.bed.fixes import stock_run


# slow: their stock runs import Bridge (~20-45 s a process), start a Ray cluster, or build vLLM's drafter
HEAVY_DISTRIBUTIONS = ("megatron-bridge", "ray", "vllm")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if declarations.load(name).distribution in HEAVY_DISTRIBUTIONS else name
    for name in declarations.names()
])
def test_fix_state_matches_upstream_behaviour(name):
    with import_stand_ins():  # the targets import as the stock runs do (Bridge without TE: the test bed's)
        row = registry.check([name], stock_run=stock_run)[0]
    if row.verdict == State.ABSENT:
        pytest.skip(row.reason)
    where = f"{row.distribution} {row.version}"
    if row.run.outcome is None:  # not run: the one-line reason, no traceback
        probe = "" if row.verdict in (State.NEEDED, State.REDUNDANT) else f" ({row.reason})"
        pytest.fail(f"{name}: {row.run}{probe}", pytrace=False)
    if row.verdict == State.DISAGREES:
        pytest.fail(f"{name} on {where}: {row.reason}: the probe no longer recognises upstream; fix the probe",
                    pytrace=False)
    declaration = declarations.load(name)
    fixed_upstream = declaration.fixed_upstream_in(row.version)
    if row.run.outcome == State.REDUNDANT and not fixed_upstream:
        pytest.fail(
            f"{name} is REDUNDANT on {where}: {row.run.evidence}. Upstream now carries the fix: set "
            f"first_fixed_release to {row.version} in the fix's declaration (its provenance), mark its patches "
            f"'Applied-Upstream: {row.version}', and drop the patch family for this release."
        )
    if row.run.outcome == State.NEEDED and fixed_upstream:
        pytest.fail(
            f"{name}: the provenance says upstream fixed it in {declaration.provenance.first_fixed_release}, "
            f"yet stock {where} still shows the bug: {row.run.evidence}. Correct first_fixed_release."
        )
