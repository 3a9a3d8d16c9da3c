"""Apply a patch to bytes in memory with ``git apply``, on a scratch copy outside any repository,
so no .orig/.rej file ever lands in site-packages and an enclosing repository is never mistaken
for the tree."""

import os
import subprocess
import tempfile
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    Files = dict[str, "bytes | None"]  # relative path -> its bytes, None: absent


class PatchError(RuntimeError):
    """A patch could not be applied or reverted; every file was left (or put back) as it was."""


class GitMissing(PatchError):
    """``git`` is not on PATH: nothing can be decided about any patch."""


def git_apply(patch: "str | os.PathLike[str]", current: "Mapping[str, bytes | None]",
              reverse: bool = False) -> "tuple[Files | None, str]":
    """``(files, "")``: what ``patch`` makes of ``current`` ({relative path: bytes or None}), or
    ``(None, git's error)`` when it does not apply."""
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-patch-") as scratch:
        tree = Path(scratch, "tree")
        tree.mkdir()
        for file, data in current.items():
            if data is not None:
                (tree / file).parent.mkdir(parents=True, exist_ok=True)
                (tree / file).write_bytes(data)
        command = ["git", "apply", "--whitespace=nowarn", *(["--reverse"] if reverse else []), str(Path(patch).resolve())]
        env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
        env["GIT_CEILING_DIRECTORIES"] = scratch
        try:
            result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        except FileNotFoundError:
            raise GitMissing("git not found on PATH: `mtp-overlay patch` applies patches with `git apply` "
                             "(install git)") from None
        if result.returncode != 0:
            return None, result.stderr.strip()
        return {file: _read(tree / file) for file in current}, ""


def _read(path: Path) -> "bytes | None":
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
