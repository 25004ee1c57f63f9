"""Artifact directories are written whole or not at all and only ever replace an artifact
(codegen/artifact_dir.py), through the build's own writer (fake_artifact: no CuTe DSL needed)."""

from __future__ import annotations

import fcntl
import os
import random
import sys
from pathlib import Path

import pytest

from k3mk.codegen import artifact_dir, build as build_module
from k3mk.codegen.artifact_dir import ArtifactDirError, install, locked
from k3mk.runtime.manifest import load_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from fake_artifact import fake_artifact  # noqa: E402


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def leftovers(parent: Path) -> list[str]:
    """Staging and set-aside directories that a finished write must not leave behind."""
    return [p.name for p in parent.iterdir() if ".k3mk-new-" in p.name or ".k3mk-old-" in p.name]


def test_new_empty_and_replaced(tmp_path):
    fresh = fake_artifact(tmp_path / "a" / "b" / "new")  # parents are created
    load_manifest(fresh).check_files()
    empty = tmp_path / "empty"
    empty.mkdir()
    load_manifest(fake_artifact(empty)).check_files()
    # an sm_100a artifact replaced by an sm_90a one: not one file of the old one stays beside the new
    out = fake_artifact(tmp_path / "out", arch="sm_100a")
    assert "megakernel.sm_100a.cubin" in names(out)
    fake_artifact(out, arch="sm_90a")
    m = load_manifest(out)
    m.check_files()
    assert m["arch"] == "sm_90a" and names(out) == {"manifest.json", *m["files"].values()}
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("foreign", ["notes.txt", "model.safetensors", ".hidden"])
def test_a_directory_with_other_files_is_refused_and_left_alone(tmp_path, foreign):
    out = fake_artifact(tmp_path / "out", arch="sm_100a")
    blob = random.Random(foreign).randbytes(64)
    (out / foreign).write_bytes(blob)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ArtifactDirError, match=f"holds files that are not part of its k3mk artifact \\(e.g. '{foreign}'\\); refusing"):
        fake_artifact(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    user = tmp_path / "user"
    user.mkdir()
    (user / foreign).write_bytes(blob)
    with pytest.raises(ArtifactDirError, match="is not a k3mk artifact"):
        fake_artifact(user)
    assert names(user) == {foreign} and not leftovers(tmp_path)


def test_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ArtifactDirError, match="exists and is not a directory"):
        fake_artifact(path)


def test_a_failed_write_leaves_the_old_artifact(tmp_path, monkeypatch):
    out = fake_artifact(tmp_path / "out", arch="sm_100a")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build_module.schema, "file_sha256", failing)
    with pytest.raises(OSError, match="No space left"):
        fake_artifact(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not leftovers(tmp_path)


def test_a_destination_another_process_writes_is_refused(tmp_path):
    out = tmp_path / "out"
    # another process's lock: flock on a second open file description conflicts like another process
    fd = os.open(tmp_path / ".out.k3mk-lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ArtifactDirError, match="another k3mk process is writing it"):
            with locked(out, wait=False):
                pass
    finally:
        os.close(fd)
    with locked(out, wait=False), locked(out):  # free again; re-entrant within one process
        fake_artifact(out)
    load_manifest(out).check_files()


def test_install_copies_a_whole_entry(tmp_path):
    entry = fake_artifact(tmp_path / "cache-entry")
    out = fake_artifact(tmp_path / "out", arch="sm_103a")
    install(entry, out)
    m = load_manifest(out)
    m.check_files()
    assert m["arch"] == "sm_90a" and names(out) == names(entry)
    assert all(os.stat(out / n).st_ino != os.stat(entry / n).st_ino for n in names(entry))  # copies, not links
    with pytest.raises(ArtifactDirError, match="not a k3mk artifact"):
        install(tmp_path, tmp_path / "other")


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "c"))
    assert artifact_dir.cache_root() == tmp_path / "c"
    monkeypatch.delenv("K3MK_CACHE_DIR")
    assert artifact_dir.cache_root() == Path.home() / ".cache" / "k3mk"
