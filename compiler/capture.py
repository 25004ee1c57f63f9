"""Graph capture: `torch.export` of the reference decode step into the IR, shapes fixed per target.

The reference (compiler/reference.py) is built on the meta device, so capturing the full K3 allocates
no weights. Every `k3mk::*` node maps 1:1 onto the IR op of the same name, its non-tensor arguments
becoming the op's attributes; `getitem` nodes name the results of multi-output ops. Any other torch
op is a CaptureError naming the op and the line of the reference it came from.
"""

from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree

from k3mk.compiler.config import ModelConfig
from k3mk.compiler.reference import DecodeStep
from k3mk.compiler.weights import state_specs
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import OPS, Op


class CaptureError(ValueError):
    pass


def _origin(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File")]
    return lines[-1] if lines else "<unknown>"


def _op_from_node(node: torch.fx.Node) -> tuple[Op, list[torch.fx.Node]]:
    target = node.target
    namespace = getattr(target, "namespace", None)
    name = getattr(getattr(target, "_schema", None), "name", "").split("::")[-1]
    if namespace != "k3mk" or name not in OPS:
        raise CaptureError(f"torch op '{target}' is not in the IR op set (from {_origin(node)})")
    tensors: list[torch.fx.Node] = []
    attrs: list = []
    for i, arg in enumerate(target._schema.arguments):  # export drops arguments equal to their default
        a = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
        if isinstance(a, torch.fx.Node):
            tensors.append(a)
        elif isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.fx.Node) for x in a):
            tensors.extend(a)  # variadic tensor list (attn_res sources)
        else:
            attrs.append(a)
    return OPS[name](*attrs), tensors


def capture(
    config: ModelConfig,
    batch: int,
    max_context: int,
    dtype: torch.dtype = torch.bfloat16,
    greedy: bool = True,
) -> Graph:
    """Capture one decode step of `batch` tokens with a latent cache of `max_context` positions.
    With `greedy`, the step also returns `next_tokens` (argmax of the logits)."""
    model = DecodeStep(config, dtype=dtype, device="meta")
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    ids, positions = meta((batch,), torch.int64), meta((batch,), torch.int64)
    states = {s.name: meta(s.shape, s.torch_dtype(dtype)) for s in state_specs(config, batch, max_context)}
    ep = torch.export.export(model, (ids, positions, states), strict=False)

    graph = Graph(meta={"model": config.name, "config": config.hash(), "batch": batch, "max_context": max_context, "dtype": str(dtype).removeprefix("torch.")})
    names: dict[torch.fx.Node, str] = {}
    user_names = iter(pytree.tree_leaves((("token_ids", "positions", {k: k for k in states}), {})))
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(ep.graph_signature.input_specs, placeholders):
        value = node.meta["val"]
        if spec.kind == torch.export.graph_signature.InputKind.BUFFER:
            name, role = spec.target, Role.WEIGHT
        elif spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            name = next(user_names)
            role = Role.INPUT if name in ("token_ids", "positions") else Role.STATE
        else:
            raise CaptureError(f"unexpected export input {spec.kind} '{spec.target}'")
        graph.add_tensor(Tensor(name, tuple(value.shape), value.dtype, role))
        names[node] = name

    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    out_names = pytree.tree_unflatten([None] * len(output_node.args[0]), ep.call_spec.out_spec)
    logits_node, state_nodes = output_node.args[0][0], output_node.args[0][1:]
    state_out_keys = list(out_names[1].keys()) if isinstance(out_names, (list, tuple)) else []
    final_names = {logits_node: ("logits", Role.OUTPUT, None)}
    for key, n in zip(state_out_keys, state_nodes):
        final_names[n] = (f"{key}.next", Role.STATE_OUT, key)

    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            continue  # named together with its producer below
        op, inputs = _op_from_node(node)
        if op.num_outputs == 1:
            outs = [node]
        else:
            getters = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            outs = [getters.get(i) for i in range(op.num_outputs)]
        out_names_: list[str] = []
        for i, out in enumerate(outs):
            val = (out or node).meta["val"]
            val = val[i] if out is None else val
            if out in final_names:
                name, role, alias = final_names[out]
            else:
                name, role, alias = (f"{node.name}.{i}" if out is None else out.name), Role.ACTIVATION, None
            graph.add_tensor(Tensor(name, tuple(val.shape), val.dtype, role, alias))
            if out is not None:
                names[out] = name
            out_names_.append(name)
        graph.add_node(Node(node.name, op, tuple(names[i] for i in inputs), tuple(out_names_), origin=_origin(node)))

    if greedy:
        from k3mk.ir.ops import Argmax

        graph.add_tensor(Tensor("next_tokens", (batch,), torch.int32, Role.OUTPUT))
        graph.add_node(Node("argmax", Argmax(), ("logits",), ("next_tokens",), origin="capture(greedy=True)"))
    graph.verify()
    return graph
