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


def run_with_release(site, code, env=None, timeout=600):
    """Run ``python -c code`` with ``site`` first on the path; returns the CompletedProcess."""
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environment.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=timeout
    )


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


def run_json(site, code, env=None, timeout=600):
    """`run_with_release` of ``code``, which prints a JSON line last: that line, parsed (AssertionError
    with the child's stderr when it fails)."""
    import json

    result = run_with_release(site, code, env=env, timeout=timeout)
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
