"""Run a tensor-parallel (SPMD) graph on N simulated ranks in lockstep on the CPU (docs/ir.md).

Each rank gets its slices of the FULL weights, inputs and state (cut by the tensors' shard specs,
`tp_rank` set to its index) and runs every node with the op's reference semantics; a collective
node instead takes every rank's operands at once (`Collective.exchange`). The result has the same
form as `ir.interpreter.run` on the unsharded graph: split outputs and state are assembled from
the ranks' pieces, replicated ones must be bitwise equal on every rank and are returned once.
"""

from __future__ import annotations

import torch

from k3mk.ir.collectives import TP_RANK, Collective
from k3mk.ir.graph import Graph, IRError, Role


def rank_inputs(graph: Graph, values: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` binds: its piece of every full WEIGHT / INPUT / STATE value, and its index."""
    env: dict[str, torch.Tensor] = {}
    for t in graph.tensors.values():
        if t.role not in (Role.WEIGHT, Role.INPUT, Role.STATE):
            continue
        if t.name == TP_RANK:
            env[t.name] = torch.tensor([rank], dtype=torch.int32)
            continue
        if t.name not in values:
            raise IRError(f"ranks: no value for {t.role.value} tensor '{t.name}'")
        piece = t.shard.take(values[t.name], rank) if t.shard else values[t.name]
        if tuple(piece.shape) != t.shape:
            raise IRError(f"ranks: rank {rank}'s piece of '{t.name}' is {list(piece.shape)}, the graph declares {list(t.shape)}")
        env[t.name] = piece
    return env


def run(graph: Graph, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Execute `graph` on `graph.meta['tp']` ranks; returns the OUTPUT tensors and the updated state
    under the STATE names, whole."""
    tp = graph.meta.get("tp", 1)
    envs = [rank_inputs(graph, values, r) for r in range(tp)]
    for n in graph.nodes:
        try:
            if isinstance(n.op, Collective):
                outs = n.op.exchange([tuple(env[i] for i in n.inputs) for env in envs])
            else:
                outs = [n.op.evaluate(*(env[i] for i in n.inputs)) for env in envs]
        except Exception as e:
            raise IRError(f"ranks: node '{n.name}' ({n.op.describe()}) failed: {e}") from e
        for env, results in zip(envs, outs):
            env.update(zip(n.outputs, results))
    result = {}
    for t in graph.tensors.values():
        if t.role in (Role.OUTPUT, Role.STATE_OUT):
            result[t.alias if t.role == Role.STATE_OUT else t.name] = _whole(t.name, t.shard, [env[t.name] for env in envs])
    return result


def _whole(name: str, shard, pieces: list[torch.Tensor]) -> torch.Tensor:
    if shard is not None:
        return shard.assemble(pieces)
    for rank, piece in enumerate(pieces[1:], start=1):
        if not torch.equal(piece, pieces[0]):
            raise IRError(f"ranks: replicated tensor '{name}' differs between rank 0 and rank {rank}")
    return pieces[0]
