"""The decode-state layouts one TP rank binds when a serving engine owns the state (docs/engine_contract.md,
"Caches and states"), derived from the compiler's own state table (compiler/weights.py `state_specs`)
and tensor-parallel rules (passes/tp_shard.py `state_split`): the per-rank states an artifact is compiled
for, in the engine's per-slot form (k3mk.runtime.engine_contract). tests/runtime/test_engine_contract_vllm.py
holds them against vLLM's calculators, so a change to either side that breaks the contract fails there.
"""

from __future__ import annotations

import torch

from k3mk.compiler.config import ModelConfig
from k3mk.compiler.weights import state_specs
from k3mk.ir.collectives import ShardSpec
from k3mk.passes.tp_shard import check_divisible, state_split
from k3mk.runtime.engine_contract import KdaStateLayout, MlaCacheLayout


def rank_state_shapes(config: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """Every decode state of one rank of a `tp`-way group, batch 1 and context 1 (what a slot holds)."""
    check_divisible(config, tp)
    shapes = {}
    for spec in state_specs(config, batch=1, max_context=1):
        split = state_split(spec.name)
        shapes[spec.name] = ShardSpec(split[0], tp, split[1]).local_shape(spec.shape, spec.name) if split else spec.shape
    return shapes


def engine_state_layouts(config: ModelConfig, tp: int, draft_tokens: int, cache_dtype: str,
                         model_dtype: torch.dtype = torch.bfloat16) -> dict[int, KdaStateLayout | MlaCacheLayout]:  # fmt: skip
    """Per layer (0-based): the KDA state slot or MLA cache row one rank binds, for verify steps of
    1 + draft_tokens tokens and the engine's KV cache dtype name (vLLM --kv-cache-dtype)."""
    shapes = rank_state_shapes(config, tp)
    layouts: dict[int, KdaStateLayout | MlaCacheLayout] = {}
    for layer, kind in enumerate(config.layer_kinds):
        prefix = f"layers.{layer}"
        if kind == "kda":
            layouts[layer] = KdaStateLayout.of_compiled(shapes[f"{prefix}.conv_state"], shapes[f"{prefix}.recurrent_state"], draft_tokens)
        else:
            layouts[layer] = MlaCacheLayout.of_compiled(shapes[f"{prefix}.kv_cache"], cache_dtype, model_dtype)
    return layouts
