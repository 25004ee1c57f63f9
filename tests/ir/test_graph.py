"""The IR core: the verifier rejects each kind of malformed graph, the printer is stable, the
interpreter runs a small graph against the semantics and names what is missing."""

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.ir import semantics
from k3mk.ir.graph import Graph, IRError, Node, Role, Tensor
from k3mk.ir.interpreter import run
from k3mk.ir.ops import OPS, Linear, RMSNorm, infer

F32 = torch.float32


def small_graph() -> Graph:
    """x -> rmsnorm -> linear -> y, with an in-place state update (kda_conv-free: cache write)."""
    g = Graph(meta={"test": 1})
    for t in (
        Tensor("x", (2, 8), F32, Role.INPUT),
        Tensor("norm.weight", (8,), F32, Role.WEIGHT),
        Tensor("proj.weight", (5, 8), F32, Role.WEIGHT),
        Tensor("h", (2, 8), F32, Role.ACTIVATION),
        Tensor("y", (2, 5), F32, Role.OUTPUT),
        Tensor("cache", (2, 4, 5), F32, Role.STATE),
        Tensor("positions", (2,), torch.int64, Role.INPUT),
        Tensor("cache.next", (2, 4, 5), F32, Role.STATE_OUT, alias="cache"),
    ):
        g.add_tensor(t)
    from k3mk.ir.ops import MLACacheWrite

    g.add_node(Node("norm", RMSNorm(1e-5), ("x", "norm.weight"), ("h",)))
    g.add_node(Node("proj", Linear(False), ("h", "proj.weight"), ("y",)))
    g.add_node(Node("write", MLACacheWrite(), ("cache", "y", "positions"), ("cache.next",)))
    return g


def test_small_graph_verifies_and_runs():
    g = small_graph()
    g.verify()
    gen = torch.Generator().manual_seed(1)
    vals = {
        "x": torch.randn(2, 8, generator=gen),
        "norm.weight": torch.randn(8, generator=gen),
        "proj.weight": torch.randn(5, 8, generator=gen),
        "cache": torch.randn(2, 4, 5, generator=gen),
        "positions": torch.tensor([1, 3]),
    }
    out = run(g, vals)
    y = semantics.linear(semantics.rmsnorm(vals["x"], vals["norm.weight"], 1e-5), vals["proj.weight"])
    torch.testing.assert_close(out["y"], y, rtol=0, atol=0)
    expected_cache = vals["cache"].clone()
    expected_cache[0, 1], expected_cache[1, 3] = y[0], y[1]
    torch.testing.assert_close(out["cache"], expected_cache, rtol=0, atol=0)
    with pytest.raises(IRError, match="no value for input tensor 'positions'"):
        run(g, {k: v for k, v in vals.items() if k != "positions"})


def _broken(mutate) -> Graph:
    g = small_graph()
    mutate(g)
    return g


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda g: g.nodes.reverse(), "used before it is produced"),
        (lambda g: setattr(g.tensors["y"], "shape", (2, 6)), r"declared f32\[2, 6\], the op gives f32\[2, 5\]"),
        (lambda g: setattr(g.tensors["h"], "dtype", torch.bfloat16), "the op gives f32"),
        (lambda g: g.nodes.__setitem__(1, Node("proj", Linear(False), ("h", "proj.weight"), ("h",))), "already defined"),
        (lambda g: g.nodes.pop(), "'cache.next' .* is never produced"),
        (lambda g: setattr(g.tensors["cache.next"], "alias", "x"), "must alias a STATE tensor"),
        (lambda g: g.nodes.__setitem__(0, Node("norm", RMSNorm(1e-5), ("x", "nope"), ("h",))), "input 'nope' is not a tensor"),
        (lambda g: g.nodes.__setitem__(0, Node("norm", RMSNorm(1e-5), ("x", "proj.weight"), ("h",))), "operands .* are invalid"),
        (lambda g: g.nodes.append(Node("norm", RMSNorm(1e-5), ("x", "norm.weight"), ("h",))), "node name is used twice"),
    ],
)
def test_verifier_rejects(mutate, message):
    with pytest.raises(IRError, match=message):
        _broken(mutate).verify()


def test_verifier_rejects_unregistered_op_kind():
    class Rogue(RMSNorm):
        pass

    g = small_graph()
    g.nodes[0] = Node("norm", Rogue(1e-5), ("x", "norm.weight"), ("h",))
    with pytest.raises(IRError, match="not in the IR's op set"):
        g.verify()


def test_infer_uses_the_semantics():
    assert infer(Linear(True), [((3, 16), torch.bfloat16), ((7, 16), torch.bfloat16)]) == [((3, 7), F32)]
    assert set(OPS) >= {"linear", "rmsnorm", "kda_recurrence", "mla_attention", "router_topk", "attn_res"}


def test_printer_is_stable_and_complete():
    config = load_config("k3-tiny")
    a = capture(config, 1, 8, F32).text()
    b = capture(config, 1, 8, F32).text()
    assert a == b
    assert "model.layers.3.self_attn.kv_b_proj.weight: f32[512, 128] weight" in a
    assert "layers.0.recurrent_state.next: f32[1, 4, 128, 128] state_out -> layers.0.recurrent_state" in a
    assert "kda_gate(num_heads=4, lower_bound=-5.0)" in a
