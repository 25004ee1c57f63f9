"""Build the whole-model artifacts the GPU tests run: k3-tiny and the small Kimi Linear config at batch 1
and 4 (tests/runtime/test_model_gpu.py), and k3-tiny batch 1 as a profile build (test_profile_gpu.py) and
as a debug build (the watchdog: tests/runtime/sanitize_run.sh); max_context 128, sm_90a ->
artifacts_dev/model_<name>_b<batch>[_profile|_debug]. Names given: only those.

    python tests/runtime/build_model_artifacts.py [model_k3-tiny_b1 model_k3-tiny_b1_profile ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3mk.compiler.pipeline import compile_artifact  # noqa: E402
from test_model_gpu import ARTIFACTS, CASES, MAX_CONTEXT, config_of  # noqa: E402

BUILDS = {f"model_{name}_b{batch}": (name, batch, False, {}) for name, batch in CASES}
BUILDS["model_k3-tiny_b1_profile"] = ("k3-tiny", 1, True, {})
BUILDS["model_k3-tiny_b1_debug"] = ("k3-tiny", 1, False, {"debug": True})

if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(BUILDS)
    if unknown:
        raise SystemExit(f"unknown artifacts {sorted(unknown)}; known: {', '.join(BUILDS)}")
    for art, (name, batch, profile, kernel) in BUILDS.items():
        if sys.argv[1:] and art not in sys.argv[1:]:
            continue
        t0 = time.perf_counter()
        out = compile_artifact(config_of(name), 1, batch, MAX_CONTEXT, "sm_90a", ARTIFACTS / art, profile=profile, kernel_options=kernel)
        print(f"{out}: {time.perf_counter() - t0:.1f} s", flush=True)
