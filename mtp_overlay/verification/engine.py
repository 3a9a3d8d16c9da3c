"""The way from the product to the test bed's engine: a child process, JSON lines both ways.

The product reaches the test bed through named doors only (``tests/contract/test_layers.py``): the CLI's
``demo`` and ``check --run`` import it inside those commands, and verify runs the engine
(``mtp_overlay.bed.engines.verify``, shipped in the same package) as ``python -m`` in a child process,
which it needs anyway: the engine starts gloo ranks that import torch, megatron-core and
Megatron-Bridge, none of which the caller's process should carry. One request per line on the
child's stdin, one answer per line on its stdout; its stderr (progress) goes to ``progress`` line by
line. Anything with a ``request``/``close`` pair (`Engine`) serves as well: a test hands in the test
bed's in-process engine, as ``check(stock_run=...)`` takes the test bed's stock runner.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Protocol

    from .plan import Answer, DescribeRequest, RunRequest

    class Engine(Protocol):
        def request(self, message: DescribeRequest | RunRequest) -> Answer: ...

        def close(self) -> None: ...

ENGINE_MODULE = "mtp_overlay.bed.engines.verify"
REQUIRES = ("torch", "megatron.core", "megatron.bridge", "transformers")
TAIL = 40  # stderr lines kept for an error message


def missing_requirements() -> list[str]:
    """The packages the engine imports that this environment lacks (none are imported to find out)."""
    missing = []
    for name in REQUIRES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


class ChildEngine:
    """The engine in a child process with ``world_size`` ranks; ``log``: the ranks' output (default: a
    temporary file the child names in its errors); ``progress``: called with each stderr line."""

    def __init__(self, world_size: int, *, log: str | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        missing = missing_requirements()
        if missing:
            raise RuntimeError(
                f"mtp-overlay verify runs the test bed, which needs {', '.join(REQUIRES)}; missing here: "
                f"{', '.join(missing)} (install mtp-overlay[megatron,hf] and megatron-bridge)"
            )
        command = [sys.executable, "-m", ENGINE_MODULE, "--world-size", str(world_size)]
        if log is not None:
            command += ["--log", os.fspath(log)]
        self._progress = progress or _to_stderr
        self._tail: list[str] = []
        self._child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self._child.stderr is not None
        for line in self._child.stderr:
            line = line.rstrip("\n")
            self._tail = (self._tail + [line])[-TAIL:]
            self._progress(line)

    def request(self, message: DescribeRequest | RunRequest) -> Answer:
        """One request, one answer; RuntimeError with the child's last stderr lines if it dies."""
        assert self._child.stdin is not None and self._child.stdout is not None
        try:
            self._child.stdin.write(json.dumps(message) + "\n")
            self._child.stdin.flush()
        except BrokenPipeError:
            pass
        line = self._child.stdout.readline()
        if not line:
            self._child.wait(timeout=30)
            self._reader.join(timeout=5)
            tail = "\n".join(self._tail[-15:])
            raise RuntimeError(f"the verify engine exited ({self._child.returncode}) without an answer:\n{tail}")
        answer: Answer = json.loads(line)
        if not isinstance(answer, dict):
            raise RuntimeError(f"the verify engine answered {line[:200]!r}")
        return answer

    def close(self) -> None:
        if self._child.stdin is not None and not self._child.stdin.closed:
            self._child.stdin.close()
        try:
            self._child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._reader.join(timeout=5)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
