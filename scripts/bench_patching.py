"""Time `mtp-overlay patch check` and apply+revert on a temporary copy of the installed megatron-core.

Budgets: check <= 1 s, apply+revert <= 2 s, timed as a container build runs them: the CLI in
a fresh interpreter. Side by side, in the same copy: the same commands in process (the interpreter's
start-up is the difference) and bare `git apply --check` / `git apply` + `git apply -R` of the same patch,
the floor of any git-based patcher; the ratio is what discovery, hash checks and the transaction cost.
Exit status 1 when a budget is exceeded. Usage: python scripts/bench_patching.py [--repeat N]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mtp_overlay import declarations
from mtp_overlay.contract import State
from mtp_overlay.patching import engine
from mtp_overlay.patching.locate import find_distribution
from mtp_overlay.patching.manifest import load
from mtp_overlay.bed.runtime.releases import copy_installed

BUDGETS = {"check": 1.0, "apply+revert": 2.0}


def median_seconds(step, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement; the median is printed")
    repeat = parser.parse_args().repeat
    fixes, manifest = [declarations.load("mtp-sp-scatter")], load()
    with tempfile.TemporaryDirectory(prefix="bench-patching-") as scratch:
        site = copy_installed("megatron-core", Path(scratch) / "site")
        patch = manifest.patch_path(fixes[0], fixes[0].family_of(find_distribution("megatron-core", [site]).version))
        files = sum(1 for path in site.rglob("*") if path.is_file())
        print(f"megatron-core copy: {site} ({files} files), {patch.name}, median of {repeat} runs")

        cli = [sys.executable, "-m", "mtp_overlay.cli", "patch"]
        where = ["--site-packages", str(site), "--only", "mtp-sp-scatter"]
        git_env = {**os.environ, "GIT_CEILING_DIRECTORIES": scratch}

        def run(*command):
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=site, env=git_env)

        def in_process(*commands):
            for command in commands:
                assert all(r.action not in ("refused", "failed") for r in engine.run(command, fixes, manifest, [site]))

        rows = {
            "check": (
                lambda: run(*cli, "check", *where),
                lambda: in_process("check"),
                lambda: run("git", "apply", "--check", str(patch)),
            ),
            "apply+revert": (
                lambda: (run(*cli, "apply", *where), run(*cli, "revert", *where)),
                lambda: in_process("apply", "revert"),
                lambda: (run("git", "apply", str(patch)), run("git", "apply", "-R", str(patch))),
            ),
        }
        over = False
        for name, (with_cli, api, bare) in rows.items():
            t_cli, t_api, t_bare = (median_seconds(step, repeat) for step in (with_cli, api, bare))
            ok = t_cli <= BUDGETS[name]
            over |= not ok
            print(
                f"patch {name:<13} CLI {t_cli:6.3f} s  in-process {t_api:6.3f} s  bare git {t_bare:6.3f} s  "
                f"CLI/git {t_cli / t_bare:5.1f}x  in-process/git {t_api / t_bare:5.1f}x  "
                f"budget {BUDGETS[name]:.1f} s: {'ok' if ok else 'OVER'}"
            )
        state = engine.run("check", fixes, manifest, [site])[0].state
        print(f"copy left {state} (expected needed)")
    return 1 if over or state != State.NEEDED else 0


if __name__ == "__main__":
    sys.exit(main())
