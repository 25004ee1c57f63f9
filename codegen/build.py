"""Build an artifact: task table -> CuTe DSL source -> cubin for one arch -> artifact directory.

Artifact directory (read by k3mk.runtime, which validates manifest.json against k3mk/runtime/schema.py
and checks it against the device):
  manifest.json            format versions, arch, SM count, block size, smem, kernel name, the
                           kernel parameter ABI, buffer / weight tables, every file with its SHA-256,
                           resource usage
  megakernel.<arch>.cubin  the kernel (loaded with cuModuleLoadData)
  megakernel.<arch>.ptx    for reading
  megakernel.py            the generated CuTe DSL source
  task_table.bin           docs/task_table.md

It is written whole or not at all (codegen/artifact_dir.py: staged beside the destination, renamed
into place under a lock; only an artifact is ever replaced). Compiles run GPU-blind in a subprocess per
arch (CUTE_DSL_ARCH is read once at import) and are cached by a content key (source, arch, CuTe DSL and
k3mk versions) under $K3MK_CACHE_DIR or ~/.cache/k3mk: entries are written to a temporary directory and
renamed into place under a per-key file lock, and an entry whose files do not match its recorded hash
is rebuilt. (Whole artifacts are cached by the compiler: k3mk/compiler/artifact_cache.py.)
"""

from __future__ import annotations

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
from pathlib import Path

from k3mk import __version__ as K3MK_VERSION
from k3mk.codegen import artifact_dir
from k3mk.codegen.artifact_dir import cutlass_dsl_version
from k3mk.codegen.emit import dynamic_smem_bytes, emit_source
from k3mk.codegen.ops import KernelConfig, ring_layout
from k3mk.ir import task_table as tt
from k3mk.ir.task_table import RingModel, TaskTable
from k3mk.runtime import abi, schema
from k3mk.runtime.schema import ARCHS


class BuildError(RuntimeError):
    pass


def compile_source(source: str, arch: str, *, use_cache: bool = True, timeout: float = 1800) -> tuple[Path, dict]:
    """Compile `source` for `arch`; returns (directory with megakernel.<arch>.cubin/.ptx, info)."""
    if arch not in ARCHS:
        raise BuildError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    key = hashlib.sha256(
        json.dumps([source, arch, cutlass_dsl_version(), K3MK_VERSION, abi.ABI_VERSION]).encode()
    ).hexdigest()[:32]
    root = artifact_dir.cache_root() / "kernels" if use_cache else Path(tempfile.mkdtemp(prefix="k3mk-build-"))
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    with artifact_dir.locked(entry):
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
    `extra_files`: {role: text} written as files named by role (IR and schedule dumps), listed in "files".
    The directory is written whole or not at all (codegen/artifact_dir.py): an existing artifact there
    is replaced as a whole, a directory holding anything else is refused before the compile."""
    if arch not in ARCHS:
        raise BuildError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    out = Path(out_dir)
    artifact_dir.check_destination(out)
    sm_count = sm_count or ARCHS[arch].sm_count
    if len(table.lists) > sm_count:
        raise BuildError(f"{len(table.lists)} task lists but the target has {sm_count} SMs (one CTA per SM)")
    config = config.for_kernel(table.variants)
    encoded = table.encode(check=check)
    ring = ring_layout(table.variants, config)
    if check:  # the streaming loop's producers and rings as this kernel builds them
        table.check_deadlock_free(ring=RingModel(ring.slots, ring.records, config.warps, ring.slot_bytes))
    source = emit_source(table.variants, config)
    smem = dynamic_smem_bytes(table.variants, config)
    if smem > ARCHS[arch].max_dynamic_smem:
        raise BuildError(f"{smem} B of shared memory exceeds {ARCHS[arch].max_dynamic_smem} B on {arch}")
    kernel_dir, info = compile_source(source, arch, use_cache=use_cache)
    expected_name = f"{config.kernel_name}_0"
    if info["kernel_names"] != [expected_name]:
        raise BuildError(f"kernel symbols {info['kernel_names']}, expected [{expected_name!r}]")
    kernel = {"cubin": kernel_dir / f"megakernel.{arch}.cubin", "ptx": kernel_dir / f"megakernel.{arch}.ptx", "source": source}
    return write_artifact(out, table, encoded, arch, sm_count, config, smem, kernel, info, meta or {}, extra_files or {})


def write_artifact(out: Path, table: TaskTable, encoded: bytes, arch: str, sm_count: int, config: KernelConfig, smem: int,
                   kernel: dict, info: dict, meta: dict, extra_files: dict[str, str | bytes]) -> Path:  # fmt: skip
    """Stage the artifact's files and its manifest (validated against k3mk/runtime/schema.py), then
    publish it at `out`. `kernel`: the compiled cubin and ptx (paths) and the source (text)."""
    config = config.for_kernel(table.variants)  # the knobs the kernel was built with (build() resolved them)
    with artifact_dir.staging(out) as staged:
        files = {"cubin": f"megakernel.{arch}.cubin", "task_table": "task_table.bin", "source": "megakernel.py", "ptx": f"megakernel.{arch}.ptx"}
        shutil.copyfile(kernel["cubin"], staged / files["cubin"])
        shutil.copyfile(kernel["ptx"], staged / files["ptx"])
        (staged / files["source"]).write_text(kernel["source"])
        (staged / files["task_table"]).write_bytes(encoded)
        for role, blob in extra_files.items():
            if role in files:
                raise BuildError(f"extra file {role!r} is one of the build's own")
            (staged / role).write_bytes(blob.encode() if isinstance(blob, str) else blob)
            files[role] = role
        manifest = _manifest(table, encoded, arch, sm_count, config, smem, info, files, meta)
        manifest["files_sha256"] = {role: schema.file_sha256(staged / name) for role, name in files.items()}
        text = json.dumps(manifest, indent=1)
        try:
            schema.validate(json.loads(text))  # as a reader will see it
        except schema.ArtifactError as e:
            raise BuildError(f"the manifest this build would write does not match k3mk/runtime/schema.py: {e}") from None
        (staged / schema.MANIFEST_FILE).write_text(text)
        return artifact_dir.publish(staged, out)


def _manifest(table: TaskTable, encoded: bytes, arch: str, sm_count: int, config: KernelConfig, smem: int, info: dict,
              files: dict[str, str], meta: dict) -> dict:  # fmt: skip
    """manifest.json (k3mk/runtime/schema.py is its complete description), less the file hashes."""
    header = tt.read_header(encoded)
    ring = ring_layout(table.variants, config)
    manifest = {
        "manifest_version": schema.MANIFEST_VERSION,
        "abi_version": abi.PROFILE_ABI_VERSION if config.profile else abi.ABI_VERSION,
        "task_table_format": tt.FORMAT_VERSION,
        "k3mk_version": K3MK_VERSION,
        "cutlass_dsl_version": cutlass_dsl_version(),
        "arch": arch,
        "compute_capability": list(ARCHS[arch].compute_capability),
        "sm_count": sm_count,
        "num_ctas": len(table.lists),
        "block_threads": config.block_threads,
        "ring": {"slots": ring.slots, "slot_bytes": ring.slot_bytes, "records": ring.records, "barrier_offset": ring.barrier_offset},
        "dynamic_smem_bytes": smem,
        "debug": config.debug,
        "profile": config.profile,
        "kernel_name": f"{config.kernel_name}_0",
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
        "files": files,
        "compile": {k: info.get(k) for k in ("compile_seconds", "import_seconds", "wall_seconds", "cache_hit",
                                              "registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes")}
        # per thread after setmaxnreg (ptxas's "registers" is the launch's share)
        | {"consumer_registers": config.consumer_registers, "support_registers": config.support_registers},
    }  # fmt: skip
    for key, value in meta.items():
        if key in manifest:
            raise BuildError(f"manifest field {key!r} is the build's own")
        manifest[key] = value
    return manifest
