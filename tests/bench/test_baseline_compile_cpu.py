"""The baseline's Triton kernels (bench/baseline_kernels.py) compile for sm_90 on this machine (Triton
ships ptxas): one specialization per kernel at the full-size models' shapes, with the 16-byte pointer
divisibility Triton's JIT assumes for torch allocations (so the expert weights stream through cp.async
pipelines, as on the GPU). Asserted: the compile succeeds and nothing spills to local memory."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3mk.bench import baseline_kernels as K  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
BF16_PTRS = ("x_ptr", "w_ptr", "out_ptr", "g_ptr", "u_ptr", "v_ptr", "nw_ptr", "pw_ptr", "y_ptr", "q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "vo_ptr", "state_ptr")
TYPES = {**dict.fromkeys(BF16_PTRS, "*bf16"), **dict.fromkeys(("wq_ptr", "wk_ptr", "wv_ptr", "logits_ptr", "bias_ptr", "weights_ptr"), "*fp32"),
         "ids_ptr": "*i32", "sorted_expert_ptr": "*i32", "sorted_pair_ptr": "*i64", "x_stride": "i32", "out_stride": "i32", "n": "i32",
         "n_src": "i32", "num_pairs": "i32", "eps": "fp32", "beta": "fp32", "linear_beta": "fp32", "scaling": "fp32"}  # fmt: skip
EXPERT = dict(TOP_K=16, ACT=K.ACT_SITU, HAS_LINEAR_BETA=True, BLOCK_T=K.MAX_TOKENS_PER_EXPERT, BLOCK_K=128, GROUP=32, DOT_FP32=False)
CASES = {
    "rmsnorm 7168": (K._rmsnorm_kernel, dict(DIM=7168, BLOCK=8192), 8, {}),
    "act_mul situ": (K._act_mul_kernel, dict(ACT=K.ACT_SITU, HAS_LINEAR_BETA=True, BLOCK=1024), 4, {}),
    "attn_res 7168": (K._attn_res_kernel, dict(SRC_BLOCK=K.MAX_ATTN_RES_SOURCES, DIM=7168, BLOCK_D=512), 8, {}),
    "kda_conv 12288": (K._kda_conv_kernel, dict(P=12288, W=4, BLOCK=256), 4, {}),
    "router 256 top-8": (K._router_topk_kernel, dict(E=256, BLOCK_E=256, TOP_K=8, BLOCK_K=8, RENORMALIZE=True), 4, {}),
    "moe_combine 3584": (K._moe_combine_kernel, dict(TOP_K=16, N=3584, BLOCK_N=1024), 4, {}),
}
for mxfp4 in (False, True):
    kind = "*u8" if mxfp4 else "*bf16"
    weights = dict.fromkeys(("w1_ptr", "s1_ptr", "w3_ptr", "s3_ptr"), kind)
    for gated, (n, k) in ((True, (3072, 3584)), (False, (3584, 3072))):
        for block_n in (16, 64):
            CASES[f"expert_gemv {'mxfp4' if mxfp4 else 'bf16'} {'gated' if gated else 'down'} {block_n} rows"] = (
                K._expert_gemv_kernel, dict(EXPERT, N=n, K=k, X_PER_TOKEN=gated, MXFP4=mxfp4, GATED=gated, BLOCK_N=block_n), 4, weights)


def _local_bytes(cubin: bytes) -> int:
    """The kernel's stack frame (spills) from Triton's own cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90_without_spills(case):
    fn, constexprs, warps, extra_types = CASES[case]
    types = {**TYPES, **extra_types}
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned), target=H200,
                            options={"num_warps": warps, "num_stages": 3})  # fmt: skip
    assert _local_bytes(kernel.asm["cubin"]) == 0, f"{case} spills"
