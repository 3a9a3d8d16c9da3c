"""Write a set of file changes in site-packages all-or-nothing, also across processes and crashes.

- One writer at a time per site folder: an advisory lock (``flock``) on the folder itself, held from
  the survey to the last write, so concurrent ``patch apply`` runs (parallel image builds) serialize
  and the later one sees what the earlier one wrote. Nothing is left behind for it.
- Write-ahead journal: before the first write, every file's old bytes go to
  ``.mtp-overlay-patch.journal`` (written whole, then renamed into place); it is removed once every
  new file is on disk. A run killed in between leaves the journal, and the next run under the lock
  puts every file back from it before it looks at anything (`recover`).
- Each file is swapped in whole (``os.replace`` of a uniquely named temporary), through a symlink to
  the file it points at, so a symlinked module stays a symlink.
"""

import base64
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .gitapply import PatchError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

JOURNAL = ".mtp-overlay-patch.journal"


class RollbackError(PatchError):
    """A failed write could not be undone: the files named may be half-patched."""


class Change:
    """One file's old and new bytes (None: absent), and its timestamps to put back on rollback."""

    __slots__ = ("path", "old", "new", "times")

    def __init__(self, path: "str | os.PathLike[str]", old: "bytes | None", new: "bytes | None") -> None:
        self.path, self.old, self.new = Path(path), old, new
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            stat = None
        self.times = (stat.st_atime_ns, stat.st_mtime_ns) if stat and old is not None else None


@contextlib.contextmanager
def locked(folder: "str | os.PathLike[str]") -> "Iterator[None]":
    """Hold the site folder's patch lock for the block (blocks while another process holds it)."""
    import fcntl

    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def recover(folder: "str | os.PathLike[str]") -> "list[Path]":
    """Put back every file of an interrupted transaction in ``folder`` (hold its lock); the files
    restored, or [] when no journal was left."""
    journal = Path(folder) / JOURNAL
    try:
        entries = json.loads(journal.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    changes = [
        Change(entry["path"], None if entry["old"] is None else base64.b64decode(entry["old"]), None)
        for entry in entries
    ]
    _rollback(changes)
    journal.unlink()
    return [change.path for change in changes]


def commit(folder: "str | os.PathLike[str]", changes: "Sequence[Change]") -> None:
    """Write every change or none: on any failure, interrupts included, every file gets its old
    bytes back; a crash is undone by the next run's `recover`."""
    try:
        _write_journal(folder, changes)
        for change in changes:
            _put(change.path, change.new)
        for change in changes:
            if _read(change.path) != change.new:
                raise PatchError(f"{change.path}: the bytes read back differ from those written")
    except BaseException:
        _rollback(changes)
        (Path(folder) / JOURNAL).unlink(missing_ok=True)
        raise
    (Path(folder) / JOURNAL).unlink()


def stale_bytecode(path: Path) -> "list[Path]":
    """Cached bytecode of source ``path`` (``__pycache__/<stem>.*.pyc``)."""
    return sorted((path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"))


def _write_journal(folder: "str | os.PathLike[str]", changes: "Sequence[Change]") -> None:
    entries = [
        {"path": str(change.path), "old": None if change.old is None else base64.b64encode(change.old).decode()}
        for change in changes
    ]
    data = json.dumps(entries).encode()
    _put(Path(folder) / JOURNAL, data)
    if _read(Path(folder) / JOURNAL) != data:
        raise PatchError(f"{Path(folder) / JOURNAL}: the journal read back differs from the one written")


def _rollback(changes: "Sequence[Change]") -> None:
    failed = []
    for change in changes:
        try:
            if _read(change.path) != change.old:
                _put(change.path, change.old)
                if change.times:
                    os.utime(change.path, ns=change.times)
        except OSError as exc:
            failed.append(f"{change.path}: {exc}")
    if failed:
        raise RollbackError("rollback failed, these files may be half-patched: " + "; ".join(failed))


def _put(path: "str | os.PathLike[str]", data: "bytes | None") -> None:
    """Make ``path`` (a symlink: the file it points at) hold ``data`` (None: no file), swapped in whole."""
    path = Path(os.path.realpath(path))
    if data is None:
        path.unlink(missing_ok=True)
        return
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".mtp-overlay-tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            shutil.copymode(path, temporary)
        else:
            os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)


def _read(path: "str | os.PathLike[str]") -> "bytes | None":
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None
