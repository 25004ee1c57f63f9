"""Complete, schema-valid artifacts for CPU tests, without CuTe DSL: a real task table (a
megakernel_cases table), a stand-in cubin and ptx, and the manifest build() writes for them
(k3mk.codegen.build.write_artifact, the build's own writer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from k3mk.codegen.build import write_artifact
from k3mk.codegen.ops import KernelConfig
from k3mk.runtime.schema import ARCHS

sys.path.insert(0, str(Path(__file__).parent))
from megakernel_cases import all_cases  # noqa: E402


def model_meta(max_tokens: int = 1, max_context: int = 64) -> dict:
    """The fields compile_artifact adds for a whole decode step at tp 1."""
    return {"model": "fake", "config_hash": "0" * 16, "tp": 1, "max_tokens": max_tokens, "max_context": max_context,
            "activation_dtype": "bfloat16", "weight_format": "bfloat16", "kv_dtype": None, "state_layouts": {},
            "step_inputs": {}, "step_outputs": {}, "fusions": [], "predicted_step_s": None}  # fmt: skip


def fake_artifact(out: Path, case: str = "diamond", arch: str = "sm_90a", meta: dict | None = None) -> Path:
    table = all_cases()[case].builder.table()
    kernel_dir = out.parent / f".{out.name}-kernel"
    kernel_dir.mkdir(parents=True, exist_ok=True)
    (kernel_dir / "cubin").write_bytes(b"\x7fELF stand-in cubin " + out.name.encode())
    (kernel_dir / "ptx").write_text(f".target {arch}\n")
    kernel = {"cubin": kernel_dir / "cubin", "ptx": kernel_dir / "ptx", "source": "# stand-in source\n"}
    info = {"kernel_names": ["k3mk_megakernel_0"], "compile_seconds": 0.0}
    return write_artifact(out, table, table.encode(), arch, ARCHS[arch].sm_count, KernelConfig(), 1024, kernel, info, meta or {}, {})


def edit_manifest(artifact: Path, change) -> None:
    """Rewrite manifest.json through `change(data)` (the manifest itself carries no hash)."""
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
