"""The IR graph: named tensors (shape, dtype, role) and op nodes in a topological order, with a
networkx view for analyses, a verifier and a stable text printer (docs/ir.md).

SSA form: every tensor is produced by exactly one node or is a graph input (a weight, a step input or
a state tensor). A state update is a node output with role STATE_OUT whose `alias` names the STATE
input it replaces: the kernel writes it in place, the interpreter returns it under the state's name.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import networkx as nx
import torch

from k3mk.ir.ops import OPS, Op, infer
from k3mk.ir.collectives import ShardSpec  # also registers the TP ops, so verify() knows them


class Role(enum.Enum):
    WEIGHT = "weight"  # bound by name at load time, read-only
    INPUT = "input"  # per-step input (token ids, positions)
    STATE = "state"  # decode state read by the step (KDA conv/recurrent state, latent cache)
    STATE_OUT = "state_out"  # the updated state, written in place over its `alias`
    OUTPUT = "output"  # per-step output (logits, next tokens)
    ACTIVATION = "activation"  # intermediate, lives in the activation arena


_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    alias: str | None = None  # STATE_OUT: the STATE tensor it overwrites
    shard: ShardSpec | None = None  # under TP: which slice of the full tensor `shape` is; None: replicated (or an activation)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def text(self) -> str:
        alias = f" -> {self.alias}" if self.alias else ""
        shard = f" {self.shard.text()}" if self.shard else ""
        return f"{self.name}: {dtype_name(self.dtype)}{list(self.shape)} {self.role.value}{alias}{shard}"


@dataclass
class Node:
    name: str
    op: Op
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    origin: str = ""  # where it came from (the captured torch node / the pass that made it), for errors

    def text(self) -> str:
        outs = ", ".join(self.outputs)
        return f"{outs} = {self.op.describe()}({', '.join(self.inputs)})  # {self.name}"


class IRError(ValueError):
    """A malformed graph: names the node/tensor and what is wrong."""


@dataclass
class Graph:
    tensors: dict[str, Tensor] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # model name, config hash, batch, context, tp degree/rank, ...

    # --- building ---------------------------------------------------------------------------------
    def add_tensor(self, tensor: Tensor) -> Tensor:
        if tensor.name in self.tensors:
            raise IRError(f"tensor '{tensor.name}' is defined twice")
        self.tensors[tensor.name] = tensor
        return tensor

    def add_node(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def copy(self) -> "Graph":
        return Graph(
            {k: dataclasses.replace(t) for k, t in self.tensors.items()},
            [dataclasses.replace(n) for n in self.nodes],
            dict(self.meta),
        )

    # --- queries ----------------------------------------------------------------------------------
    def by_role(self, role: Role) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role == role]

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {name: [] for name in self.tensors}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n)
        return out

    def to_networkx(self) -> nx.DiGraph:
        """Node-level dataflow graph: an edge u -> v for each tensor u produces and v consumes."""
        g = nx.DiGraph()
        prod = self.producers()
        for n in self.nodes:
            g.add_node(n.name, node=n)
        for n in self.nodes:
            for i in n.inputs:
                if i in prod:
                    g.add_edge(prod[i].name, n.name, tensor=i)
        return g

    # --- checking and printing --------------------------------------------------------------------
    def verify(self) -> None:
        """SSA, topological order, known ops, arity, roles, and shapes/dtypes equal to the semantics'."""
        defined = {t.name for t in self.tensors.values() if t.role in (Role.WEIGHT, Role.INPUT, Role.STATE)}
        produced: set[str] = set()
        names: set[str] = set()
        for n in self.nodes:
            where = f"node '{n.name}' ({n.op.name}{', from ' + n.origin if n.origin else ''})"
            if n.name in names:
                raise IRError(f"{where}: node name is used twice")
            names.add(n.name)
            if OPS.get(n.op.name) is not type(n.op):
                raise IRError(f"{where}: op kind '{n.op.name}' is not in the IR's op set")
            for i in n.inputs:
                if i not in self.tensors:
                    raise IRError(f"{where}: input '{i}' is not a tensor of the graph")
                if i not in defined:
                    raise IRError(f"{where}: input '{i}' is used before it is produced")
            if len(n.outputs) != n.op.num_outputs:
                raise IRError(f"{where}: has {len(n.outputs)} outputs, the op produces {n.op.num_outputs}")
            try:
                expected = infer(n.op, [(self.tensors[i].shape, self.tensors[i].dtype) for i in n.inputs])
            except Exception as e:  # the semantics rejected the operand shapes
                raise IRError(f"{where}: operands {[self.tensors[i].text() for i in n.inputs]} are invalid: {e}") from None
            for o, (shape, dtype) in zip(n.outputs, expected):
                t = self.tensors.get(o)
                if t is None:
                    raise IRError(f"{where}: output '{o}' is not a tensor of the graph")
                if o in defined:
                    raise IRError(f"{where}: output '{o}' is already defined (SSA)")
                if t.role not in (Role.ACTIVATION, Role.OUTPUT, Role.STATE_OUT):
                    raise IRError(f"{where}: output '{o}' has role {t.role.value}")
                if (t.shape, t.dtype) != (shape, dtype):
                    raise IRError(
                        f"{where}: output '{o}' is declared {dtype_name(t.dtype)}{list(t.shape)}, "
                        f"the op gives {dtype_name(dtype)}{list(shape)}"
                    )
                defined.add(o)
                produced.add(o)
        for t in self.tensors.values():
            if t.role in (Role.ACTIVATION, Role.OUTPUT, Role.STATE_OUT) and t.name not in produced:
                raise IRError(f"tensor '{t.name}' ({t.role.value}) is never produced")
            if t.role == Role.STATE_OUT:
                src = self.tensors.get(t.alias or "")
                if src is None or src.role != Role.STATE or (src.shape, src.dtype, src.shard) != (t.shape, t.dtype, t.shard):
                    raise IRError(f"state output '{t.name}' must alias a STATE tensor of the same type and shard, found alias {t.alias!r}")
            if t.shard is not None and (t.shard.parts != self.meta.get("tp") or not 0 <= t.shard.dim < len(t.shape)):
                raise IRError(f"tensor '{t.name}' has shard {t.shard.text()}, the graph has tp={self.meta.get('tp')} and {len(t.shape)} dims")

    def text(self) -> str:
        """Stable text form: header, tensors grouped by role in name order, then the nodes in order."""
        lines = [f"# k3mk IR {' '.join(f'{k}={self.meta[k]}' for k in sorted(self.meta))}"]
        for role in Role:
            if role == Role.ACTIVATION:
                continue
            for t in sorted(self.by_role(role), key=lambda t: t.name):
                lines.append(t.text())
        for n in self.nodes:
            types = ", ".join(f"{dtype_name(self.tensors[o].dtype)}{list(self.tensors[o].shape)}" for o in n.outputs)
            lines.append(f"{n.text()}  : {types}")
        return "\n".join(lines) + "\n"
