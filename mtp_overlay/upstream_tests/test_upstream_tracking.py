"""Is each fix still needed on the installed upstream? Measured by running it, never declared.

For every fix whose upstream distribution is installed: run the stock code path with the fix off
(the test bed's reproducer), check that the static probe (`mtp-overlay check`) agrees, and compare
both with what the fix's provenance says for this version. A fix that upstream has absorbed fails
here with the fix, the package and version, and what to do; a stock path the test bed cannot run on
this upstream fails as its own outcome ("could not run the stock path on <dist> <version>: <reason>;
the test bed needs updating"), one line, no traceback.
"""

import pytest

from mtp_overlay import registry
from mtp_overlay.contract import State, distribution_version
from mtp_overlay.testing.reproducers import StockPathNotRun, stock_run


@pytest.mark.parametrize("name", registry.names())
def test_fix_state_matches_upstream_behaviour(name):
    fix = registry.get(name)
    version = distribution_version(fix.distribution)
    if version is None:
        pytest.skip(f"{fix.distribution} is not installed")
    where = f"{fix.distribution} {version}"
    try:
        shows, evidence = stock_run(name)
    except StockPathNotRun as exc:
        not_run = f"{name}: {exc}"
    else:
        not_run = None
    if not_run:  # failed outside the except block: the report holds no chained traceback
        pytest.fail(not_run, pytrace=False)
    measured = State.NEEDED if shows else State.REDUNDANT
    static = registry.check([name])[0]
    assert static.verdict == measured, (
        f"{name}: the probe says {static.verdict} ({static.reason}) but running stock {where} says "
        f"{measured} ({evidence}): the probe no longer recognises upstream; fix the probe"
    )
    fixed_upstream = fix.fixed_upstream_in(version)
    if measured == State.REDUNDANT and not fixed_upstream:
        pytest.fail(
            f"{name} is REDUNDANT on {where}: {evidence}. Upstream now carries the fix: set "
            f"first_fixed_release to {version} in the fix's provenance, mark its patches "
            f"'Applied-Upstream: {version}', and drop the patch family for this release."
        )
    if measured == State.NEEDED and fixed_upstream:
        pytest.fail(
            f"{name}: the provenance says upstream fixed it in {fix.provenance.first_fixed_release}, "
            f"yet stock {where} still shows the bug: {evidence}. Correct first_fixed_release."
        )
