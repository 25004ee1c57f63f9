"""Build the whole-model artifacts the GPU test tests/runtime/test_model_gpu.py runs: k3-tiny and the small
Kimi Linear config at batch 1 and 4, max_context 128, sm_90a -> artifacts_dev/model_<name>_b<batch>.

    python tests/runtime/build_model_artifacts.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3mk.compiler.pipeline import compile_artifact  # noqa: E402
from test_model_gpu import ARTIFACTS, CASES, MAX_CONTEXT, config_of  # noqa: E402

if __name__ == "__main__":
    for name, batch in CASES:
        t0 = time.perf_counter()
        out = compile_artifact(config_of(name), 1, batch, MAX_CONTEXT, "sm_90a", ARTIFACTS / f"model_{name}_b{batch}")
        print(f"{out}: {time.perf_counter() - t0:.1f} s", flush=True)
