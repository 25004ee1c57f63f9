"""tp_shard + ir/ranks.py: the sharded graph, run on N simulated ranks in lockstep, equals the unsharded
reference decode step; every weight is split or replicated by design; bad degrees are clear errors."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.compiler.random_weights import random_weights
from k3mk.compiler.reference import DecodeStep
from k3mk.compiler.weights import state_specs
from k3mk.ir import interpreter, ranks
from k3mk.ir.collectives import argmax_combine, argmax_partial
from k3mk.ir.graph import Graph, IRError, Role
from k3mk.passes.manager import Target, run_pipeline
from k3mk.passes.tp_shard import TPError, tp_shard

BATCH, MAX_CONTEXT = 2, 12


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}

# The weights every rank holds whole, by design (passes/tp_shard.py's docstring says why), layers as "*"
REPLICATED = {
    "model.embed_tokens.weight", "model.norm.weight",
    "model.layers.*.input_layernorm.weight", "model.layers.*.post_attention_layernorm.weight",
    "model.layers.*.self_attn.f_a_proj.weight", "model.layers.*.self_attn.o_norm.weight",
    "model.layers.*.self_attn.kv_a_proj_with_mqa.weight", "model.layers.*.self_attn.kv_a_layernorm.weight",
    "model.layers.*.block_sparse_moe.gate.weight", "model.layers.*.block_sparse_moe.gate.e_score_correction_bias",
}  # fmt: skip
K3_REPLICATED = REPLICATED | {
    "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight",
    "model.layers.*.self_attention_res_norm.weight", "model.layers.*.self_attention_res_proj.weight",
    "model.layers.*.mlp_res_norm.weight", "model.layers.*.mlp_res_proj.weight",
    "model.layers.*.self_attn.q_a_proj.weight", "model.layers.*.self_attn.q_a_layernorm.weight",
    "model.layers.*.block_sparse_moe.routed_expert_norm.weight",
}  # fmt: skip
KIMI_LINEAR_REPLICATED = REPLICATED | {"model.layers.*.self_attn.g_a_proj.weight"}


def layer_pattern(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


@functools.cache
def case(name: str):
    """(config, captured graph, full weights, step values, reference logits, reference new state)."""
    config = CONFIGS[name]()
    graph = capture(config, BATCH, MAX_CONTEXT, torch.float32)
    weights = random_weights(config, 3, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(4)
    values = {
        "token_ids": torch.randint(0, config.vocab_size, (BATCH,), generator=gen),
        "positions": torch.randint(0, MAX_CONTEXT, (BATCH,), generator=gen),
    }
    for s in state_specs(config, BATCH, MAX_CONTEXT):
        values[s.name] = (0.1 if s.name.endswith("recurrent_state") else 1.0) * torch.randn(s.shape, generator=gen)
    step = DecodeStep(config, torch.float32)
    step.load_state_dict(weights)
    with torch.no_grad():
        logits, new_state = step(values["token_ids"], values["positions"], {k: v for k, v in values.items() if k.startswith("layers.")})
    return config, graph, weights, values, logits, new_state


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_ranks_equal_the_unsharded_reference(name, tp):
    config, graph, weights, values, logits, new_state = case(name)
    sharded = run_pipeline(graph, Target(config, tp=tp), [tp_shard]).output
    out = ranks.run(sharded, {**weights, **values})
    assert relative_error(out["logits"], logits) < 1e-5
    assert torch.equal(out["next_tokens"], logits.argmax(-1).to(torch.int32))
    for key, value in new_state.items():
        assert relative_error(out[key], value) < 1e-5, key


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_weight_is_split_or_replicated_by_design(name):
    config, graph, *_ = case(name)
    sharded = tp_shard(graph, Target(config, tp=4))
    replicated = set()
    for t in sharded.by_role(Role.WEIGHT):
        full = graph.tensors[t.name]
        if t.shard is None:
            replicated.add(layer_pattern(t.name))
            assert t.shape == full.shape
        else:  # four disjoint equal pieces that reassemble the checkpoint tensor
            assert t.shard.parts == 4 and t.nbytes * 4 == full.nbytes
            whole = torch.arange(full.numel).reshape(full.shape)
            assert torch.equal(t.shard.assemble([t.shard.take(whole, r) for r in range(4)]), whole)
    assert replicated == (K3_REPLICATED if name == "k3-tiny" else KIMI_LINEAR_REPLICATED)


def test_collectives_per_layer_k3():
    """Per MoE layer: mixer all_reduce, latent all_gather, latent all_reduce, MoE all_reduce; the dense
    layer 0: two all_reduces; greedy: two all_gathers of per-rank candidates (spec 10, 5.3)."""
    config, graph, *_ = case("k3-tiny")
    sharded = tp_shard(graph, Target(config, tp=2))
    kinds = [n.op.name for n in sharded.nodes]
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    assert kinds.count("all_reduce") == 2 + 3 * moe_layers
    assert kinds.count("all_gather") == moe_layers + 2
    assert kinds.count("shard_slice") == moe_layers
    assert sharded.tensors["logits"].shard.dim == 1 and sharded.tensors["layers.3.kv_cache"].shard is None


def test_indivisible_degree_names_the_dimension():
    config, graph, *_ = case("k3-tiny")
    with pytest.raises(TPError, match=r"degree 3 does not divide kda\.num_heads = 4"):
        tp_shard(graph, Target(config, tp=3))
    odd_vocab = config.replace(vocab_size=4098)
    with pytest.raises(TPError, match=r"degree 4 does not divide vocab_size = 4098"):
        tp_shard(graph, Target(odd_vocab, tp=4))


def test_tp1_is_the_identity():
    config, graph, *_ = case("k3-tiny")
    assert tp_shard(graph, Target(config, tp=1)) is graph


def test_single_rank_interpreter_refuses_collectives():
    config, graph, weights, values, *_ = case("kimi-linear-small")
    sharded = tp_shard(graph, Target(config, tp=2))
    with pytest.raises(IRError, match="needs the operands of all 2 ranks"):
        interpreter.run(sharded, ranks.rank_inputs(sharded, {**weights, **values}, 0))


def test_greedy_candidates_break_ties_to_the_lowest_index():
    logits = torch.tensor([[1.0, 5.0, 2.0, 5.0, 5.0, 0.0], [0.0, 1.0, 2.0, 3.0, 9.0, 9.0]])
    pieces = [argmax_partial(p) for p in logits.chunk(3, dim=1)]
    values, index = (torch.cat([p[i] for p in pieces], dim=1) for i in range(2))
    assert argmax_combine(values, index, 2).tolist() == logits.argmax(-1).tolist() == [1, 4]


def test_unknown_weight_is_an_error():
    config, graph, *_ = case("kimi-linear-small")
    odd: Graph = graph.copy()
    t = odd.tensors.pop("lm_head.weight")
    odd.tensors["lm_head.mystery"] = dataclasses.replace(t, name="lm_head.mystery")
    with pytest.raises(TPError, match="'lm_head.mystery' has no tensor-parallel rule"):
        tp_shard(odd, Target(config, tp=2))
