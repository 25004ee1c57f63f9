"""Asks vLLM how it repacks MXFP4 routed experts for its Marlin MoE kernel (W4A16, the Hopper path), and
prints the bytes as JSON.

Runs in the vLLM virtual environment (`.venv-vllm`, README "Run the tests"), not in k3mk's: it imports
vLLM, torch and the standard library only, never k3mk. tests/runtime/test_engine_contract_vllm.py runs it
and holds k3mk.ir.marlin.marlin_repack_mxfp4 against the answers.

    .venv-vllm/bin/python tests/runtime/vllm_marlin_probe.py REQUEST.json ANSWER.json

REQUEST is a list of cases {"seed": S, "experts": E, "hidden": K, "intermediate": N}. For each, random
checkpoint-layout MXFP4 experts (w13 [E, 2N, K/2] and w2 [E, K, N/2] uint8 codes, all 256 bytes; UE8M0
scales [E, 2N, K/32], [E, K, N/32] in 110..135 with the extremes 0, 1, 254 and 255 planted) go through
vLLM's own `prepare_moe_fp4_layer_for_marlin` (bf16 activations: input_dtype None) on a stand-in layer.
Its CUDA op `ops.gptq_marlin_repack` (absent from the CPU build) is replaced by its Python reference,
vLLM's `marlin_weights(q_w, K, N, 4, get_weight_perm(4))` on the GPTQ layout's [K, N] codes: the check
vLLM's kernel tests make (the reference equals the op) stays a GPU one. The answer gives the inputs and
vLLM's outputs as hex bytes with their shapes and dtypes.
"""

from __future__ import annotations

import json
import sys
import types

import torch

EXTREME_SCALES = (0, 1, 254, 255)


def reference_repack(b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """ops.gptq_marlin_repack by its Python reference: the GPTQ words [K/8, N] (input 8j+i of column c in
    bits 4i of word (j, c)) unpacked to [K, N] codes, then vLLM's marlin_weights."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack

    assert num_bits == 4 and not is_a_8bit and b_q_weight.shape == (size_k // 8, size_n)
    shifts = 4 * torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    q_w = ((b_q_weight.unsqueeze(1) >> shifts) & 0xF).reshape(size_k, size_n)
    assert torch.equal(gptq_pack(q_w, 4, size_k, size_n), b_q_weight)  # the unpack inverts vLLM's own GPTQ packer
    return marlin_weights(q_w, size_k, size_n, 4, get_weight_perm(4))


def experts(gen: torch.Generator, e: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (e, rows, cols // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 136, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
    spots = torch.randperm(scales.numel(), generator=gen)[: len(EXTREME_SCALES)]
    scales.view(-1)[spots] = torch.tensor(EXTREME_SCALES, dtype=torch.uint8)
    return packed, scales


def as_json(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "hex": t.contiguous().view(torch.uint8).numpy().tobytes().hex()}


def answer(case: dict) -> dict:
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_moe_fp4_layer_for_marlin

    e, k, n = case["experts"], case["hidden"], case["intermediate"]
    gen = torch.Generator().manual_seed(case["seed"])
    inputs = {"w13": experts(gen, e, 2 * n, k), "w2": experts(gen, e, k, n)}
    layer = torch.nn.Module()
    layer.moe_config = types.SimpleNamespace(num_local_experts=e, hidden_dim=k, intermediate_size_per_partition=n)
    layer.params_dtype = torch.bfloat16
    for name, (packed, scales) in inputs.items():
        setattr(layer, f"{name}_weight", torch.nn.Parameter(packed.clone(), requires_grad=False))
        setattr(layer, f"{name}_weight_scale", torch.nn.Parameter(scales.clone(), requires_grad=False))
    prepare_moe_fp4_layer_for_marlin(layer)
    return {
        "case": case,
        **{f"{name}_{kind}": as_json(t) for name, pair in inputs.items() for kind, t in zip(("packed", "scales"), pair)},
        **{f"{name}_marlin_{kind}": as_json(getattr(layer, f"{name}_{attr}"))
           for name in inputs for kind, attr in (("weight", "weight"), ("scale", "weight_scale"))},
    }  # fmt: skip


def main(request_path: str, answer_path: str) -> None:
    import vllm
    import vllm._custom_ops as ops

    cases = json.loads(open(request_path).read())
    cuda_op = hasattr(torch.ops._C, "gptq_marlin_repack")
    ops.gptq_marlin_repack = reference_repack  # marlin_utils_fp4 calls it through the module: ops.gptq_marlin_repack(...)
    report = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "cuda_op_present": cuda_op,
              "cases": [answer(c) for c in cases]}  # fmt: skip
    with open(answer_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
