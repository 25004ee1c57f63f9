"""The streaming ring at its smallest: op cases built with `--config ring_bytes=32768 --suffix ring2` (two
16 KB slots), so every slot is reused many times in a step and consumer warps run onto slots whose
previous fill, another warp's, has not landed yet (what the ring's SLOT_SEQ word is for: ring.py.j2).
Each runs against the same references and tolerances as its full-ring build (the op-family tests'
own check functions).

    python tests/runtime/build_megakernel_cases.py --config ring_bytes=32768 --suffix ring2 <RING_CASES ...>
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SUFFIX = "ring2"
FRAMEWORK = ["gemv_b1", "gemv_b4_norm_residual", "gemv_b4_norm_chunked", "gemv_b8_norm_tiles", "diamond", "chain"]
KDA = ["gated_silu_b4", "gated_silu_b4_chunked", "gated_silu_b8_rm", "gated_rmsnorm_b4", "kda_layer_b4"]
MOE_MLA = ["expert_gated_bf16_silu_b4", "expert_gated_mxfp4_silu_b4", "expert_combine_bf16_b4", "expert_combine_mxfp4_b4", "moe_graph_b4",
           "expert_gated_bf16_silu_b4_chunked", "expert_combine_bf16_b2_chunked",
           # MLA decode's KV blocks of 2 fills: with 2 slots the producer and the consumers take turns block by block
           "mla_k3dims_b1", "mla_odd_b4"]
RING_CASES = FRAMEWORK + KDA + MOE_MLA


def ring_of(mk) -> int:
    slots = mk.manifest["ring"]["slots"]
    assert slots == 2, f"{mk.manifest.path} has {slots} ring slots: build it with --config ring_bytes=32768"
    return slots


@pytest.mark.parametrize("name", FRAMEWORK)
def test_framework_case_with_two_slots(name):
    from test_megakernel_gpu import load, run_three_steps

    case, mk = load(f"{name}@{SUFFIX}")
    ring_of(mk)
    run_three_steps(name, case, mk, f"{name}@{SUFFIX}")


@pytest.mark.parametrize("name", KDA)
def test_kda_case_with_two_slots(name):
    from test_kda_ops_gpu import check_case, load

    case, mk = load(f"{name}@{SUFFIX}")
    ring_of(mk)
    check_case(name, case, mk)


@pytest.mark.parametrize("name", MOE_MLA)
def test_moe_case_with_two_slots(name):
    from test_moe_mla_gpu import run_case

    _, mk, _, ck = run_case(f"{name}@{SUFFIX}")
    ring_of(mk)
    assert not ck.failures, "\n".join(ck.failures)
