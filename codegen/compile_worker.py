"""Compile one generated megakernel source for one arch, in its own process.

CuTe DSL reads CUTE_DSL_ARCH once at import (cutedsl_notes §2, quack's pitfall), so each arch gets
a fresh interpreter: `python -m k3mk.codegen.compile_worker SOURCE ARCH OUT_DIR`, started by
codegen/build.py with CUTE_DSL_ARCH=ARCH. Writes OUT_DIR/{megakernel.ARCH.cubin, .ptx, info.json}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    source, arch, out_dir = Path(argv[0]), argv[1], Path(argv[2])
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        print(f"CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r} must equal the target {arch!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    importlib.import_module("cutlass")  # import time is reported apart from compile time

    t1 = time.perf_counter()
    spec = importlib.util.spec_from_file_location("k3mk_generated_megakernel", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The DSL writes dumps only into an existing dir; inside out_dir, so that the build removes it even
    # when it has to kill this process (codegen/build.py: on Ctrl-C or SIGTERM of `k3mk compile`).
    with tempfile.TemporaryDirectory(dir=out_dir) as dump:
        compiled = module.compile_kernel(arch, dump, "remarks{ptx}")  # ptxas resource report on stdout
        t2 = time.perf_counter()
        names = list(compiled.kernel_info)
        cubins = sorted(Path(dump).glob("*.cubin"))
        ptxs = sorted(Path(dump).glob("*.ptx"))
        if len(cubins) != 1 or len(ptxs) != 1:
            print(f"expected one cubin and one ptx in the dump, got {cubins} {ptxs}", file=sys.stderr)
            return 3
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"megakernel.{arch}.cubin").write_bytes(cubins[0].read_bytes())
        (out_dir / f"megakernel.{arch}.ptx").write_bytes(ptxs[0].read_bytes())
    info = {
        "arch": arch,
        "kernel_names": names,
        "import_seconds": round(t1 - t0, 3),
        "compile_seconds": round(t2 - t1, 3),
    }
    (out_dir / "info.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
