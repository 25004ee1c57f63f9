"""Artifact directories: where they are cached, and how they are written: whole or not at all, and
only ever replacing an artifact.

An artifact is written into a hidden staging directory beside its destination (same filesystem) and
renamed into place by `publish`, under an exclusive lock on the destination (`locked`: a
`.<name>.k3mk-lock` file beside it, kept). A destination that exists must be empty or a k3mk
artifact (its manifest.json and exactly the files it lists): anything else (a user's files, a
checkpoint, a half-written directory) is refused, never mixed with or overwritten. An artifact is
replaced as a whole: the old one is renamed aside, the new one renamed in, the old one removed.
Standard library only (the compile cache uses it on `k3mk compile`'s warm path).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import uuid
from importlib import metadata
from pathlib import Path
from typing import Iterator

from k3mk.runtime.schema import MANIFEST_FILE


CACHE_ENV = "K3MK_CACHE_DIR"


def cutlass_dsl_version() -> str:
    """The CuTe DSL an artifact is (or would be) compiled with (part of every cache key)."""
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_root() -> Path:
    """Where compiled kernels (kernels/) and whole artifacts (artifacts/) are cached: $K3MK_CACHE_DIR, or ~/.cache/k3mk."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "k3mk")


class ArtifactDirError(RuntimeError):
    """A destination that cannot take an artifact; the message names the directory and why."""


def artifact_files(directory: Path) -> list[str] | None:
    """The file names of the k3mk artifact in `directory` (manifest.json first), or None if it does not
    hold one (no readable manifest listing its files)."""
    try:
        files = json.loads((directory / MANIFEST_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, dict) or not all(isinstance(name, str) for name in files.values()):
        return None
    return [MANIFEST_FILE, *files.values()]


def check_destination(out: Path, option: str = "the destination") -> None:
    """Refuse `out` unless an artifact may be published there: absent (its parent then must be
    creatable and writable), empty, or a k3mk artifact and nothing else."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ArtifactDirError(f"{option} {out}: exists and is not a directory")
        entries = sorted(p.name for p in out.iterdir())
        listed = artifact_files(out)
        foreign = [e for e in entries if listed is None or e not in listed]
        if entries and foreign:
            what = "is not a k3mk artifact" if listed is None else "holds files that are not part of its k3mk artifact"
            raise ArtifactDirError(f"{option} {out}: {what} (e.g. '{foreign[0]}'); refusing to replace it: give a new or empty directory")
    writable_directory(out.parent, f"{option} {out}: its parent")


def writable_directory(path: Path, what: str) -> None:
    """Create `path` if needed and prove it writable by creating a file in it (os.access says yes to
    root even on a read-only filesystem)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ArtifactDirError(f"{what} {path} is not a writable directory ({e.strerror or e})") from None


_held: dict[Path, tuple[int, int]] = {}  # lock path -> (fd, depth): re-entered by the same process


@contextlib.contextmanager
def locked(out: Path, wait: bool = True) -> Iterator[None]:
    """An exclusive lock on destination `out` for this process (re-entrant); another process holding
    it makes this wait, or with `wait=False` raise ArtifactDirError at once."""
    path = (out.parent / f".{out.name}.k3mk-lock").resolve()  # one key however `out` is spelled
    if path in _held:
        fd, depth = _held[path]
        _held[path] = (fd, depth + 1)
        try:
            yield
        finally:
            _held[path] = (fd, _held[path][1] - 1)
        return
    writable_directory(out.parent, f"{out}: its parent")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise ArtifactDirError(f"{out}: another k3mk process is writing it (lock {path}); wait for it or choose another directory") from None
        _held[path] = (fd, 1)
        try:
            yield
        finally:
            del _held[path]
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh hidden directory beside `out` to write an artifact into; removed afterwards unless
    `publish` moved it into place."""
    writable_directory(out.parent, f"{out}: its parent")
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.k3mk-new-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o777 & ~umask)  # mkdtemp's 0700 would make the published artifact private
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def publish(staged: Path, out: Path) -> Path:
    """Move the complete artifact `staged` to `out` (check_destination's rules), atomically for
    readers of a new `out`; an old artifact at `out` is replaced as a whole."""
    with locked(out):
        check_destination(out)
        if not out.exists() or not any(out.iterdir()):
            os.replace(staged, out)  # rename(2) onto an empty directory replaces it
            return out
        aside = out.parent / f".{out.name}.k3mk-old-{uuid.uuid4().hex[:8]}"
        os.rename(out, aside)
        try:
            os.rename(staged, out)
        except BaseException:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    return out


def install(entry: Path, out: Path) -> Path:
    """Publish a copy of the artifact `entry` (a compile-cache entry) at `out`."""
    names = artifact_files(entry)
    if names is None:
        raise ArtifactDirError(f"{entry}: not a k3mk artifact")
    with staging(out) as staged:
        for name in names:
            shutil.copyfile(entry / name, staged / name)
        return publish(staged, out)
