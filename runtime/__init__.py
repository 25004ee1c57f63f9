"""Loads a compiled artifact and runs it: manifest validation, module load and launch through
cuda-bindings, weight binding, decode state. Imports neither CuTe DSL nor the compiler packages
(tests/runtime/test_import_isolation.py).

    from k3mk.runtime import Megakernel
    mk = Megakernel("artifacts/kimi-linear-sm_90a"); mk.bind_weights(...); mk.step()
"""

from k3mk.runtime.manifest import ArtifactError, load_manifest
from k3mk.runtime.megakernel import Megakernel, WatchdogError
from k3mk.runtime.model import DecodeModel
from k3mk.runtime.tp import TPRank
from k3mk.runtime.tp_group import TPGroup, TPGroupError

__all__ = ["ArtifactError", "DecodeModel", "Megakernel", "TPGroup", "TPGroupError", "TPRank", "WatchdogError", "load_manifest"]
