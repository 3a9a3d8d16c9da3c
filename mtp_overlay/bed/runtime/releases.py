"""Other upstream releases side by side with the venv's, cheaply: ``pip install --no-deps --target``.

Each release lands once in its own folder under the cache (``MTP_OVERLAY_RELEASES``, default
``~/.cache/mtp-overlay/releases``) and shares the venv's torch and every other dependency. Import it
in a subprocess whose ``PYTHONPATH`` puts that folder first.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def cache_root():
    default = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "mtp-overlay" / "releases"
    return Path(os.environ.get("MTP_OVERLAY_RELEASES", default))


def release_site(distribution, version):
    """Folder holding ``distribution==version`` alone, installed on first use."""
    target = cache_root() / f"{distribution}-{version}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{distribution}-{version}-", dir=target.parent))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
             "--target", str(staging), f"{distribution}=={version}"],
            check=True,
        )
        (staging / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def run_with_release(site, code, env=None, timeout=600, cwd=None, fixes=None):
    """Run ``python -c code`` (in ``cwd``) with ``site`` first on the path, forked from the preloaded
    server (torch already imported); returns the CompletedProcess.

    fixes: None, what ``import mtp_overlay`` installs there; a list, a stock interpreter with exactly
    those fixes installed (``[]``: none); see `preloaded.run_python`.
    """
    from .preloaded import run_python

    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environment.get("PYTHONPATH")]))
    return run_python(code, environment, timeout, cwd=cwd, fixes=fixes)


def installed_site(distribution):
    """The folder the running interpreter's ``distribution`` is installed in (its files are relative to it)."""
    from importlib import metadata

    return Path(metadata.distribution(distribution).locate_file(""))


def release_copy(distribution, version, destination):
    """A private copy (in ``destination``) of ``distribution==version``: the venv's install when that
    is the version, else the side-by-side release (`release_site`)."""
    from importlib import metadata

    site = None if metadata.version(distribution) == version else release_site(distribution, version)
    return copy_installed(distribution, destination, site=site)


def run_json(site, code, env=None, timeout=600, fixes=None):
    """`run_with_release` of ``code``, which prints a JSON line last: that line, parsed (AssertionError
    with the child's stderr when it fails)."""
    import json

    result = run_with_release(site, code, env=env, timeout=timeout, fixes=fixes)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def edited_module(module, *edits):
    """A copy of an installed upstream ``module`` built from its own source with ``(old, new)`` edits,
    not put in sys.modules: the release as upstream might change it."""
    import types

    source = Path(module.__file__).read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    copy = types.ModuleType(module.__name__)
    copy.__file__ = module.__file__
    exec(compile(source, module.__file__, "exec"), copy.__dict__)
    return copy


def record_sha256(distribution, site):
    """{file: sha256} from the RECORD of ``distribution`` in folder ``site``: the hashes its wheel ships."""
    import base64
    from importlib import metadata

    dist = next(iter(metadata.distributions(name=distribution, path=[str(site)])))
    return {
        str(file): base64.urlsafe_b64decode(file.hash.value + "==").hex()
        for file in dist.files or ()
        if file.hash is not None and file.hash.mode == "sha256"
    }


def copy_installed(distribution, destination, site=None):
    """Copy an installed distribution (its packages and dist-info) into ``destination``.

    ``site`` selects a folder made by `release_site`; by default the running interpreter's install.
    Returns ``destination``: a private copy to patch or break without touching the real one.
    """
    from importlib import metadata

    found = metadata.distributions(name=distribution, **({"path": [str(site)]} if site else {}))
    dist = next(iter(found), None)
    if dist is None:
        raise ValueError(f"distribution {distribution!r} is not installed{f' in {site}' if site else ''}")
    root = Path(dist.locate_file(""))
    destination = Path(destination)
    for top in sorted({Path(f).parts[0] for f in dist.files or ()}):
        source = root / top
        if source.is_dir() and top != "..":
            shutil.copytree(source, destination / top, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def link_installed(distribution, destination, site=None, copies=()):
    """Like `copy_installed`, but every file is a hard link (a copy across filesystems) except those
    in ``copies`` (paths relative to the site), which are real copies: a private vLLM (~900 MB) in
    seconds. Safe to patch: `mtp-overlay patch` swaps files in whole (``os.replace``), never writes
    through a link, and Python writes bytecode the same way."""
    import os
    from importlib import metadata

    found = metadata.distributions(name=distribution, **({"path": [str(site)]} if site else {}))
    dist = next(iter(found), None)
    if dist is None:
        raise ValueError(f"distribution {distribution!r} is not installed{f' in {site}' if site else ''}")
    root, destination = Path(dist.locate_file("")), Path(destination)
    copies = {Path(path) for path in copies}

    def place(source, target):
        if Path(os.path.relpath(source, root)) in copies:
            return shutil.copy2(source, target)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        return target

    for top in sorted({Path(f).parts[0] for f in dist.files or ()}):
        source = root / top
        if source.is_dir() and top != "..":
            shutil.copytree(source, destination / top, dirs_exist_ok=True, copy_function=place)
    return destination


SNAPSHOT_FILE = "SNAPSHOT.json"  # commit, short, date, version, source of a source snapshot's folder


def megatron_main_site(git_dir, destination_root, commit="HEAD"):
    """Megatron-LM ``commit`` (default: the checkout's HEAD) as an importable site: its
    ``megatron/core`` package, a ``megatron_core`` dist-info, and ``SNAPSHOT.json``.

    ``git_dir``: a Megatron-LM git directory (a bare mirror needs no work tree). The folder is
    ``destination_root/<short commit>``, made once. The dist-info's version is what
    ``megatron/core/package_info.py`` reports in a git checkout, ``<major.minor.patch><pre>+<short
    commit>``: a PEP 440 local version no release on an index can carry, so a main row never passes
    for a pinned release. Put the folder first on ``PYTHONPATH`` and ``megatron.core`` and
    ``importlib.metadata.version("megatron-core")`` answer from it.
    """
    return _source_snapshot(git_dir, destination_root, commit, "megatron-core", "", "megatron/core")


def bridge_main_site(git_dir, destination_root, commit="HEAD"):
    """Megatron-Bridge ``commit`` (default: HEAD) as an importable site, as `megatron_main_site` makes
    Megatron-LM's: its ``src/megatron/bridge`` package as ``megatron/bridge``, a ``megatron_bridge``
    dist-info of version ``<package_info version>+<short commit>`` (what ``package_info.py``
    reports in a git checkout), and ``SNAPSHOT.json``. megatron-core stays the venv's."""
    return _source_snapshot(git_dir, destination_root, commit, "megatron-bridge", "src", "megatron/bridge")


def _source_snapshot(git_dir, destination_root, commit, distribution, root, package):
    """The folder ``destination_root/<short commit>`` holding ``package`` (a path below ``root`` in
    the tree of ``commit`` of ``git_dir``), its dist-info and SNAPSHOT.json; made once."""
    import ast
    import json

    def git(*args):
        return subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        full, date = git("log", "-1", "--format=%H %cs", commit).split()
    except subprocess.CalledProcessError as exc:
        raise ValueError(f"git_dir: {git_dir} has no commit {commit!r}: {exc.stderr.strip()}") from None
    short = git("rev-parse", "--short", full)
    target = Path(destination_root) / short
    if (target / SNAPSHOT_FILE).exists():
        return target
    tree = f"{full}:{root}" if root else full
    names = {}
    for node in ast.parse(git("show", f"{full}:{root + '/' if root else ''}{package}/package_info.py")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    version = f"{names['MAJOR']}.{names['MINOR']}.{names['PATCH']}{names['PRE_RELEASE']}+{short}"
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{short}-", dir=target.parent))
    try:
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", tree, package],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(staging)], input=archive, check=True)
        info = staging / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        (info / "top_level.txt").write_text("megatron\n")
        (info / "INSTALLER").write_text("mtp-overlay source snapshot\n")
        snapshot = dict(commit=full, short=short, date=date, version=version, source=str(git_dir))
        (staging / SNAPSHOT_FILE).write_text(json.dumps(snapshot, indent=1) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def snapshot_of(site):
    """The SNAPSHOT.json of a `megatron_main_site` folder as a dict, or None for any other folder."""
    import json

    found = Path(site) / SNAPSHOT_FILE
    return json.loads(found.read_text()) if found.exists() else None
