"""`k3mk compile --out` caches whole artifacts (compiler/artifact_cache.py): a cold compile builds the
cache entry and copies it to --out; a warm one, from the shell, copies it without torch, CuTe DSL or
the pipeline and prints the same summary; the key moves with everything that shapes the artifact;
--out has one writer at a time; SIGTERM ends the CuTe compile worker and leaves no temporary files."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3mk.codegen import artifact_dir
from k3mk.compiler import artifact_cache
from k3mk.compiler.artifact_cache import CompileOptions, cache_key, usable
from k3mk.compiler.cli import main
from k3mk.compiler.config import load_config
from k3mk.runtime.manifest import load_manifest

COMPILE = ["compile", "--model", "k3-tiny", "--max-context", "64"]  # test_emit_models builds the same kernel
WARM_LIMIT_S = 3.0  # the whole warm command in a fresh interpreter; measured 0.25 s on the 2-core build machine


def entries(env: dict) -> list[Path]:
    """The artifact cache's entries (beside them: their lock files)."""
    return [p for p in (Path(env["K3MK_CACHE_DIR"]) / "artifacts").iterdir() if p.is_dir()]


def shell(*argv: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3mk.compiler.cli", *argv], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One cold compile through the CLI. The artifacts cache is this module's own; the kernels cache is
    the default one (content-keyed), so the CuTe compile is shared with the other k3-tiny builds."""
    pytest.importorskip("cutlass", reason="building an artifact needs nvidia-cutlass-dsl (the compile extra)")
    root = tmp_path_factory.mktemp("cache")
    kernels = Path(os.environ.get("K3MK_CACHE_DIR") or Path.home() / ".cache" / "k3mk") / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (root / "kernels").symlink_to(kernels)
    env = {**os.environ, "K3MK_CACHE_DIR": str(root)}
    out = root.parent / "cold-out"
    proc = shell(*COMPILE, "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    return env, out, proc


def test_cold_compile_fills_the_cache(cold):
    env, out, proc = cold
    assert "k3mk: build:" in proc.stderr and "cached:" not in proc.stderr
    assert proc.stdout.endswith(f"artifact: {out}\n") and "decode state per rank:" in proc.stdout
    (entry,) = entries(env)
    assert usable(entry)
    m = load_manifest(out)
    m.check_files()
    assert {p.name for p in out.iterdir()} == {p.name for p in entry.iterdir()}
    assert (out / "compile_summary.txt").read_text() == proc.stdout.removesuffix(f"artifact: {out}\n")


def test_warm_compile_from_the_shell(cold, tmp_path):
    """The whole command in a fresh interpreter: no torch, no CuTe DSL, no pipeline; the same summary."""
    env, _, proc = cold
    out = tmp_path / "warm-out"
    script = (
        "import sys; from k3mk.compiler.cli import main; status = main(sys.argv[1:]); "
        "heavy = [m for m in ('torch', 'cutlass', 'networkx', 'k3mk.compiler.pipeline', 'k3mk.passes') if m in sys.modules]; "
        "assert not heavy, heavy; sys.exit(status)"
    )
    start = time.perf_counter()
    warm = subprocess.run([sys.executable, "-c", script, *COMPILE, "--out", str(out)], env=env, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert warm.returncode == 0, warm.stderr
    assert "k3mk: cached:" in warm.stderr and "capture" not in warm.stderr
    assert warm.stdout.replace(str(out), "OUT") == proc.stdout.replace(str(cold[1]), "OUT")
    load_manifest(out).check_files()
    assert seconds < WARM_LIMIT_S, f"warm compile took {seconds:.2f} s"


def test_a_damaged_entry_is_not_used(cold, tmp_path):
    env, _, _ = cold
    (entry,) = entries(env)
    copy = tmp_path / "entry"
    artifact_dir.install(entry, copy)
    assert usable(copy)
    schedule = copy / "schedule.txt"
    schedule.write_text(schedule.read_text().replace("wait", "w8t", 1))
    assert not usable(copy)
    (copy / "compile_summary.txt").unlink()
    assert not usable(copy) and not usable(tmp_path)


def test_the_key_covers_everything_that_shapes_the_artifact(monkeypatch):
    config = load_config("k3-tiny")
    base = CompileOptions(tp=1, max_tokens=1, max_context=64, arch="sm_90a")
    key = cache_key(config, base)
    assert key == cache_key(config, base) == cache_key(config.replace(source="elsewhere/config.json"), base)
    others = [CompileOptions(2, 1, 64, "sm_90a"), CompileOptions(1, 2, 64, "sm_90a"), CompileOptions(1, 1, 65, "sm_90a"),
              CompileOptions(1, 1, 64, "sm_100a"), CompileOptions(1, 1, 64, "sm_90a", profile=True),
              CompileOptions(1, 1, 64, "sm_90a", kernel_options=(("slot_bytes", 32768),))]  # fmt: skip
    keys = {cache_key(config, o) for o in others} | {cache_key(config.replace(rms_norm_eps=1e-5 * 1.5), base), cache_key(config.replace(name="x"), base)}
    assert key not in keys and len(keys) == len(others) + 2
    monkeypatch.setattr(artifact_cache, "cutlass_dsl_version", lambda: "4.9.0")
    assert cache_key(config, base) != key
    monkeypatch.undo()
    monkeypatch.setattr(artifact_cache, "source_digest", lambda: "0" * 64)  # a pass changed, the version string did not
    assert cache_key(config, base) != key


def test_source_digest_follows_the_sources(tmp_path, monkeypatch):
    import k3mk

    digest = artifact_cache.source_digest()
    assert len(digest) == 64 and digest == artifact_cache.source_digest()
    fake_root = tmp_path / "k3mk"
    for package in artifact_cache.SOURCE_PACKAGES:
        (fake_root / package).mkdir(parents=True)
        (fake_root / package / "a.py").write_text(package)
    (fake_root / "__init__.py").write_text("")
    monkeypatch.setattr(k3mk, "__file__", str(fake_root / "__init__.py"))
    artifact_cache.source_digest.cache_clear()
    try:
        first = artifact_cache.source_digest()
        artifact_cache.source_digest.cache_clear()
        (fake_root / "passes" / "a.py").write_text("passes, changed")
        assert artifact_cache.source_digest() != first
        artifact_cache.source_digest.cache_clear()
        (fake_root / "passes" / "notes.txt").write_text("not a source")
        (fake_root / "passes" / "a.py").write_text("passes")
        assert artifact_cache.source_digest() == first
    finally:
        artifact_cache.source_digest.cache_clear()


def test_one_writer_per_out(capsys, tmp_path, monkeypatch):
    """Two compiles into one --out: the second is refused at once instead of both 'succeeding'."""
    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    fd = os.open(tmp_path / ".out.k3mk-lock", os.O_RDWR | os.O_CREAT)  # what the other compile holds
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        assert main([*COMPILE, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"k3mk: error: {out}: another k3mk process is writing it" in err and time.monotonic() - start < 5
    finally:
        os.close(fd)
    assert not out.exists()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker through /proc (Linux)")
def test_sigterm_ends_the_worker_and_cleans_up(tmp_path):
    pytest.importorskip("cutlass", reason="the CuTe compile worker needs nvidia-cutlass-dsl")
    env = {**os.environ, "K3MK_CACHE_DIR": str(tmp_path / "cache")}  # cold: the worker must run
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "k3mk.compiler.cli", *COMPILE, "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        worker = None
        while worker is None and time.monotonic() < deadline and proc.poll() is None:
            for child in _children(proc.pid):
                try:
                    if b"k3mk.codegen.compile_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                        worker = child
                except OSError:
                    pass
            time.sleep(0.1)
        assert worker is not None, "the compile worker never started"
        time.sleep(1.0)  # inside the CuTe compile
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and err.rstrip().endswith("k3mk: terminated"), err
    assert not Path(f"/proc/{worker}").exists(), "the CuTe compile worker outlived the compile"
    kernels, artifacts = tmp_path / "cache" / "kernels", tmp_path / "cache" / "artifacts"
    assert [p.name for p in kernels.iterdir() if ".tmp-" in p.name] == []
    assert [p.name for p in artifacts.iterdir() if not p.name.endswith(".k3mk-lock")] == []
    assert [p.name for p in tmp_path.iterdir() if ".k3mk-new-" in p.name] == [] and not out.exists()
