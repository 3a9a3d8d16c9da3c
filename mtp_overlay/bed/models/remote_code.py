"""A tiny trust_remote_code model folder, and the stock round trip of its config through a Ray actor.

The failure hf-modules-cache fixes: cloudpickle ships the config class by reference, and a fresh Ray
worker cannot import ``transformers_modules``.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG_SOURCE = '''
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny-remote"

    def __init__(self, marker=0, **kwargs):
        self.marker = marker
        super().__init__(**kwargs)
'''

ROUND_TRIP = """
import sys
import mtp_overlay
import ray
from transformers import AutoConfig

config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[2], _node_ip_address="127.0.0.1")


@ray.remote(num_cpus=0)
class Reader:
    def __init__(self, config):
        self.marker = config.marker

    def marker(self):
        return self.marker


try:
    print("RESULT", ray.get(Reader.remote(config).marker.remote(), timeout=120))
except Exception as exc:
    print("RESULT", type(exc).__name__ + ":", [line for line in str(exc).splitlines() if line.strip()][-1].strip())
ray.shutdown()
"""


def write_remote_code_model(folder, marker=42):
    """A model folder whose config class lives in its own code (``auto_map``); returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "configuration_tiny_remote.py").write_text(CONFIG_SOURCE)
    auto_map = {"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig"}
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny-remote", "marker": marker, "auto_map": auto_map}))
    return folder


def ray_round_trip(overlay=True, timeout=300):
    """Load the tiny config with trust_remote_code, hand it to a Ray actor on a fresh local cluster
    and read it back, in a clean subprocess; returns what the driver printed after ``RESULT``.

    The driver leads a process group of its own, which the Ray processes it starts (gcs, raylet,
    workers) join: the whole group is killed when the call ends, on a timeout too, so none outlives it.
    """
    with tempfile.TemporaryDirectory(prefix="mtp-rt", dir="/tmp", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)  # short and private: Ray puts its unix sockets under _temp_dir
        model = write_remote_code_model(tmp / "model")
        cwd = tmp / "cwd"  # Ray puts the driver's cwd on workers' sys.path: keep it empty
        cwd.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MTP_OVERLAY_", "RAY_"))}
        env.update(HF_MODULES_CACHE=str(tmp / "modules"), RAY_AUTH_MODE="disabled")
        if not overlay:
            env["MTP_OVERLAY_DISABLE"] = "all"  # stock from the driver's start: no fix installed
        proc = subprocess.Popen([sys.executable, "-c", ROUND_TRIP, str(model), str(tmp / "ray")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            stdout, stderr = proc.communicate()
            raise RuntimeError(f"Ray round trip timed out after {timeout} s: {stderr[-2000:]}") from None
        finally:
            _kill_group(proc.pid)  # Ray processes the driver's ray.shutdown() left behind
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"Ray round trip printed no result (exit {proc.returncode}): {stderr[-2000:]}")
    return lines[-1][len("RESULT "):]


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone
