"""hf-modules-cache against the installed transformers and a real local Ray cluster.

One Ray head (2 CPUs, no dashboard) is started per module and shut down after it; every scenario is
a driver subprocess of its own that connects to it, because transformers reads HF_MODULES_CACHE at
import and each scenario needs its own environment. The head runs with the overlay off and a clean
environment, so workers see only what Ray ships them: the raylet's environment plus the job's
runtime_env, exactly as on a cluster the driver did not start.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

import pytest

from mtp_overlay import OverlayError, OverlayWarning, State
from mtp_overlay.fixes import hf_modules_cache as modules_cache
from mtp_overlay.fixes.hf_modules_cache import FIX
from mtp_overlay.bed.models.remote_code import write_remote_code_model

HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1], _node_ip_address="127.0.0.1")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""

# argv: gcs address, model folder, "before"|"after" (remote-code load relative to ray.init),
# "plain" | "user-hook" (a user runtime_env with its own setup hook and env var) | "actor-pythonpath"
# (a second actor whose own runtime_env replaces PYTHONPATH)
DRIVER = """
import json, os, sys
import mtp_overlay  # what the process-startup hook does: before ray and transformers
import ray
from transformers import AutoConfig

address, model_dir, load, variant = sys.argv[1:5]


def user_setup_hook():
    os.environ["USER_SETUP_HOOK_RAN"] = "yes"


@ray.remote(num_cpus=0)
class Reader:
    def __init__(self, config):
        self.config = config

    def report(self):
        folder = os.environ.get("HF_MODULES_CACHE", "")
        real = os.path.realpath(folder)
        return {
            "marker": self.config.marker,
            "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("HF_HOME", "HF_TOKEN", "WANDB_API_KEY", "USER_VAR",
                                                  "USER_SETUP_HOOK_RAN")},
            "env_vars": ray.get_runtime_context().runtime_env.get("env_vars", {}),
            "on_sys_path": sum(os.path.realpath(p) == real for p in sys.path if p),
            "on_pythonpath": os.environ.get("PYTHONPATH", "").split(os.pathsep).count(folder),
        }


@ray.remote(num_cpus=0)
def worker_pid(config=None):
    return os.getpid(), getattr(config, "marker", None)


kwargs = {}
if variant == "user-hook":
    kwargs["runtime_env"] = {"env_vars": {"USER_VAR": "user"}, "worker_process_setup_hook": user_setup_hook}
if load == "before":
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
ray.init(address=address, **kwargs)
result = {}
if load == "after":
    result["package_existed"] = os.path.isdir(os.path.join(os.environ["HF_MODULES_CACHE"], "transformers_modules"))
    result["warm_worker"] = ray.get(worker_pid.remote(), timeout=120)[0]  # started before the load
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    try:  # idle task workers are reused: this one may have started before the folder existed
        result["task_worker"], result["task_marker"] = ray.get(worker_pid.remote(config), timeout=120)
    except Exception as exc:
        result["task_error"] = f"{type(exc).__name__}: {exc}"
result["config_module"] = type(config).__module__
try:
    result.update(ray.get(Reader.remote(config).report.remote(), timeout=120))
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
if variant == "actor-pythonpath":
    replaced = Reader.options(runtime_env={"env_vars": {"PYTHONPATH": "/elsewhere"}}).remote(config)
    result["replaced_pythonpath"] = ray.get(replaced.report.remote(), timeout=120)
result["status"] = {row.name: row.state for row in mtp_overlay.status()}
print("RESULT " + json.dumps(result), flush=True)
ray.shutdown()
"""


def clean_env(**extra):
    """This environment without anything the scenarios set themselves."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "MTP_OVERLAY_", "RAY_", "WANDB_")) and k not in ("PYTHONPATH", "XDG_CACHE_HOME")
    }
    # the test cluster listens on loopback only, for the length of this module: no token to hand around
    env["RAY_AUTH_MODE"] = "disabled"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="mcray", dir="/tmp")  # short: Ray puts unix sockets in it
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD, temp_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=temp_dir,
        env=clean_env(MTP_OVERLAY_DISABLE="all"),
        start_new_session=True,
    )
    address = head.stdout.readline().strip()
    try:
        if not address:
            pytest.fail("Ray head did not start: " + open(log.name).read()[-2000:])
        yield address
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_remote_code_model(tmp_path_factory.mktemp("models") / "tiny_remote")


def run_driver(cluster, model_dir, tmp_path, load="before", variant="plain", **env):
    cwd = tmp_path / "cwd"  # Ray puts the driver's cwd on workers' sys.path: keep it empty
    cwd.mkdir(parents=True, exist_ok=True)
    env.setdefault("HF_MODULES_CACHE", str(tmp_path / "modules"))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, cluster, str(model_dir), load, variant],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(**env),
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


MISSING = "No module named 'transformers_modules'"


# --- the bug and its cure on a real cluster -------------------------------------------------------


@pytest.mark.slow
def test_stock_ray_fails_to_unpickle_a_remote_code_config(cluster, model_dir, tmp_path):
    """Behavioural probe: if stock Ray + transformers ever ship the class, the fix is redundant."""
    result = run_driver(cluster, model_dir, tmp_path, MTP_OVERLAY_DISABLE="hf-modules-cache")
    assert result["config_module"].startswith("transformers_modules.tiny_remote.")
    assert "error" in result, (
        "REDUNDANT: stock Ray and transformers now hand a trust_remote_code config to an actor; "
        "drop hf-modules-cache"
    )
    assert "ActorDiedError" in result["error"] and MISSING in result["error"]
    assert result["status"]["hf-modules-cache"] == State.DISABLED


@pytest.mark.slow
def test_fix_lets_the_actor_read_the_config(cluster, model_dir, tmp_path):
    folder = str(tmp_path / "modules")
    result = run_driver(cluster, model_dir, tmp_path, variant="actor-pythonpath")
    assert "error" not in result, result["error"]
    assert result["marker"] == 42
    assert result["env_vars"]["HF_MODULES_CACHE"] == folder
    assert result["env_vars"]["__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"] == modules_cache.SETUP_HOOK
    assert result["on_sys_path"] == 1 and result["on_pythonpath"] == 1
    assert result["status"]["hf-modules-cache"] == State.INSTALLED
    # an actor's own env_vars win key by key over the job's; the setup hook still reaches it
    replaced = result["replaced_pythonpath"]
    assert replaced["env_vars"]["PYTHONPATH"] == "/elsewhere" and replaced["marker"] == 42
    assert replaced["on_sys_path"] == 1


@pytest.mark.slow
def test_folder_created_only_after_ray_init(cluster, model_dir, tmp_path):
    stock = run_driver(cluster, model_dir, tmp_path / "stock", load="after",
                       HF_MODULES_CACHE=str(tmp_path / "stock" / "late" / "modules"),
                       MTP_OVERLAY_DISABLE="hf-modules-cache")
    assert MISSING in stock["error"] and MISSING in stock["task_error"]
    fixed = run_driver(cluster, model_dir, tmp_path / "fixed", load="after",
                       HF_MODULES_CACHE=str(tmp_path / "fixed" / "late" / "modules"))
    assert fixed["package_existed"] is False  # transformers wrote the package after ray.init
    assert "error" not in fixed and "task_error" not in fixed, fixed
    assert fixed["marker"] == 42 and fixed["on_sys_path"] == 1
    # a task worker started before the load, reused: it needed the folder to exist when it started
    assert fixed["task_worker"] == fixed["warm_worker"] and fixed["task_marker"] == 42


@pytest.mark.slow
def test_only_the_three_keys_travel_and_user_hook_and_job_env_are_kept(cluster, model_dir, tmp_path):
    # a `ray job submit` entrypoint: the job's runtime_env already sets HF_HOME; ray.init would refuse
    # to merge a driver runtime_env setting it again, so the job's value must stay and win
    job = {"runtime_env": {"env_vars": {"HF_HOME": "/job/hf_home"}}}
    result = run_driver(
        cluster,
        model_dir,
        tmp_path,
        variant="user-hook",
        HF_HOME=str(tmp_path / "driver_home"),
        HF_TOKEN="hf_secret_of_the_driver",
        WANDB_API_KEY="wandb_secret_of_the_driver",
        RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job),
    )
    assert "error" not in result, result["error"]
    assert result["marker"] == 42
    assert result["env"]["USER_SETUP_HOOK_RAN"] == "yes"  # chained, not replaced
    assert result["env"]["USER_VAR"] == "user"
    assert result["env"]["HF_HOME"] == "/job/hf_home"
    assert result["env"]["HF_TOKEN"] is None and result["env"]["WANDB_API_KEY"] is None
    forwarded = set(result["env_vars"]) - {"USER_VAR", "HF_HOME", "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"}
    assert forwarded == {"HF_MODULES_CACHE", "PYTHONPATH"}


# --- resolution: equal to the installed transformers ------------------------------------------------

RESOLVE = """
import json, os, sys
from mtp_overlay.fixes.hf_modules_cache import modules_folder
before = modules_folder()  # from the environment: transformers not imported yet
assert "transformers" not in sys.modules
from transformers.dynamic_module_utils import HF_MODULES_CACHE
print(json.dumps([before, os.path.abspath(HF_MODULES_CACHE), modules_folder()]))
"""

SETTINGS = {
    "unset": {},
    "modules cache wins over HF_HOME and XDG": {
        "HF_MODULES_CACHE": "/x/mods",
        "HF_HOME": "/x/home",
        "XDG_CACHE_HOME": "/x/xdg",
    },
    "HF_HOME wins over XDG": {"HF_HOME": "/x/home", "XDG_CACHE_HOME": "/x/xdg"},
    "XDG, ~ expanded": {"XDG_CACHE_HOME": "~/xdg"},
    "HF_HOME, ~ and $VAR expanded": {"HF_HOME": "~/$SUB/hf", "SUB": "sub"},
    "empty modules cache is the working directory": {"HF_MODULES_CACHE": "", "HF_HOME": "/x/home"},
    "empty HF_HOME": {"HF_HOME": ""},
    "empty XDG": {"XDG_CACHE_HOME": ""},
    "~ in the modules cache is taken literally": {"HF_MODULES_CACHE": "~/mods"},
}


@pytest.mark.slow
def test_resolution_equals_installed_transformers(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", RESOLVE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=clean_env(HOME=str(home), MTP_OVERLAY_DISABLE="all", **setting),
        )
        for name, setting in SETTINGS.items()
    }
    found = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        found[name] = json.loads(out)
    for name, (from_env, transformers_value, with_transformers) in found.items():
        assert from_env == transformers_value == with_transformers, name
    assert found["unset"][0] == f"{home}/.cache/huggingface/modules"
    assert found["modules cache wins over HF_HOME and XDG"][0] == "/x/mods"
    assert found["HF_HOME wins over XDG"][0] == "/x/home/modules"
    assert found["XDG, ~ expanded"][0] == f"{home}/xdg/huggingface/modules"
    assert found["HF_HOME, ~ and $VAR expanded"][0] == f"{home}/sub/hf/modules"
    assert found["empty modules cache is the working directory"][0] == str(cwd)
    assert found["empty HF_HOME"][0] == f"{cwd}/modules"
    assert found["empty XDG"][0] == f"{cwd}/huggingface/modules"
    assert found["~ in the modules cache is taken literally"][0] == f"{cwd}/~/mods"


def test_loaded_transformers_constant_beats_a_later_environment_change(tmp_path):
    script = RESOLVE.replace("print(", "os.environ['HF_MODULES_CACHE'] = '/changed/later'\nprint(")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path,
        env=clean_env(HF_MODULES_CACHE=str(tmp_path / "m"), MTP_OVERLAY_DISABLE="all"),
    ).stdout
    assert json.loads(out)[2] == str(tmp_path / "m")  # transformers still writes there


# --- this interpreter and its children ----------------------------------------------------------------

GENERATION = """
import json, os, subprocess, sys
from mtp_overlay.fixes.hf_modules_cache import FIX, modules_folder
FIX.add_to_import_path(modules_folder())
folder = os.path.realpath(os.environ["HF_MODULES_CACHE"])
row = {"sys_path": sum(os.path.realpath(p) == folder for p in sys.path if p),
       "pythonpath": os.environ["PYTHONPATH"].split(os.pathsep)}
rows = [row]
if int(sys.argv[1]) > 1:
    child = subprocess.run([sys.executable, "-c", sys.argv[2], str(int(sys.argv[1]) - 1), sys.argv[2]],
                           capture_output=True, text=True, check=True)
    rows += json.loads(child.stdout)
print(json.dumps(rows))
"""


def test_pythonpath_stays_duplicate_free_over_three_generations(tmp_path):
    real = tmp_path / "modules"
    real.mkdir()
    link = tmp_path / "alias"
    link.symlink_to(real)
    # generation 0 starts with the alias already on PYTHONPATH and the real folder as HF_MODULES_CACHE
    env = clean_env(HF_MODULES_CACHE=str(real), PYTHONPATH=os.pathsep.join(["/keep/me", str(link)]))
    out = subprocess.run(
        [sys.executable, "-c", GENERATION, "3", GENERATION], capture_output=True, text=True, check=True, env=env,
        cwd=tmp_path,
    ).stdout
    rows = json.loads(out)
    assert len(rows) == 3
    for row in rows:
        assert row["sys_path"] == 1
        assert row["pythonpath"] == ["/keep/me", str(link)]
    # and without an alias, the folder is appended once and then left alone
    env = clean_env(HF_MODULES_CACHE=str(real), PYTHONPATH="/keep/me")
    rows = json.loads(subprocess.run([sys.executable, "-c", GENERATION, "3", GENERATION], capture_output=True,
                                     text=True, check=True, env=env, cwd=tmp_path).stdout)
    assert [row["pythonpath"] for row in rows] == [["/keep/me", str(real)]] * 3
    assert [row["sys_path"] for row in rows] == [1, 1, 1]


@pytest.fixture
def isolated_paths(monkeypatch):
    """sys.path, PYTHONPATH and the fix's state as they were, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    states = dict(FIX.lifecycle._target_states)
    strict = FIX.lifecycle.strict
    yield monkeypatch
    FIX.lifecycle._target_states.clear()
    FIX.lifecycle._target_states.update(states)
    FIX.lifecycle.strict = strict


def test_folder_appended_once_and_pythonpath_uses_os_pathsep(isolated_paths, tmp_path):
    folder = str(tmp_path / "not_yet_there")
    isolated_paths.setattr(os, "pathsep", ";")  # as on Windows: no hard-coded ':'
    isolated_paths.setenv("PYTHONPATH", "/a;/b")
    assert FIX.add_to_import_path(folder) and FIX.add_to_import_path(folder)
    assert sys.path[-1] == folder and sys.path.count(folder) == 1
    assert os.environ["PYTHONPATH"] == f"/a;/b;{folder}"
    assert os.path.isdir(folder)  # created, so a later-written package is found


@pytest.mark.parametrize(
    "mode", [0o777, 0o1777, 0o775], ids=["world-writable", "world-writable-sticky", "group-writable"]
)
def test_folder_writable_by_others_is_refused_saying_how_to_fix_it(isolated_paths, tmp_path, mode):
    folder = tmp_path / "modules"
    folder.mkdir()
    folder.chmod(mode)
    before = list(sys.path)
    with pytest.warns(OverlayWarning, match=f"writable by its group or by anyone \\(chmod go-w {folder}\\)"):
        assert FIX.add_to_import_path(str(folder)) is False
    assert sys.path == before and "PYTHONPATH" not in os.environ
    state, reason = FIX.lifecycle.state()
    assert state == State.FAILED and "writable by its group or by anyone" in reason
    FIX.lifecycle.strict = True
    with pytest.raises(OverlayError, match="writable by its group or by anyone"):
        FIX.add_to_import_path(str(folder))


@pytest.mark.parametrize("mode", [0o777, 0o775], ids=["world-writable", "group-writable"])
def test_missing_folder_under_a_parent_others_can_write_is_refused_unless_sticky(isolated_paths, tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.warns(OverlayWarning, match="not a sticky folder of this user or root"):
        assert FIX.add_to_import_path(str(shared / "modules")) is False
    assert not (shared / "modules").exists()
    shared.chmod(mode | 0o1000)  # sticky, like /tmp: nobody else can swap our folder
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverlayWarning)
        assert FIX.add_to_import_path(str(shared / "modules"))


def test_a_value_holding_os_pathsep_is_refused_not_split_into_several_entries(isolated_paths, tmp_path):
    before = list(sys.path)
    with pytest.warns(OverlayWarning, match="contains ':' \\(os.pathsep\\)"):
        assert FIX.add_to_import_path(f"{tmp_path}/modules{os.pathsep}/tmp") is False
    assert sys.path == before and "PYTHONPATH" not in os.environ


def test_a_regular_file_is_refused(isolated_paths, tmp_path):
    file = tmp_path / "modules"
    file.write_text("not a folder")
    before = list(sys.path)
    with pytest.warns(OverlayWarning, match="is not a folder"):
        assert FIX.add_to_import_path(str(file)) is False
    assert sys.path == before and "PYTHONPATH" not in os.environ


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown a folder to another user")
def test_folder_owned_by_another_user_is_refused(isolated_paths, tmp_path):
    folder = tmp_path / "modules"
    folder.mkdir()
    os.chown(folder, 65534, 65534)  # nobody: neither this user nor root
    with pytest.warns(OverlayWarning, match="owned by uid 65534"):
        assert FIX.add_to_import_path(str(folder)) is False


# --- runtime_env building on real Ray types ------------------------------------------------------------


def test_user_env_vars_win_key_by_key_and_nothing_else_is_forwarded(isolated_paths):
    isolated_paths.setenv("PYTHONPATH", "/p")
    isolated_paths.setenv("HF_HOME", "/driver/home")
    isolated_paths.setenv("HF_TOKEN", "secret")
    user = {"env_vars": {"HF_HOME": "/user/home", "OTHER": "x"}, "pip": ["six"]}
    merged = modules_cache.with_worker_setup(user, "/m")
    assert merged["env_vars"] == {"HF_MODULES_CACHE": "/m", "PYTHONPATH": "/p", "HF_HOME": "/user/home", "OTHER": "x"}
    assert merged["pip"] == ["six"] and merged["worker_process_setup_hook"] == modules_cache.SETUP_HOOK
    assert user == {"env_vars": {"HF_HOME": "/user/home", "OTHER": "x"}, "pip": ["six"]}  # not mutated
    isolated_paths.delenv("HF_HOME")
    assert "HF_HOME" not in modules_cache.with_worker_setup({}, "/m")["env_vars"]


def test_user_setup_hook_is_chained_and_never_twice(isolated_paths):
    from ray.runtime_env import RuntimeEnv

    isolated_paths.setenv("PYTHONPATH", "/p")
    merged = modules_cache.with_worker_setup(RuntimeEnv(worker_process_setup_hook="json.dumps"), "/m")
    assert isinstance(merged, RuntimeEnv)
    chain = merged["worker_process_setup_hook"]
    assert isinstance(chain, modules_cache.SetupHookChain) and chain.user_hook == "json.dumps"
    again = modules_cache.with_worker_setup(merged, "/m")
    assert again["worker_process_setup_hook"] is chain
    assert modules_cache.with_worker_setup({"worker_process_setup_hook": modules_cache.SETUP_HOOK}, "/m")[
        "worker_process_setup_hook"
    ] == modules_cache.SETUP_HOOK


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"runtime_env": "pip=six"}, r"ray.init\(runtime_env=...\) must be a dict"),
        ({"runtime_env": ["six"]}, r"ray.init\(runtime_env=...\) must be a dict"),
        ({"runtime_env": {"env_vars": "A=1"}}, r"runtime_env\['env_vars'\] must be a dict of str to str, got str"),
        ({"runtime_env": {"env_vars": {"A": 1}}}, r"got 'A': 1"),
        ({"runtime_env": {"env_vars": {1: "a"}}}, r"got 1: 'a'"),
    ],
)
def test_bad_runtime_env_is_a_type_error(kwargs, message):
    with pytest.raises(TypeError, match=message):
        modules_cache.user_runtime_env(kwargs)


def test_bad_runtime_env_fails_in_ray_init_before_anything_starts(isolated_paths):
    import ray
    import wrapt

    assert isinstance(vars(ray)["init"], wrapt.FunctionWrapper)  # the fix is on in this process
    with pytest.raises(TypeError, match="must be a dict or ray.runtime_env.RuntimeEnv, got str"):
        ray.init(runtime_env="pip=six")
    assert not ray.is_initialized() and "PYTHONPATH" not in os.environ


def test_job_config_runtime_env_is_the_base_when_no_runtime_env_is_given():
    from ray.job_config import JobConfig

    job_config = JobConfig(runtime_env={"env_vars": {"A": "1"}})
    assert modules_cache.user_runtime_env({"job_config": job_config, "runtime_env": {}}) == {"env_vars": {"A": "1"}}
    assert modules_cache.user_runtime_env({"runtime_env": {"env_vars": None}}) == {"env_vars": None}


# --- the hook on ray and the probe -------------------------------------------------------------------------


@pytest.mark.slow
def test_hook_on_top_level_ray_wraps_init_lazily_and_probe_is_static(tmp_path):
    script = """
import sys, mtp_overlay
from mtp_overlay.fixes.hf_modules_cache import FIX
from mtp_overlay.bed.models.remote_code import write_remote_code_model
assert "ray" not in sys.modules
import ray, wrapt
assert isinstance(vars(ray)["init"], wrapt.FunctionWrapper), type(vars(ray)["init"])
assert "transformers" not in sys.modules  # the probe is static: nothing of transformers imported
print(FIX.lifecycle.state())
# what vLLM does after a remote-code load: register the package pickle-by-value on Ray's cloudpickle
# -> nothing left to fix
from transformers import AutoConfig
AutoConfig.from_pretrained(write_remote_code_model("model"), trust_remote_code=True)
import transformers_modules
ray.cloudpickle.register_pickle_by_value(transformers_modules)
print(FIX.probe(ray))
original = vars(ray)["init"].__wrapped__
mtp_overlay.uninstall(only=["hf-modules-cache"])
assert vars(ray)["init"] is original
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env=clean_env(HF_MODULES_CACHE=str(tmp_path / "modules")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    state_line, probe_line = proc.stdout.splitlines()
    assert "installed" in state_line and "by reference" in state_line
    assert "redundant" in probe_line and "by value" in probe_line
