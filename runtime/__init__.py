"""Loads a compiled artifact and runs it: manifest validation, module load and launch through
cuda-bindings, weight binding, decode state. Imports neither CuTe DSL nor the compiler packages
(tests/runtime/test_runtime_cpu.py).

    from k3mk.runtime import Megakernel
    mk = Megakernel("artifacts/kimi-linear-sm_90a"); mk.bind_weights(...); mk.step()

The names below are imported on first use, so that the torch-free modules (schema, manifest, table,
abi) load without torch: `k3mk compile` reads the artifact schema on its warm path.
"""

import importlib

_EXPORTS = {
    "ArtifactError": "k3mk.runtime.schema",
    "load_manifest": "k3mk.runtime.manifest",
    "Megakernel": "k3mk.runtime.megakernel",
    "NoDeviceError": "k3mk.runtime.megakernel",
    "WatchdogError": "k3mk.runtime.megakernel",
    "DecodeModel": "k3mk.runtime.model",
    "TPRank": "k3mk.runtime.tp",
    "TPGroup": "k3mk.runtime.tp_group",
    "TPGroupError": "k3mk.runtime.tp_group",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3mk.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
