"""The artifact format: the target archs and the complete schema of manifest.json, in ONE place.

The build (k3mk.codegen.build) validates every manifest against this schema before it writes it, and
the runtime (and `k3mk inspect`) validates it again before anything else: every field present and
typed, cross-field facts (the arch's compute capability, num_ctas within the SMs, smem within the
arch's limit, buffers within the arena), every file listed with its SHA-256 and named inside the
artifact directory. A format change extends the tables below (and bumps MANIFEST_VERSION when an
older reader would misread the new form). Standard library only: `k3mk compile` imports it on its
warm path, without torch.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"


class ArtifactError(RuntimeError):
    """An artifact this runtime or this device cannot run (or one that is malformed)."""


@dataclass(frozen=True)
class Arch:
    """One target: what the build writes into the manifest and the runtime checks against the device."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int  # SMs of the product the default build targets
    max_dynamic_smem: int  # bytes of dynamic shared memory per block (opt-in maximum)
    memory_bytes: int  # HBM of the largest GPU of this arch: an artifact whose decode state exceeds it runs nowhere
    devices: str


# Datasheet figures. sm_103a: CuTe DSL 4.8.1 compiles it (checked 2026-12-01: ptxas "Compiling entry
# function ... for 'sm_103a'"); Blackwell Ultra keeps sm_100's 228 KB of shared memory per SM.
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_90a", (9, 0), 132, 232448, 141 * 10**9, "H100 / H200"),
        Arch("sm_100a", (10, 0), 148, 232448, 186 * 10**9, "B200 / GB200"),
        Arch("sm_103a", (10, 3), 148, 232448, 288 * 10**9, "B300 / GB300"),
    )
}
ARCH_OF_CAPABILITY = {a.compute_capability: a.name for a in ARCHS.values()}

# Element types of weights, states and buffers, by torch dtype name.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8, "uint8": 1}
BUFFER_ROLES = ("activation", "input", "output")  # k3mk.ir.task_table.BUFFER_ROLES (a test checks they agree)
WEIGHT_FORMATS = ("bfloat16", "mxfp4")
REQUIRED_FILES = ("cubin", "task_table", "source", "ptx")  # roles every artifact carries

# --- field checks: each raises ArtifactError naming the field ----------------------------------------------

Check = Callable[[Any, str], None]


def _fail(where: str, expected: str, found: Any) -> ArtifactError:
    shown = repr(found) if not isinstance(found, (dict, list)) else type(found).__name__
    return ArtifactError(f"field '{where}': expected {expected}, found {shown}")


def integer(minimum: int = 0) -> Check:
    def check(v: Any, where: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise _fail(where, f"an integer >= {minimum}", v)

    return check


def number(v: Any, where: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(where, "a finite number", v)


def boolean(v: Any, where: str) -> None:
    if not isinstance(v, bool):
        raise _fail(where, "true or false", v)


def string(*choices: str) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, str) or (choices and v not in choices):
            raise _fail(where, f"one of {', '.join(choices)}" if choices else "a string", v)

    return check


def nullable(inner: Check) -> Check:
    def check(v: Any, where: str) -> None:
        if v is not None:
            inner(v, where)

    return check


def one_of(*checks: Check, expected: str) -> Check:
    def check(v: Any, where: str) -> None:
        for c in checks:
            try:
                c(v, where)
                return
            except ArtifactError:
                pass
        raise _fail(where, expected, v)

    return check


def array(item: Check, length: int | None = None) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, list) or (length is not None and len(v) != length):
            raise _fail(where, f"a list of {length}" if length is not None else "a list", v)
        for i, x in enumerate(v):
            item(x, f"{where}[{i}]")

    return check


def mapping(value: Check) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, dict):
            raise _fail(where, "an object", v)
        for k, x in v.items():
            value(x, f"{where}.{k}")

    return check


def record(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """An object with exactly these fields: every required one, optional ones where present, no others."""
    optional = optional or {}

    def check(v: Any, where: str) -> None:
        if not isinstance(v, dict):
            raise _fail(where, "an object", v)
        prefix = f"{where}." if where else ""
        missing = [k for k in required if k not in v]
        if missing:
            raise ArtifactError(f"field '{prefix}{missing[0]}' is missing")
        unknown = sorted(k for k in v if k not in required and k not in optional)
        if unknown:
            raise ArtifactError(f"field '{prefix}{unknown[0]}' is not part of manifest version {MANIFEST_VERSION}")
        for k, c in {**required, **optional}.items():
            if k in v:
                c(v[k], f"{prefix}{k}")

    return check


def _sha256(v: Any, where: str) -> None:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise _fail(where, "a SHA-256 (64 hex digits)", v)


def _file_name(v: Any, where: str) -> None:
    """A file INSIDE the artifact directory: one plain name, no path."""
    if not isinstance(v, str) or not v or PurePosixPath(v).name != v or v in (".", "..") or "\\" in v:
        raise _fail(where, "a file name inside the artifact directory", v)


def _any(v: Any, where: str) -> None:
    pass


_shape = array(integer(1))
_dtype = string(*DTYPE_BYTES)
_tensor = record({"dtype": _dtype, "shape": _shape})

# What build() writes (the kernel and its table)...
BUILD_FIELDS: dict[str, Check] = {
    "manifest_version": integer(1),
    "abi_version": one_of(integer(1), string(), expected="an ABI version (an integer, or a string such as '1+profile')"),
    "task_table_format": integer(1),
    "k3mk_version": string(),
    "cutlass_dsl_version": string(),
    "arch": string(*ARCHS),
    "compute_capability": array(integer(0), 2),
    "sm_count": integer(1),
    "num_ctas": integer(1),
    "block_threads": integer(32),
    # the streaming loop's shared memory (codegen/ops.py RingLayout; the debug watchdog names its barriers)
    "ring": record({"slots": integer(1), "slot_bytes": integer(128), "records": integer(1), "barrier_offset": integer(0)}),
    "dynamic_smem_bytes": integer(0),
    "debug": boolean,
    "profile": boolean,
    "kernel_name": string(),
    "params": array(record({"name": string(), "kind": string("ptr", "i32"), "dtype": string(), "align": integer(0)})),
    "control_words": integer(1),
    "debug_words_per_cta": integer(1),
    "num_events": integer(0),
    "num_tasks": integer(0),
    "arena_bytes": integer(0),
    "buffers": array(record({"name": string(), "offset": integer(0), "dtype": _dtype, "shape": _shape, "role": string(*BUFFER_ROLES)})),
    "weights": array(record({"name": string(), "dtype": _dtype, "shape": _shape})),
    "states": array(record({"name": string(), "dtype": _dtype, "shape": _shape, "layout": string()})),
    "pointer_table": string(),
    "variants": array(record({"op": string(), "params": mapping(_any)})),  # the op records: k3mk.ir.task_table
    "files": mapping(_file_name),
    "files_sha256": mapping(_sha256),
    "compile": mapping(nullable(one_of(number, boolean, expected="a number or true / false"))),
}
PROFILE_FIELDS: dict[str, Check] = {"profile_words_per_task": integer(1), "profile_ring_steps": integer(1)}
COMM_FIELDS: dict[str, Check] = {"comm": record({"ranks": integer(2), "events": integer(0), "half": integer(0), "nbytes": integer(0)})}
# ... and what the compiler adds for a whole decode step (k3mk.compiler.pipeline.compile_artifact).
MODEL_FIELDS: dict[str, Check] = {
    "model": string(),
    "config_hash": string(),
    "tp": integer(1),
    "max_tokens": integer(1),
    "max_context": integer(1),
    "activation_dtype": _dtype,
    "weight_format": string(*WEIGHT_FORMATS),
    "kv_dtype": nullable(_dtype),
    "state_layouts": mapping(record({"dtype": _dtype, "shape": _shape, "layout": string()})),
    "step_inputs": mapping(_tensor),
    "step_outputs": mapping(_tensor),
    "fusions": array(string()),
    "predicted_step_s": nullable(number),
}
TP_FIELDS: dict[str, Check] = {"tp_shards": mapping(record({"dim": integer(0), "parts": integer(2), "groups": integer(1)}))}


def validate(data: Any) -> None:
    """Raise ArtifactError (naming the field, expected vs found) unless `data` is a complete manifest."""
    if not isinstance(data, dict):
        raise ArtifactError(f"expected a JSON object, found {type(data).__name__}")
    version = data.get("manifest_version")
    if version != MANIFEST_VERSION:
        raise ArtifactError(f"manifest version {version!r}; this k3mk reads version {MANIFEST_VERSION}: rebuild the artifact with this k3mk")
    optional = {**PROFILE_FIELDS, **COMM_FIELDS, **TP_FIELDS, **MODEL_FIELDS}
    record(BUILD_FIELDS, optional)(data, "")
    _check_groups(data)
    _check_target(data)
    _check_files(data)
    _check_buffers(data)


def _check_groups(data: dict) -> None:
    """Fields that come together: all of a group or none of it."""
    groups = [("profile builds", PROFILE_FIELDS, data["profile"]), ("whole-model artifacts", MODEL_FIELDS, "model" in data),
              ("tensor-parallel artifacts", {**COMM_FIELDS, **TP_FIELDS}, data.get("tp", 1) > 1)]  # fmt: skip
    for what, fields, present in groups:
        for name in fields:
            if present and name not in data:
                raise ArtifactError(f"field '{name}' is missing (every manifest of {what} has it)")
            if not present and name in data:
                raise ArtifactError(f"field '{name}' belongs to {what}, which this manifest does not describe")


def _check_target(data: dict) -> None:
    arch = ARCHS[data["arch"]]
    if tuple(data["compute_capability"]) != arch.compute_capability:
        raise ArtifactError(f"field 'compute_capability': expected {list(arch.compute_capability)} for {arch.name}, found {data['compute_capability']}")
    if data["num_ctas"] > data["sm_count"]:
        raise ArtifactError(f"field 'num_ctas': {data['num_ctas']} task lists exceed sm_count {data['sm_count']} (one CTA per SM)")
    if data["dynamic_smem_bytes"] > arch.max_dynamic_smem:
        raise ArtifactError(f"field 'dynamic_smem_bytes': {data['dynamic_smem_bytes']} exceeds the {arch.max_dynamic_smem} B of {arch.name}")
    if data["block_threads"] % 32 or data["block_threads"] > 1024:
        raise ArtifactError(f"field 'block_threads': expected a multiple of 32 up to 1024, found {data['block_threads']}")


def _check_files(data: dict) -> None:
    files, hashes = data["files"], data["files_sha256"]
    for role in REQUIRED_FILES:
        if role not in files:
            raise ArtifactError(f"field 'files.{role}' is missing (every artifact carries its {role})")
    for role in files:
        if role not in hashes:
            raise ArtifactError(f"field 'files_sha256.{role}' is missing (every file listed is listed with its hash)")
    for role in hashes:
        if role not in files:
            raise ArtifactError(f"field 'files_sha256.{role}' hashes a file that 'files' does not list")
    names = list(files.values())
    if len(set(names)) != len(names) or MANIFEST_FILE in names:
        raise ArtifactError(f"field 'files': every role needs a file of its own, other than {MANIFEST_FILE}")


def _check_buffers(data: dict) -> None:
    for b in data["buffers"]:
        end = b["offset"] + math.prod(b["shape"]) * DTYPE_BYTES[b["dtype"]]
        if end > data["arena_bytes"]:
            raise ArtifactError(f"field 'buffers': '{b['name']}' ends at byte {end}, beyond arena_bytes {data['arena_bytes']}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def check_file(directory: Path, data: dict, role: str, blob: bytes | None = None) -> bytes | None:
    """Check that the file of `role` is a regular file inside `directory` whose SHA-256 is the recorded
    one; returns `blob` (the file's bytes, when given) for convenience."""
    path = directory / data["files"][role]
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"{path}: the artifact's {role} is missing (or not a regular file)")
    digest = hashlib.sha256(blob).hexdigest() if blob is not None else file_sha256(path)
    if digest != data["files_sha256"][role]:
        raise ArtifactError(f"{path} does not match the hash in its manifest: rebuild the artifact")
    return blob
