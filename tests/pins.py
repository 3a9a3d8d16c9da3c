"""The pinned releases of the development / CI stack, read from ``scripts/constraints.txt``.

That file is the one list of pins (scripts/setup.sh builds the venv from it): a test names "the venv's
megatron-core" as ``pins.MEGATRON_CORE``, never as a version literal, so bumping a pin is one edit
there. Importable from every test module, its parametrize decorators and module-level constants
(tests/conftest.py's folder is on ``sys.path``); only the standard library, nothing upstream.
Releases a test installs side by side on purpose (an older megatron-core or vLLM) stay literals in
that test: they name that release, not the pin.
"""

import re
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parents[1] / "scripts" / "constraints.txt"
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)$")


def normalized(distribution):
    """``distribution`` as PEP 503 compares names (``Megatron_Core`` -> ``megatron-core``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def read(path=CONSTRAINTS):
    """{normalized distribution name: pinned version} of a constraints file of ``name==version`` lines."""
    found = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if match is None:
            raise ValueError(f"{path}:{number}: expected a 'name==version' pin, got {line!r}")
        found[normalized(match["name"])] = match["version"]
    return found


PINS = read()


def pinned(distribution):
    """The version ``scripts/constraints.txt`` pins ``distribution`` to; KeyError naming the file if none."""
    try:
        return PINS[normalized(distribution)]
    except KeyError:
        raise KeyError(f"{distribution!r} is not pinned in {CONSTRAINTS}") from None


MEGATRON_CORE = pinned("megatron-core")
MEGATRON_BRIDGE = pinned("megatron-bridge")
VLLM = pinned("vllm")
TRANSFORMERS = pinned("transformers")
RAY = pinned("ray")
TORCH = pinned("torch")
