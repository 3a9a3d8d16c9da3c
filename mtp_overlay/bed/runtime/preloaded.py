"""Processes that start with torch's heavy imports already done: the test bed's ranks and fresh interpreters.

A fresh interpreter importing megatron-core spends ~15 s of its ~16 s (2-core CPU machine) in
torch's compiler stack and flashinfer, which megatron-core imports at module level and which no fix
touches. A multiprocessing forkserver imports them once (`PRELOAD`); every rank and every
`run_python` child is forked from it and imports megatron-core itself in ~1.5 s. Nothing the tests
vary is preloaded: the child sets its environment and ``sys.path`` before it imports the overlay or
any upstream package that a fix targets.

CUDA-safe: the server and every child of it run with CUDA hidden (`device.HIDE_CUDA`), so nothing
preloaded can initialise CUDA before a fork (the children's CUDA would be unusable); CUDA ranks are
spawned instead (`rank_context`).

Stock means stock: the server is born with ``MTP_OVERLAY_DISABLE=all``, so whatever in a child
imports the overlay before the child has set its own environment (unpickling a rank's target,
multiprocessing importing the caller's main module, a ``.pth`` startup hook) installs nothing, and
the child then installs exactly the fixes it was asked for (`install_exactly`): the fix modules a
case did not ask for are never imported, rather than installed and taken out again.
"""

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

from .device import HIDE_CUDA, check_device

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "flashinfer"]
DISABLE = "MTP_OVERLAY_DISABLE"  # the product's switch (mtp_overlay.registry.disabled_from_env)
# read once at interpreter start, or (TRITON_INTERPRET) when Triton's language loads, which the server
# preloads: a child that needs one is a real subprocess
INTERPRETER_VARIABLES = ("PYTHONWARNINGS", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH",
                         "TRITON_INTERPRET")
# sys.path of `python -c` run with PYTHONPATH=_PYTHONPATH_SLOT: a child's PYTHONPATH entries go where the
# slot is (site's .pth files insert entries too, before or after); absolute, so Python keeps it as is
_PYTHONPATH_SLOT = "/<PYTHONPATH>"
_fresh_path = []
_server_lock = threading.Lock()


def context():
    """The multiprocessing context whose processes fork from the preloaded server (started here, born
    with the overlay switched off and CUDA hidden, when it is not running)."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    with born_with({DISABLE: "all", **HIDE_CUDA}):  # the server copies our environment when it starts
        multiprocessing.forkserver.ensure_running()
    return forkserver


@contextlib.contextmanager
def born_with(variables):
    """Lend ``variables`` to ``os.environ`` while a process that copies it starts (one at a time)."""
    with _server_lock:
        saved = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def install_exactly(fixes, switch):
    """In a process born with the overlay off: install what a case asked for, then leave the
    environment's ``MTP_OVERLAY_DISABLE`` at the caller's value ``switch`` (None: unset).

    fixes: None installs what ``import mtp_overlay`` installs under the caller's switch; a list of fix
    ids installs exactly those (the caller's switch does not apply to them); ``[]`` none. What was
    installed before (an earlier case in the same rank) is uninstalled first.
    """
    import mtp_overlay

    mtp_overlay.uninstall()
    try:
        if fixes is None:
            _set_switch(switch)
            mtp_overlay.install()
        elif fixes:
            _set_switch(None)
            mtp_overlay.install(only=list(fixes))
    finally:
        _set_switch(switch)


def _set_switch(value):
    if value is None:
        os.environ.pop(DISABLE, None)
    else:
        os.environ[DISABLE] = value


def run_python(code, env, timeout, cwd=None, fixes=None):
    """What ``subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)`` returns, run in a child of the preloaded server (a real subprocess
    when ``env`` sets a variable only interpreter start-up reads). The child runs on CPU: its
    environment is ``env`` with CUDA hidden (`device.HIDE_CUDA`).

    fixes: None runs ``code`` as ``python -c`` would (its ``import mtp_overlay`` installs what ``env``
    enables); a list of fix ids makes a stock interpreter (``MTP_OVERLAY_DISABLE=all`` from its start)
    that installs exactly those (`install_exactly`) before ``code`` runs, ``[]`` none; ``code`` sees
    ``env`` as given.
    """
    command = [sys.executable, "-c", code]
    if fixes is not None:
        check_fixes(fixes)
    if any(name in env for name in INTERPRETER_VARIABLES):
        if fixes is None:
            return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
        born = {**env, DISABLE: "all"}
        stock = [sys.executable, "-c", _STOCK_START.format(fixes=list(fixes), switch=env.get(DISABLE), code=code)]
        result = subprocess.run(stock, capture_output=True, text=True, env=born, cwd=cwd, timeout=timeout)
        return subprocess.CompletedProcess(command, result.returncode, result.stdout, result.stderr)
    if not _fresh_path:
        shown = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path))"],
                               capture_output=True, text=True, env={**env, "PYTHONPATH": _PYTHONPATH_SLOT}, check=True)
        _fresh_path.extend(json.loads(shown.stdout))
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = [part for entry in _fresh_path for part in (entries if entry == _PYTHONPATH_SLOT else [entry])]
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-python-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        names = dict(code=code, env={**env, **HIDE_CUDA}, sys_path=path, out=str(out), err=str(err),
                     cwd=os.fspath(cwd or os.getcwd()), fixes=None if fixes is None else list(fixes))
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
if fixes is not None:  # born with the server's MTP_OVERLAY_DISABLE=all: import the overlay under it
    os.environ["MTP_OVERLAY_DISABLE"] = "all"
    from mtp_overlay.bed.runtime.preloaded import install_exactly
    install_exactly(fixes, env.get("MTP_OVERLAY_DISABLE"))
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

# `run_python(fixes=...)` in a real subprocess, started with MTP_OVERLAY_DISABLE=all: the fixes asked
# for, the caller's switch back, then the code as ``python -c`` runs it
_STOCK_START = """
from mtp_overlay.bed.runtime.preloaded import install_exactly
install_exactly({fixes!r}, {switch!r})
del install_exactly
exec(compile({code!r}, "<string>", "exec"))
"""


def check_fixes(fixes):
    if isinstance(fixes, str):
        raise TypeError(f"fixes must be None or a list of fix ids, got the string {fixes!r}")
    from mtp_overlay import registry

    for name in fixes:
        registry.lifecycle(name)  # ValueError naming the known fixes


def rank_context(device: str):
    """The multiprocessing context a rank on ``device`` starts from: CPU ranks fork from the
    preloaded server (CUDA hidden there), CUDA ranks are spawned (they initialise CUDA themselves)."""
    return context() if check_device(device) == "cpu" else multiprocessing.get_context("spawn")
