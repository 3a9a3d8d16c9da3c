"""Processes that start with torch's heavy imports already done: the test bed's ranks and fresh interpreters.

A fresh interpreter importing megatron-core spends ~15 s of its ~16 s (2-core CPU machine) in
torch's compiler stack and flashinfer, which megatron-core imports at module level and which no fix
touches. A multiprocessing forkserver imports them once (`PRELOAD`); every rank and every
`run_python` child is forked from it and imports megatron-core itself in ~1.5 s. Nothing the tests
vary is preloaded: the child sets its environment and ``sys.path`` before it imports the overlay or
any upstream package that a fix targets.
"""

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "flashinfer"]
# read once at interpreter start: a child that needs one is a real subprocess
INTERPRETER_VARIABLES = ("PYTHONWARNINGS", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")
# sys.path of `python -c` run with PYTHONPATH=_PYTHONPATH_SLOT: a child's PYTHONPATH entries go where the
# slot is (site's .pth files insert entries too, before or after); absolute, so Python keeps it as is
_PYTHONPATH_SLOT = "/<PYTHONPATH>"
_fresh_path = []


def context():
    """The multiprocessing context whose processes fork from the preloaded server."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    return forkserver


def run_python(code, env, timeout, cwd=None):
    """What ``subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)`` returns, run in a child of the preloaded server (a real subprocess
    when ``env`` sets a variable only interpreter start-up reads)."""
    command = [sys.executable, "-c", code]
    if any(name in env for name in INTERPRETER_VARIABLES):
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if not _fresh_path:
        shown = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path))"],
                               capture_output=True, text=True, env={**env, "PYTHONPATH": _PYTHONPATH_SLOT}, check=True)
        _fresh_path.extend(json.loads(shown.stdout))
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = [part for entry in _fresh_path for part in (entries if entry == _PYTHONPATH_SLOT else [entry])]
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-python-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        names = dict(code=code, env=dict(env), sys_path=path, out=str(out), err=str(err),
                     cwd=os.fspath(cwd or os.getcwd()))
        child = context().Process(target=exec, args=(_PYTHON_CHILD, names))
        caller_main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")  # multiprocessing would import ours in the child
        try:
            child.start()
        finally:
            sys.modules["__main__"] = caller_main
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, child.exitcode, out.read_text(), err.read_text())


# The child of `run_python`: its target is builtins.exec of this text, so that nothing of ours (whose
# import installs the overlay, reading the environment) is imported before its environment is set.
_PYTHON_CHILD = """
import atexit, os, sys, traceback, types
for descriptor, path in ((1, out), (2, err)):
    opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(opened, descriptor)
    os.close(opened)
os.environ.clear()
os.environ.update(env)
os.chdir(cwd)
sys.path[:] = sys_path
sys.argv = ["-c"]
main = sys.modules["__main__"] = types.ModuleType("__main__")
status = 0
try:
    exec(compile(code, "<string>", "exec"), main.__dict__)
except SystemExit as exc:
    status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    if status and not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr)
except BaseException:
    traceback.print_exc()
    status = 1
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
"""
