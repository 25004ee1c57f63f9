"""Capture (compiler/capture.py): the captured IR, run by the interpreter, IS the reference decode step;
config features show up in the IR; torch ops outside the IR op set are a clear CaptureError."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from k3mk.compiler.capture import CaptureError, capture
from k3mk.compiler.config import ModelConfig, load_config
from k3mk.compiler.random_weights import random_weights
from k3mk.compiler.reference import DecodeStep
from k3mk.compiler.weights import state_specs
from k3mk.ir.graph import Graph
from k3mk.ir.interpreter import run

MAX_CONTEXT = 12


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}


@functools.cache
def weights(name: str) -> dict[str, torch.Tensor]:
    return random_weights(CONFIGS[name](), 1, torch.float32, "cpu")


def random_step(config: ModelConfig, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Token ids, positions and a decode state: all random (positions anywhere in the cache)."""
    gen = torch.Generator().manual_seed(seed)
    values = {
        "token_ids": torch.randint(0, config.vocab_size, (batch,), generator=gen),
        "positions": torch.randint(0, MAX_CONTEXT, (batch,), generator=gen),
    }
    for s in state_specs(config, batch, MAX_CONTEXT):
        scale = 0.1 if s.name.endswith("recurrent_state") else 1.0
        values[s.name] = scale * torch.randn(s.shape, generator=gen)
    return values


def reference_step(config: ModelConfig, full_weights: dict, values: dict) -> tuple[torch.Tensor, dict]:
    step = DecodeStep(config, torch.float32)
    step.load_state_dict(full_weights)
    states = {k: v for k, v in values.items() if k not in ("token_ids", "positions")}
    with torch.no_grad():
        return step(values["token_ids"], values["positions"], states)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_interpreter_equals_reference(name, batch):
    config = CONFIGS[name]()
    graph = capture(config, batch, MAX_CONTEXT, torch.float32)
    values = random_step(config, batch, seed=2)
    logits, new_state = reference_step(config, weights(name), values)
    out = run(graph, {**weights(name), **values})
    torch.testing.assert_close(out["logits"], logits, rtol=0, atol=0)
    assert torch.equal(out["next_tokens"], logits.argmax(-1).to(torch.int32))
    assert set(new_state) == {s.name for s in state_specs(config, batch, MAX_CONTEXT)}
    for key, value in new_state.items():
        assert torch.equal(out[key], value), key
        assert not torch.equal(value, values[key]), f"{key} was not updated"


def kinds(graph: Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in graph.nodes:
        counts[n.op.name] = counts.get(n.op.name, 0) + 1
    return counts


def kda_gate_bounds(graph: Graph) -> set:
    return {n.op.lower_bound for n in graph.nodes if n.op.name == "kda_gate"}


def test_config_features_change_the_ir():
    k3 = load_config("k3-tiny")
    base = capture(k3, 1, 8, torch.float32)
    assert kda_gate_bounds(base) == {-5.0}

    softplus = capture(k3.replace(kda=dataclasses.replace(k3.kda, gate_form="softplus", gate_lower_bound=None)), 1, 8, torch.float32)
    assert kda_gate_bounds(softplus) == {None}

    low_rank = capture(k3.replace(kda=dataclasses.replace(k3.kda, full_rank_output_gate=False)), 1, 8, torch.float32)
    assert "model.layers.0.self_attn.g_a_proj.weight" in low_rank.tensors and "model.layers.0.self_attn.g_proj.weight" not in low_rank.tensors
    assert kinds(low_rank)["linear"] == kinds(base)["linear"] + len(k3.kda_layers)

    q_proj = capture(k3.replace(mla=dataclasses.replace(k3.mla, q_lora_rank=None)), 1, 8, torch.float32)
    assert "model.layers.3.self_attn.q_proj.weight" in q_proj.tensors and "model.layers.3.self_attn.q_a_proj.weight" not in q_proj.tensors
    assert kinds(q_proj)["rmsnorm"] == kinds(base)["rmsnorm"] - len(k3.mla_layers)

    classic = capture(k3.replace(attn_res_block_size=None), 1, 8, torch.float32)
    assert "attn_res" in kinds(base) and "attn_res" not in kinds(classic)
    assert kinds(classic)["add"] > kinds(base)["add"]


def test_unknown_torch_op_is_a_capture_error_naming_op_and_origin(monkeypatch):
    def tanh_glu(self, gate, up):
        return torch.tanh(gate) * up

    monkeypatch.setattr(DecodeStep, "_act_mul", tanh_glu)
    with pytest.raises(CaptureError, match=r"tanh.*not in the IR op set") as info:
        capture(load_config("k3-tiny"), 1, 8, torch.float32)
    # torch.export keeps only the frames of the module's own file: the origin is the reference line
    assert "reference.py" in str(info.value) and "line" in str(info.value)
