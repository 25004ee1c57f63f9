"""CPU (or any-device) interpreter: runs a graph node by node with each op's reference semantics.

`run(graph, values)` takes every WEIGHT, INPUT and STATE tensor by name and returns the OUTPUT tensors
plus the updated state under the STATE names (STATE_OUT tensors are renamed to their alias), which is
exactly what one decode step of the compiled kernel must produce.
"""

from __future__ import annotations

import torch

from k3mk.ir.graph import Graph, IRError, Role


def run(graph: Graph, values: dict[str, torch.Tensor], keep: bool = False) -> dict[str, torch.Tensor]:
    """Execute `graph`. With `keep`, every intermediate is returned too (for bisecting mismatches)."""
    env: dict[str, torch.Tensor] = {}
    for t in graph.tensors.values():
        if t.role in (Role.WEIGHT, Role.INPUT, Role.STATE):
            if t.name not in values:
                raise IRError(f"interpreter: no value for {t.role.value} tensor '{t.name}'")
            env[t.name] = values[t.name]
    for n in graph.nodes:
        try:
            outs = n.op.evaluate(*(env[i] for i in n.inputs))
        except Exception as e:
            raise IRError(f"interpreter: node '{n.name}' ({n.op.describe()}) failed: {e}") from e
        for name, value in zip(n.outputs, outs):
            env[name] = value
    result = {}
    for t in graph.tensors.values():
        if t.role == Role.OUTPUT:
            result[t.name] = env[t.name]
        elif t.role == Role.STATE_OUT:
            result[t.alias] = env[t.name]
    if keep:
        result.update({k: v for k, v in env.items() if k not in result})
    return result
