"""The whole-artifact compile cache: `k3mk compile --out DIR` of a target compiled before copies the
cached artifact instead of rerunning the pipeline (kimi-k3 at TP8: 62 s cold).

An entry is `<cache root>/artifacts/<key>/` (the root: $K3MK_CACHE_DIR or ~/.cache/k3mk; compiled
kernels live beside it in kernels/). The key covers everything that determines the artifact: the model
config (all of it but where it was read from), every compile option, the target arch, a hash of
k3mk's own source files (a version string would not change when a pass does, and the cache would serve
a stale artifact), and the versions of CuTe DSL, torch (its export captures the step) and Python. An
entry is used only if it validates completely (manifest schema, every file's hash); it is built and
published under a per-key lock (codegen/artifact_dir.py), so concurrent compiles of one target build it
once. Standard library only: a warm `k3mk compile` imports neither torch nor CuTe DSL.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import k3mk
from k3mk.codegen.artifact_dir import cache_root, cutlass_dsl_version
from k3mk.compiler.config import ModelConfig
from k3mk.runtime.manifest import ArtifactError, load_manifest

SUMMARY_FILE = "compile_summary.txt"  # what `k3mk compile` prints, kept in the artifact (compile_artifact)
SOURCE_PACKAGES = ("compiler", "ir", "passes", "codegen", "runtime")  # what k3mk compiles with (not tests/, bench/)
SOURCE_SUFFIXES = (".py", ".j2", ".json")


@dataclass(frozen=True)
class CompileOptions:
    """Every option of `k3mk compile` that shapes the artifact."""

    tp: int
    max_tokens: int
    max_context: int
    arch: str
    profile: bool = False
    kernel_options: tuple[tuple[str, int], ...] = ()  # KernelConfig tuning knobs, sorted
    activation_dtype: str = "bfloat16"


@lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over k3mk's own source files (relative path and content), in path order."""
    root = Path(k3mk.__file__).parent
    files = [root / "__init__.py"] + sorted(p for package in SOURCE_PACKAGES for p in (root / package).rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def cache_key(config: ModelConfig, options: CompileOptions) -> str:
    config_fields = {k: v for k, v in config.to_dict().items() if k != "source"}
    payload = {"config": config_fields, "options": asdict(options), "k3mk_sources": source_digest(), "cutlass_dsl": cutlass_dsl_version(),
               "torch": _version("torch"), "python": platform.python_version()}  # fmt: skip
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def entry_path(config: ModelConfig, options: CompileOptions) -> Path:
    return cache_root() / "artifacts" / cache_key(config, options)


def usable(entry: Path) -> bool:
    """The entry holds a complete artifact: its manifest validates, every file matches its hash, and it
    carries the compile summary."""
    try:
        m = load_manifest(entry)
        m.check_files()
    except ArtifactError:
        return False
    return SUMMARY_FILE in m["files"]


def discard(entry: Path) -> None:
    """Remove a damaged or partial entry before it is rebuilt (the caller holds its lock)."""
    shutil.rmtree(entry, ignore_errors=True)
