"""Write what is generated from the fixes' declarations: mtp_overlay/table.py, each fix README's fact
block and the README's fix table (`mtp_overlay.generated`).

Usage: python scripts/generate.py [--check]
--check writes nothing: it lists the stale files and every DEP-3 header that disagrees with its
fix's provenance, and exits 1 when there is any.
"""

import argparse
import sys

from mtp_overlay import generated


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when anything is stale")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            for path in generated.write():
                print(f"wrote {path.relative_to(generated.ROOT)}")
            return 0
        problems = [f"stale: {path.relative_to(generated.ROOT)} (run scripts/generate.py)" for path in generated.stale()]
        problems += generated.dep3_mismatches()
    except generated.GenerationError as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
