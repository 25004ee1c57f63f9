"""Build the tensor-parallel artifacts tests/runtime/test_model_tp_gpu.py runs: k3-tiny at TP 2, batch 1 and
4, max_context 128, sm_90a -> artifacts_dev/model_k3-tiny_b<batch>_tp2 (ONE artifact serves both ranks).
Names given: only those.

    python tests/runtime/build_tp_artifacts.py [model_k3-tiny_b1_tp2 ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3mk.compiler.pipeline import compile_artifact  # noqa: E402
from test_model_gpu import MAX_CONTEXT, config_of  # noqa: E402
from test_model_tp_gpu import CASES, TP, tp_artifact  # noqa: E402

if __name__ == "__main__":
    known = {tp_artifact(name, batch).name: (name, batch) for name, batch in CASES}
    unknown = set(sys.argv[1:]) - set(known)
    if unknown:
        raise SystemExit(f"unknown artifacts {sorted(unknown)}; known: {', '.join(known)}")
    for art, (name, batch) in known.items():
        if sys.argv[1:] and art not in sys.argv[1:]:
            continue
        t0 = time.perf_counter()
        out = compile_artifact(config_of(name), TP, batch, MAX_CONTEXT, "sm_90a", tp_artifact(name, batch))
        print(f"{out}: {time.perf_counter() - t0:.1f} s", flush=True)
