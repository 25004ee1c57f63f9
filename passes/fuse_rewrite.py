"""The graph surgery shared by the fusion rules (passes/fuse_*.py): find producers and sole consumers,
replace sets of nodes by fused nodes, and rebuild the graph once at the end.

Order rule: the nodes that replace a set take the place of the set's LAST node. Every operand of the set
is defined before that point and its results are read only after it (a rule fuses a set only if nothing
outside reads its intermediates), so the node list stays topological without re-sorting, and a fused
node may itself be replaced again later in the same rule (residual chains).
"""

from __future__ import annotations

from k3mk.ir.graph import Graph, IRError, Node, Role, Tensor
from k3mk.ir.ops import Op, infer


class Rewriter:
    """Replacements on a copy of `graph`, applied by `finish()` in one rebuild."""

    def __init__(self, graph: Graph, rule: str):
        # shallow: tensors and nodes are never modified, only added, dropped and replaced
        self.graph = Graph(dict(graph.tensors), list(graph.nodes), dict(graph.meta))
        self.rule = rule  # named in the fused nodes' origin and in errors
        self._position = {n.name: i for i, n in enumerate(graph.nodes)}
        self._slot = {n.name: n.name for n in graph.nodes}  # live node -> the original node whose place it takes
        self._placed: dict[str, list[Node]] = {}  # original node -> what stands there now ([] = removed)
        self._producer = graph.producers()
        self._consumers: dict[str, list[str]] = {}  # tensor -> reading nodes, once per operand
        for n in graph.nodes:
            for i in n.inputs:
                self._consumers.setdefault(i, []).append(n.name)
        self._live = {n.name: n for n in graph.nodes}

    # --- queries ------------------------------------------------------------------------------------
    def producer(self, tensor: str) -> Node | None:
        return self._producer.get(tensor)

    def consumers(self, tensor: str) -> list[Node]:
        return [self._live[c] for c in self._consumers.get(tensor, [])]

    def sole_consumer(self, tensor: str) -> Node | None:
        """The one node reading `tensor`, if exactly one does and `tensor` is an intermediate (not a step
        output or a state update, which must stay materialized)."""
        users = self._consumers.get(tensor, [])
        if len(users) != 1 or self.graph.tensors[tensor].role != Role.ACTIVATION:
            return None
        return self._live[users[0]]

    def produced_for(self, tensor: str, consumer: Node, kinds: tuple[type[Op], ...]) -> Node | None:
        """The producer of `tensor` if it is one of `kinds` and `consumer` is its result's sole reader."""
        p = self._producer.get(tensor)
        if p is None or not isinstance(p.op, kinds) or len(p.outputs) != 1:
            return None
        return p if self.sole_consumer(tensor) is consumer else None

    def tensor(self, name: str) -> Tensor:
        return self.graph.tensors[name]

    # --- edits --------------------------------------------------------------------------------------
    def node(self, name: str, op: Op, inputs: tuple[str, ...], outputs: tuple[str, ...], detail: str) -> Node:
        """A new node; outputs not yet in the graph become activation tensors typed by the op's semantics
        (outputs that exist keep their type: the verifier checks it after the pass)."""
        if any(o not in self.graph.tensors for o in outputs):
            types = infer(op, [(self.graph.tensors[i].shape, self.graph.tensors[i].dtype) for i in inputs])
            for out, (shape, dtype) in zip(outputs, types):
                if out not in self.graph.tensors:
                    self.graph.add_tensor(Tensor(out, shape, dtype, Role.ACTIVATION))
        return Node(name, op, inputs, outputs, origin=f"{self.rule}: {detail}")

    def replace(self, old: list[Node], new: list[Node]) -> None:
        """Put `new` (in order) where the last of `old` stands and drop the rest of `old`. Results of `old`
        that `new` does not produce must have no reader left."""
        slots = [self._slot.pop(n.name) for n in old]
        last = max(slots, key=self._position.__getitem__)
        for slot in slots:
            self._placed[slot] = []
        self._placed[last] = list(new)
        for n in old:
            del self._live[n.name]
            for i in n.inputs:
                self._consumers[i].remove(n.name)
            for o in n.outputs:
                del self._producer[o]
        for n in new:
            if n.name in self._live:
                raise IRError(f"{self.rule}: node name '{n.name}' is already used")
            self._live[n.name] = n
            self._slot[n.name] = last
            for i in n.inputs:
                self._consumers.setdefault(i, []).append(n.name)
            for o in n.outputs:
                self._producer[o] = n
        for n in old:
            for o in n.outputs:
                if o not in self._producer:
                    if self._consumers.get(o):
                        raise IRError(f"{self.rule}: fusing {[m.name for m in old]} drops '{o}', still read by {self._consumers[o]}")
                    self._consumers.pop(o, None)
                    del self.graph.tensors[o]

    def finish(self) -> Graph:
        nodes: list[Node] = []
        for n in self.graph.nodes:
            nodes.extend(self._placed.get(n.name, [n]))
        self.graph.nodes = nodes
        return self.graph


def record(graph: Graph, pattern: str, count: int) -> None:
    """Append "pattern x count" to graph.meta["fusions"] (a new list: Graph.copy shares meta's values)."""
    if count:
        graph.meta["fusions"] = [*graph.meta.get("fusions", []), f"{pattern} x {count}"]
