"""Build an artifact: task table -> CuTe DSL source -> cubin for one arch -> artifact directory.

Artifact directory (read by k3mk.runtime, which checks manifest.json against the device):
  manifest.json            format versions, arch, SM count, block size, smem, kernel name, the
                           kernel parameter ABI, buffer / weight tables, file names, resource usage
  megakernel.<arch>.cubin  the kernel (loaded with cuModuleLoadData)
  megakernel.<arch>.ptx    for reading
  megakernel.py            the generated CuTe DSL source
  task_table.bin           docs/task_table.md

Compiles run GPU-blind in a subprocess per arch (CUTE_DSL_ARCH is read once at import) and are
cached by a content key (source, arch, CuTe DSL and k3mk versions) under $K3MK_CACHE_DIR or
~/.cache/k3mk: entries are written to a temporary directory and renamed into place under a per-key
file lock, and an entry whose files do not match its recorded hash is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from k3mk import __version__ as K3MK_VERSION
from k3mk.codegen.emit import dynamic_smem_bytes, emit_source
from k3mk.codegen.ops import KernelConfig, ring_layout
from k3mk.ir import task_table as tt
from k3mk.ir.task_table import RingModel, TaskTable
from k3mk.runtime import abi

MANIFEST_VERSION = 1
ARCH_SM_COUNT = {"sm_90a": 132, "sm_100a": 148}  # H100/H200 SXM, B200
ARCH_COMPUTE_CAPABILITY = {"sm_90a": (9, 0), "sm_100a": (10, 0)}
MAX_SMEM = {"sm_90a": 232448, "sm_100a": 232448}


class BuildError(RuntimeError):
    pass


def cutlass_dsl_version() -> str:
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_dir() -> Path:
    return Path(os.environ.get("K3MK_CACHE_DIR") or Path.home() / ".cache" / "k3mk")


def compile_source(source: str, arch: str, *, use_cache: bool = True, timeout: float = 1800) -> tuple[Path, dict]:
    """Compile `source` for `arch`; returns (directory with megakernel.<arch>.cubin/.ptx, info)."""
    if arch not in ARCH_SM_COUNT:
        raise BuildError(f"unknown arch {arch!r}; known: {sorted(ARCH_SM_COUNT)}")
    key = hashlib.sha256(
        json.dumps([source, arch, cutlass_dsl_version(), K3MK_VERSION, abi.ABI_VERSION]).encode()
    ).hexdigest()[:32]
    root = cache_dir() / "kernels" if use_cache else Path(tempfile.mkdtemp(prefix="k3mk-build-"))
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    with _locked(root / f"{key}.lock"):
        info = _valid_entry(entry, arch) if use_cache else None
        if info is not None:
            return entry, {**info, "cache_hit": True}
        shutil.rmtree(entry, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root))
        try:
            info = _run_worker(source, arch, tmp, timeout)
            info["cubin_sha256"] = hashlib.sha256((tmp / f"megakernel.{arch}.cubin").read_bytes()).hexdigest()
            (tmp / "info.json").write_text(json.dumps(info, indent=1))
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, {**info, "cache_hit": False}


def _run_worker(source: str, arch: str, out: Path, timeout: float) -> dict:
    (out / "megakernel.py").write_text(source)
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "k3mk.codegen.compile_worker", str(out / "megakernel.py"), arch, str(out)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BuildError(f"CuTe DSL compile for {arch} failed (exit {proc.returncode}):\n{log[-6000:]}")
    info = json.loads((out / "info.json").read_text())
    info["wall_seconds"] = round(wall, 3)
    info.update(_ptxas_resources(log))
    return info


def _ptxas_resources(log: str) -> dict:
    out = {}
    if m := re.search(r"Used (\d+) registers", log):
        out["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        out["stack_bytes"], out["spill_store_bytes"], out["spill_load_bytes"] = map(int, m.groups())
    return out


def _valid_entry(entry: Path, arch: str) -> dict | None:
    try:
        info = json.loads((entry / "info.json").read_text())
        cubin = (entry / f"megakernel.{arch}.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if info.get("arch") != arch or hashlib.sha256(cubin).hexdigest() != info.get("cubin_sha256"):
        return None
    return info


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(
    table: TaskTable,
    out_dir: str | os.PathLike,
    *,
    arch: str = "sm_90a",
    sm_count: int | None = None,
    config: KernelConfig = KernelConfig(),
    use_cache: bool = True,
    check: bool = True,
    meta: dict | None = None,
    extra_files: dict[str, str | bytes] | None = None,
) -> Path:
    """Write the artifact directory for `table` and return its path. `check=False` skips the task
    table's validation (only for planted-fault tests: a table that deadlocks on purpose). `meta`: more
    manifest fields (the compiler's: model, TP degree, max tokens / context, weight format, ...);
    `extra_files`: {role: text} written as files named by role (IR and schedule dumps), listed in "files"."""
    sm_count = sm_count or ARCH_SM_COUNT.get(arch, 0)
    if len(table.lists) > sm_count:
        raise BuildError(f"{len(table.lists)} task lists but the target has {sm_count} SMs (one CTA per SM)")
    encoded = table.encode(check=check)
    ring = ring_layout(table.variants, config)
    if check:  # the streaming loop's producers and rings as this kernel builds them
        table.check_deadlock_free(ring=RingModel(ring.slots, ring.records, config.warps, ring.slot_bytes))
    source = emit_source(table.variants, config)
    smem = dynamic_smem_bytes(table.variants, config)
    if smem > MAX_SMEM[arch]:
        raise BuildError(f"{smem} B of shared memory exceeds {MAX_SMEM[arch]} B on {arch}")
    kernel_dir, info = compile_source(source, arch, use_cache=use_cache)
    expected_name = f"{config.kernel_name}_0"
    if info["kernel_names"] != [expected_name]:
        raise BuildError(f"kernel symbols {info['kernel_names']}, expected [{expected_name!r}]")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # written last: its presence marks a complete artifact
    cubin_name = f"megakernel.{arch}.cubin"
    shutil.copyfile(kernel_dir / cubin_name, out / cubin_name)
    shutil.copyfile(kernel_dir / f"megakernel.{arch}.ptx", out / f"megakernel.{arch}.ptx")
    (out / "megakernel.py").write_text(source)
    (out / "task_table.bin").write_bytes(encoded)
    header = tt.read_header(encoded)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "abi_version": abi.PROFILE_ABI_VERSION if config.profile else abi.ABI_VERSION,
        "task_table_format": tt.FORMAT_VERSION,
        "k3mk_version": K3MK_VERSION,
        "cutlass_dsl_version": cutlass_dsl_version(),
        "arch": arch,
        "compute_capability": list(ARCH_COMPUTE_CAPABILITY[arch]),
        "sm_count": sm_count,
        "num_ctas": len(table.lists),
        "block_threads": config.block_threads,
        "ring": {"slots": ring.slots, "slot_bytes": ring.slot_bytes, "records": ring.records, "barrier_offset": ring.barrier_offset},
        "dynamic_smem_bytes": smem,
        "debug": config.debug,
        "profile": config.profile,
        "kernel_name": expected_name,
        "params": abi.params_json(),
        "control_words": abi.CONTROL_WORDS,
        "debug_words_per_cta": abi.DEBUG_WORDS,
        **({"profile_words_per_task": abi.PROFILE_WORDS, "profile_ring_steps": abi.PROFILE_RING_STEPS} if config.profile else {}),
        "num_events": header["num_events"],
        "num_tasks": header["num_tasks"],
        "arena_bytes": table.arena_bytes,
        "buffers": [asdict(b) for b in table.buffers],
        "weights": [asdict(w) for w in table.weights],
        "states": [asdict(st) for st in table.states],
        **({"comm": {**asdict(table.comm), "nbytes": table.comm.nbytes}} if table.comm else {}),  # tp > 1
        "pointer_table": "weights then states: entry i < len(weights) is weights[i], else states[i - len(weights)]"
                         + ("; then comm['ranks'] entries: every rank's comm region, in rank order" if table.comm else ""),
        "variants": [v.to_json() for v in table.variants],
        "files": {"cubin": cubin_name, "task_table": "task_table.bin", "source": "megakernel.py",
                  "ptx": f"megakernel.{arch}.ptx"},
        "files_sha256": {"cubin": info["cubin_sha256"], "task_table": hashlib.sha256(encoded).hexdigest()},
        "compile": {k: info.get(k) for k in ("compile_seconds", "import_seconds", "wall_seconds", "cache_hit",
                                              "registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes")},
    }  # fmt: skip
    for role, blob in (extra_files or {}).items():
        (out / role).write_bytes(blob.encode() if isinstance(blob, str) else blob)
        manifest["files"][role] = role
    for key, value in (meta or {}).items():
        if key in manifest:
            raise BuildError(f"manifest field {key!r} is the build's own")
        manifest[key] = value
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    return out
