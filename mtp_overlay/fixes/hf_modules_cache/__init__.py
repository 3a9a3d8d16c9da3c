"""hf-modules-cache: Ray workers can import transformers' trust_remote_code classes.

transformers writes trust_remote_code modules to package ``transformers_modules`` under its
``HF_MODULES_CACHE`` folder and puts that folder on ``sys.path`` only when a remote-code load happens
(`init_hf_modules`). cloudpickle pickles such classes by reference, so a fresh Ray worker that unpickles
an actor argument holding one (a config, tokenizer, processor) fails with ``ModuleNotFoundError: No
module named 'transformers_modules'``: Ray workers inherit the raylet's environment plus the job's
``runtime_env["env_vars"]``, not the driver's ``sys.path``. Neither Ray (2.60) nor transformers (5.20)
fixes it; NeMo-RL carries a fix in its Ray setup, vLLM registers the package pickle-by-value instead.

The hook wraps ``ray.init``: the modules folder goes on this interpreter's ``sys.path`` and
``PYTHONPATH``, and the job's runtime_env carries ``HF_HOME``, ``HF_MODULES_CACHE`` and ``PYTHONPATH``
plus a ``worker_process_setup_hook`` that does the same path fix in every worker before it deserializes
anything. Workers must be able to import ``mtp_overlay`` (the same environment as the driver), and on a
multi-node cluster the folder must be on a filesystem the nodes share.

Compared with NeMo-RL's fix: ``os.pathsep`` rather than ':', no duplicates across process generations,
transformers' own fallbacks, symlinks deduplicated by real path, unsafe folders refused, and a user's
own worker setup hook chained rather than replaced.
"""

import os
import sys

from _thread import RLock

from ...calls import with_argument
from ...contract import State, Verdict, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from types import ModuleType
    from typing import Any

PACKAGE = "transformers_modules"
SETUP_HOOK = f"{__name__}.worker_process_setup"
# Ray's names: ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR (set in a `ray job submit`
# entrypoint) and ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR (an exported setup hook)
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def hf_home() -> str:
    """``HF_HOME`` as huggingface_hub resolves it (``~`` and ``$VARS`` expanded), made absolute."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    default = os.path.join(cache, "huggingface")
    return os.path.abspath(os.path.expandvars(os.path.expanduser(os.environ.get("HF_HOME", default))))


def modules_folder() -> str:
    """The folder transformers writes trust_remote_code modules to, as an absolute path.

    The loaded transformers' own constant when there is one (it read the environment at its import,
    which may have changed since); otherwise transformers 5.x's rule: ``HF_MODULES_CACHE`` verbatim
    when set, else ``$HF_HOME/modules``, else ``$XDG_CACHE_HOME/huggingface/modules``, else
    ``~/.cache/huggingface/modules``. Like transformers, and unlike ``HF_HOME``, ``HF_MODULES_CACHE`` is
    not user-expanded and an empty value is the current directory: ``~/m`` is a folder named ``~`` in
    the working directory. Matching that exactly is the point: workers must look where the driver wrote.
    """
    for name in ("transformers.dynamic_module_utils", "transformers.utils.hub"):
        constant: "str | None" = getattr(sys.modules.get(name), "HF_MODULES_CACHE", None)
        if constant is not None:
            return os.path.abspath(constant)
    folder = os.environ.get("HF_MODULES_CACHE")
    return os.path.abspath(os.path.join(hf_home(), "modules") if folder is None else folder)


def unsafe_reason(folder: str) -> "str | None":
    """Why ``folder`` must not go on an import path, or None.

    On ``PYTHONPATH`` the folder comes before the standard library in every child, so whoever can add a
    file to it runs code there. Like ssh's StrictModes: refuse a value holding ``os.pathsep`` (it would
    become several entries), anything but a folder, a folder that others than its owner can write to
    (a sticky bit does not stop new files) or that another user than us or root owns, and a folder
    under a parent others can write to, unless that parent is sticky and ours or root's (as /tmp is):
    otherwise anyone could swap the folder for their own.
    """
    if os.pathsep in folder:
        return f"{folder!r} contains {os.pathsep!r} (os.pathsep): on PYTHONPATH it would be several folders"
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if os.name != "posix":
        return None  # no POSIX owner and mode bits to judge by
    folder = path = os.path.realpath(folder)
    while True:
        try:
            info = os.stat(path)
        except OSError:  # missing (judge its parent) or unreadable (nothing can be imported from it)
            info = None
        if info is not None:
            others_write = info.st_mode & 0o022
            ours = info.st_uid in (os.getuid(), 0)
            if path == folder and others_write:
                return f"{path} is writable by its group or by anyone (chmod go-w {path})"
            if path == folder and not ours:
                return f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()}) or root"
            if path != folder and others_write and not (info.st_mode & 0o1000 and ours):
                return (f"its parent {path} is writable by its group or by anyone and not a sticky folder of "
                        f"this user or root (chmod go-w {path})")
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _on_path(folder: str, entries: "Iterable[str]") -> bool:
    real = os.path.realpath(folder)
    return any(entry and os.path.realpath(entry) == real for entry in entries)


def _ensure_directory(folder: str) -> None:
    # A missing sys.path entry is cached as "no finder" at the next import and never looked at
    # again: a worker started before the driver's first remote-code load would then miss the
    # package for good. Create it as transformers' init_hf_modules would.
    if not os.path.isdir(folder):
        import importlib

        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return  # a read-only place: transformers cannot write there either
        importlib.invalidate_caches()


class SetupHookChain:
    """Ray worker setup hook: this fix's path fix, then the user's own hook (a callable or a
    ``"module.function"`` path, as Ray accepts). Pickled by Ray with cloudpickle, so it ships to
    workers with the user's hook inside."""

    def __init__(self, user_hook: "Callable[[], object] | str") -> None:
        self.user_hook = user_hook
        self.__name__ = f"hf_modules_cache_then_{getattr(user_hook, '__name__', user_hook)}"

    def __call__(self) -> object:
        worker_process_setup()
        hook: "Any" = self.user_hook
        if isinstance(hook, str):
            import importlib

            module, _, name = hook.rpartition(".")
            hook = getattr(importlib.import_module(module), name)
        return hook()


def user_runtime_env(kwargs: "dict[str, Any]") -> "dict[str, Any]":
    """The runtime_env a ``ray.init(**kwargs)`` call asks for (both are keyword-only), or ``{}``.

    Ray applies ``runtime_env`` only when it is non-empty, else the ``job_config``'s. Bad input gets a
    TypeError here, before anything changes: Ray itself fails on a non-dict runtime_env with an
    unhelpful AttributeError, and on bad env_vars with the same TypeError as this one.
    """
    runtime_env = kwargs.get("runtime_env")
    if not runtime_env and kwargs.get("job_config") is not None:
        runtime_env = kwargs["job_config"].runtime_env
    if runtime_env is None:
        return {}
    if not isinstance(runtime_env, dict):
        raise TypeError(
            f"ray.init(runtime_env=...) must be a dict or ray.runtime_env.RuntimeEnv, got {type(runtime_env).__name__}"
        )
    env_vars = runtime_env.get("env_vars")
    if env_vars is not None:
        if not isinstance(env_vars, dict):
            raise TypeError(f"runtime_env['env_vars'] must be a dict of str to str, got {type(env_vars).__name__}")
        for key, value in env_vars.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"runtime_env['env_vars'] must be a dict of str to str, got {key!r}: {value!r}")
    return runtime_env


def _job_runtime_env() -> "dict[str, Any]":
    # in a `ray job submit` entrypoint, ray.init merges the job's runtime_env with the driver's and
    # raises on any shared env var or field: those belong to the job and are left alone
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return {}
    import json

    found: "dict[str, Any]" = json.loads(raw).get("runtime_env") or {}
    return found


def worker_env_vars(folder: str) -> "dict[str, str]":
    """What workers need to resolve and import ``folder``: nothing else of the driver's environment.

    ``HF_HOME`` only when the driver sets it, so a cluster's own setting is not replaced by a default.
    """
    env = {"HF_MODULES_CACHE": folder, "PYTHONPATH": os.environ["PYTHONPATH"]}
    if "HF_HOME" in os.environ:
        env["HF_HOME"] = hf_home()
    return env


def with_worker_setup(runtime_env: "dict[str, Any] | None", folder: str) -> "dict[str, Any]":
    """A copy of ``runtime_env`` that brings ``folder`` to every worker; user values win key by key."""
    import copy

    job = _job_runtime_env()
    taken = set(job.get("env_vars") or {})
    merged = copy.copy(runtime_env) if runtime_env else {}
    ours = {key: value for key, value in worker_env_vars(folder).items() if key not in taken}
    merged["env_vars"] = {**ours, **(merged.get("env_vars") or {})}
    if "worker_process_setup_hook" not in job and SETUP_HOOK_ENV not in taken:
        user_hook = merged.get("worker_process_setup_hook")
        if user_hook is None:
            merged["worker_process_setup_hook"] = SETUP_HOOK
        elif user_hook != SETUP_HOOK and not isinstance(user_hook, SetupHookChain):
            merged["worker_process_setup_hook"] = SetupHookChain(user_hook)
    return merged


class ModulesCacheFix(Fix):
    declaration = DECLARATION  # one target, "ray": ray.init

    def probe(self, module: "ModuleType") -> Verdict:
        import inspect

        init = vars(module).get("init")
        if init is None:
            return drifted("ray has no init()")
        if "runtime_env" not in inspect.signature(init).parameters:
            return drifted("ray.init() takes no runtime_env")
        runtime_env_class = getattr(getattr(module, "runtime_env", None), "RuntimeEnv", None)
        if "worker_process_setup_hook" not in getattr(runtime_env_class, "known_fields", ()):
            return drifted("ray.runtime_env.RuntimeEnv has no worker_process_setup_hook field")
        pickler = sys.modules.get("ray.cloudpickle.cloudpickle")
        if PACKAGE in getattr(pickler, "_PICKLE_BY_VALUE_MODULES", ()):
            return redundant(f"ray.cloudpickle pickles {PACKAGE} by value: workers need no folder")
        return needed(f"ray.cloudpickle pickles {PACKAGE} classes by reference")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        yield module, "init", self._init_with_modules_cache

    def _init_with_modules_cache(self, wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                 kwargs: "dict[str, Any]") -> "Any":
        runtime_env = user_runtime_env(kwargs)
        folder = modules_folder()
        if self.add_to_import_path(folder):
            args, kwargs = with_argument(args, kwargs, None, "runtime_env", with_worker_setup(runtime_env, folder))
        return wrapped(*args, **kwargs)

    def add_to_import_path(self, folder: str) -> bool:
        """Put ``folder`` on ``sys.path`` and ``PYTHONPATH`` once each (by real path); False if refused.

        Appended to the end of ``sys.path``, where transformers' own `init_hf_modules` puts it, so in
        this process only names found nowhere else (package ``transformers_modules``) come from it.
        Children get it through ``PYTHONPATH``, whose entries come before the standard library and
        site-packages: there any module written into the folder (only ``transformers_modules`` is
        expected) would shadow a module of the same name. Hence `unsafe_reason` refuses a folder that
        someone other than this user or root could write into or swap. Left as is on ``PYTHONPATH``
        where a parent already put it, so no generation adds it twice. `uninstall()` leaves both as
        they are, as it would after a remote-code load.
        """
        target = self.target("ray")
        with _PATH_LOCK:
            reason = unsafe_reason(folder)
            if reason is not None:
                self.lifecycle.record(target, State.FAILED, f"refused {folder}: {reason}")
                self.lifecycle.report(f"refused to put {folder} on the import path: {reason}")
                return False
            _ensure_directory(folder)
            if not _on_path(folder, sys.path):
                sys.path.append(folder)
            pythonpath = os.environ.get("PYTHONPATH", "")
            if not _on_path(folder, pythonpath.split(os.pathsep)):
                os.environ["PYTHONPATH"] = pythonpath + os.pathsep + folder if pythonpath else folder
            self.lifecycle.record(target, State.INSTALLED, f"{folder} on the import path of this process and its Ray workers")
            return True


FIX = ModulesCacheFix()
_PATH_LOCK = RLock()


def worker_process_setup() -> None:
    """Ray ``worker_process_setup_hook``: the driver's modules folder (forwarded in the job's
    ``HF_MODULES_CACHE``) on this worker's path before it deserializes any argument."""
    FIX.add_to_import_path(modules_folder())
