"""The process-startup hook: install/uninstall/status, and real interpreters starting with it."""

import os
import pathlib
import site
import subprocess
import sys

import pytest

from mtp_overlay import cli, startup

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_install_is_idempotent_and_uninstall_leaves_nothing(tmp_path):
    (tmp_path / "other.pth").write_text("/somewhere\n")
    before = sorted(os.listdir(tmp_path))
    path = startup.install(tmp_path)
    assert path == str(tmp_path / startup.PTH_NAME)
    assert pathlib.Path(path).read_text() == startup.PTH_TEXT
    first = os.stat(path)
    assert startup.install(tmp_path) == path
    again = os.stat(path)
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # left untouched
    assert sorted(os.listdir(tmp_path)) == sorted(before + [startup.PTH_NAME])  # no temporary left over
    assert startup.status(tmp_path) == {"installed": True, "current": True, "path": path}
    assert startup.uninstall(tmp_path) == path
    assert sorted(os.listdir(tmp_path)) == before
    assert startup.uninstall(tmp_path) is None
    assert startup.status(tmp_path) == {"installed": False, "current": False, "path": path}


def test_outdated_file_is_reported_and_rewritten(tmp_path):
    stale = tmp_path / startup.PTH_NAME
    stale.write_text("import mtp_overlay\n")
    assert startup.status(tmp_path)["current"] is False
    startup.install(tmp_path)
    assert stale.read_text() == startup.PTH_TEXT


def test_missing_site_packages_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="site_packages: .* is not an existing directory"):
        startup.install(tmp_path / "missing")


def test_default_is_a_site_directory_of_this_interpreter():
    folder = os.path.dirname(startup.status()["path"])
    assert folder in site.getsitepackages()


def test_cli(tmp_path, capsys):
    assert cli.main(["startup-hook", "status", "--site-packages", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"not installed: {tmp_path / startup.PTH_NAME}\n"
    assert cli.main(["startup-hook", "install", "--site-packages", str(tmp_path)]) == 0
    assert cli.main(["startup-hook", "install", "--site-packages", str(tmp_path)]) == 0
    assert cli.main(["startup-hook", "status", "--site-packages", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"installed: {tmp_path / startup.PTH_NAME}"] * 3
    assert cli.main(["startup-hook", "uninstall", "--site-packages", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"removed: {tmp_path / startup.PTH_NAME}\n"
    assert os.listdir(tmp_path) == []
    assert cli.main(["startup-hook", "install", "--site-packages", str(tmp_path / "nope")]) == 2
    assert "is not an existing directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A new virtual environment (no pip); returns (python, site-packages)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    return python, pathlib.Path(site_packages)


def _start(python, *code):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MTP_OVERLAY_DISABLE")}
    return subprocess.run([str(python), "-c", *code], capture_output=True, text=True, env=env, timeout=60)


def test_every_interpreter_of_the_environment_imports_the_overlay_first(fresh_venv):
    python, site_packages = fresh_venv
    source = site_packages / "_mtp_source.pth"  # sorts before ours: makes this checkout importable
    source.write_text(f"{REPO}\n")
    probe = "import sys; print('mtp_overlay' in sys.modules, getattr(sys.modules.get('mtp_overlay'), '__file__', None))"
    try:
        assert _start(python, probe).stdout.startswith("False")  # nothing without the hook
        startup.install(site_packages)
        started = _start(python, probe)
        assert started.returncode == 0 and started.stderr == ""
        assert started.stdout.split() == ["True", str(REPO / "mtp_overlay" / "__init__.py")]
        # a child of a child: each interpreter of the environment runs the hook by itself
        nested = _start(python, f"import subprocess, sys; subprocess.run([sys.executable, '-c', {probe!r}])")
        assert nested.stdout.startswith("True")
        startup.uninstall(site_packages)
        assert _start(python, probe).stdout.startswith("False")
    finally:
        startup.uninstall(site_packages)
        source.unlink()


@pytest.mark.parametrize(
    ("raised", "line"),
    [
        ("RuntimeError('overlay is broken')", "RuntimeError: overlay is broken"),
        ("SystemExit('overlay exits')", "SystemExit: overlay exits"),
        ("ValueError('first line\\n  second line')", "ValueError: first line second line"),
    ],
    ids=["exception", "system-exit", "multi-line"],
)
def test_a_broken_overlay_costs_one_line_once_never_the_interpreter(fresh_venv, tmp_path, raised, line):
    """Anything but Ctrl-C out of `import mtp_overlay` (SystemExit included) leaves the interpreter
    running with one line on stderr, once per process, although a venv whose lib64 links to lib
    runs every .pth twice."""
    python, site_packages = fresh_venv
    broken = tmp_path / "mtp_overlay"
    broken.mkdir()
    (broken / "__init__.py").write_text(f"raise {raised}\n")
    source = site_packages / "_mtp_source.pth"
    source.write_text(f"{tmp_path}\n")
    try:
        startup.install(site_packages)
        started = _start(python, "print('alive')")
        assert started.returncode == 0 and started.stdout == "alive\n"
        assert started.stderr.splitlines() == [
            f"mtp-overlay startup hook: import mtp_overlay failed ({line}); continuing without it"
        ]
    finally:
        startup.uninstall(site_packages)
        source.unlink()


def test_the_venv_runs_site_packages_pth_files_twice(fresh_venv):
    """Why "once per process" needs its own guard: CPython's site runs a venv's .pth files from both
    lib and its lib64 link."""
    python, site_packages = fresh_venv
    counter = site_packages / "_count.pth"
    counter.write_text("import sys; sys._mtp_pth_runs = getattr(sys, '_mtp_pth_runs', 0) + 1\n")
    try:
        runs = _start(python, "import sys; print(sys._mtp_pth_runs)").stdout.strip()
        lib64 = site_packages.parents[2] / "lib64"
        assert runs == ("2" if lib64.is_symlink() else "1")
    finally:
        counter.unlink()
