"""tp_shard: the whole-model graph -> ONE rank-generic (SPMD) graph of a tensor-parallel group of
`target.tp` ranks (spec section 10; docs/ir.md "Tensor parallelism").

Guarantees to the next pass:
- every tensor's shape is what ONE rank holds; every weight, state and output that is split carries
  its `ShardSpec` (which slice of the full tensor each rank loads / owns / returns); the others are
  replicated on every rank, and every weight is one or the other by an explicit rule below;
- communication is explicit: `all_reduce` (sum) and `all_gather` nodes (ir/collectives.py); the
  rank is the step input `tp_rank`, read only by `shard_slice`; nothing else depends on the rank;
- run on all ranks in lockstep (ir/ranks.py), the graph computes the unsharded graph's logits (the
  vocab-split output, assembled), next tokens and state (each rank's state shard, assembled);
- tp == 1: the graph is returned unchanged.

What is split (weights by name, `_WEIGHT_RULES`):
- KDA: heads (q, k, v, g, b, f_b / g_b, conv taps, A_log, dt_bias, conv and recurrent state);
  f_a / g_a (low-rank inputs, [D, d]) and the shared per-head o_norm gain replicated; o_proj
  row-parallel -> all_reduce.
- MLA: heads (q_b or q_proj, kv_b, g_proj); q_a / kv_a and their norms replicated, so is the latent
  cache (one shared KV head, every rank writes the same row); o_proj row-parallel -> all_reduce.
  Splitting q_a/kv_a too would save 0.68 GB/token/rank at TP16 (24 layers x 30.3 MB x 15/16) for one
  more all_gather on every MLA layer's critical path (spec 11 note); we keep vLLM's choice.
- MoE: the routed experts are split by their INTERMEDIATE size (w1/w3 rows, w2 columns; MXFP4 scale
  groups stay whole), not by expert (EP). At batch-1 decode with top-k of E experts, EP makes the
  busiest rank read all of its selected experts (the expected maximum over ranks), while this split
  makes every rank read 1/N of every selected expert. K3, 17.5 MB per MXFP4 expert, top-16, per MoE
  layer: TP8 35.1 MB/rank vs EP8 73.3 MB on the busiest rank (E[max] = 4.18 of the 16 experts on
  one of 8 ranks); TP16 17.5 MB/rank vs EP16 53.5 MB (E[max] 3.05); over 92 layers 3.23 vs 6.74 and
  1.61 vs 4.92 GB/token (bench/compile_k3.py computes these exactly). The busiest rank sets the step
  time, so EP costs 2.1x / 3.1x the routed-expert bytes; the split costs nothing extra in
  communication (both need the full latent on every rank and a latent all_reduce).
  LatentMoE: routed_expert_down_proj column-parallel (-> all_gather of the latent z),
  routed_expert_up_proj row-parallel on this rank's slice of the normed latent; the latent partial
  sums are all_reduced BEFORE routed_expert_norm (spec 5.3). Replicating down/up would cost
  9.5 GB/token/rank at TP16 (spec 11 note). Shared experts and the dense MLP: gate/up column-,
  down row-parallel; the routed and shared partial sums are added and all_reduced once. Router
  replicated (fp32 logits; bitwise-equal inputs on every rank, so the same experts everywhere).
- lm_head split by vocab; the logits OUTPUT stays vocab-split (each rank returns its slice). Greedy:
  each rank's (max, local index) candidate is all_gathered and the first rank holding the maximum
  wins (lowest index on ties). Embedding replicated: one row per token is read, so splitting it
  would save memory only (2.35 GB of K3's ~98 GB per GPU at TP16) and add an all_reduce per step.

How: the activations' distributions (replicated, split along a dim, or partial sums) are propagated
node by node. Each op kind lists the operand distributions it accepts (`_RULES`); the weights'
distributions are fixed by their rules, so the pass takes the alternative whose activation
operands need the fewest elements communicated: partial -> all_reduce, split -> all_gather,
replicated -> shard_slice (local). A partial sum is reduced once, where a consumer first needs it
whole; residual adds reduce the mixer/FFN output, so the residual stream (and the block residual's
prefix) stays replicated and rounds exactly as in the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from k3mk.compiler.config import ModelConfig
from k3mk.ir.collectives import TP_RANK, AllGather, AllReduce, ArgmaxCombine, ArgmaxPartial, ShardSlice, ShardSpec
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import infer
from k3mk.passes.manager import Target


class TPError(ValueError):
    """The model cannot be split N ways, or the graph holds something the pass has no rule for."""


PARTIAL = "partial"  # an activation that is one rank's addend of the full value
Dist = ShardSpec | str | None  # None: replicated

# (pattern on the weight name's tail, split dim or None = replicated by design); first match wins
_WEIGHT_RULES: tuple[tuple[str, int | None], ...] = (
    (r"self_attn\.(q|k|v|g|b|f_b|g_b|q_b|kv_b)_proj\.weight", 0),
    (r"self_attn\.(q|k|v)_conv1d\.weight", 0),
    (r"self_attn\.(A_log|dt_bias)", 0),
    (r"self_attn\.o_proj\.weight", 1),
    (r"self_attn\.(f_a_proj|g_a_proj|o_norm|q_a_proj|q_a_layernorm|kv_a_proj_with_mqa|kv_a_layernorm)\.weight", None),
    (r"(mlp|shared_experts)\.(gate|up)_proj\.weight", 0),
    (r"(mlp|shared_experts)\.down_proj\.weight", 1),
    (r"experts\.(w1|w3)\.weight(_packed|_scale)?", 1),
    (r"experts\.w2\.weight(_packed|_scale)?", 2),
    (r"routed_expert_down_proj\.weight", 0),
    (r"routed_expert_up_proj\.weight", 1),
    (r"(gate\.weight|gate\.e_score_correction_bias|routed_expert_norm\.weight)", None),
    (r"lm_head\.weight", 0),
    (r"(embed_tokens|norm|input_layernorm|post_attention_layernorm|[a-z_]+_res_norm|[a-z_]+_res_proj)\.weight", None),
)

# state name tail -> (split dim, groups) or None (replicated); spec 8 (vLLM's per-rank layouts)
_STATE_RULES: dict[str, tuple[int, int] | None] = {
    "conv_state": (2, 3),  # [B, W-1, 3P]: q|k|v, each split by head
    "recurrent_state": (1, 1),  # [B, H, V, K]
    "kv_cache": None,  # [B, T, C]: one latent KV head, replicated
}

# op kind -> alternatives (operand distributions, output distributions, attributes divided by N).
# Tokens: R replicated, P partial, an integer the split dim (negative from the end), "d/g" split dim d
# of g groups. Ops not listed take and give replicated tensors only (_REPLICATED_OPS).
_RULES: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "linear": (("R R", "R", ()), ("R 0", "-1", ()), ("-1 1", "P", ())),
    "expert_linear": (("R R R", "R", ()), ("R 1 R", "-1", ()), ("-1 2 R", "P", ())),
    "expert_linear_mxfp4": (("R R R R", "R", ()), ("R 1 1 R", "-1", ()), ("-1 2 2 R", "P", ())),
    "kda_conv": (("-1 -1 -1 2/3 0 0 0", "-1 -1 -1 2/3", ()),),
    "kda_gate": (("-1 0 0", "1", ("num_heads",)),),
    "kda_recurrence": (("-1 -1 -1 1 -1 1", "-1 1", ()),),
    "gated_rmsnorm": (("-1 -1 R", "-1", ()),),
    "mla_attention": (("-1 R R 0", "-1", ("num_heads",)),),
    "sigmoid_gate": (("R R", "R", ()), ("-1 -1", "-1", ())),
    "situ_mul": (("R R", "R", ()), ("-1 -1", "-1", ())),
    "silu_mul": (("R R", "R", ()), ("-1 -1", "-1", ())),
    "moe_combine": (("R R", "R", ()), ("P R", "P", ()), ("-1 R", "-1", ())),
    "add": (("R R", "R", ()), ("P P", "P", ())),
}
_REPLICATED_OPS = {"embedding", "rmsnorm", "mla_latent", "mla_cache_write", "router_topk", "attn_res"}


def tp_shard(graph: Graph, target: Target) -> Graph:
    """Split `graph` for `target.tp` ranks (see the module docstring); tp 1 is the identity."""
    if target.tp == 1:
        return graph
    check_divisible(target.config, target.tp)
    return _Sharder(graph, target.tp).run()


def check_divisible(config: ModelConfig, tp: int) -> None:
    """Every split dimension divides by `tp`; the error names the config field."""
    moe = config.moe
    dims = {
        "kda.num_heads": config.kda.num_heads,
        "mla.num_heads": config.mla.num_heads,
        "dense_intermediate_size": config.dense_intermediate_size,
        "moe.intermediate_size": moe.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    if moe.latent_size:
        dims["moe.latent_size"] = moe.latent_size
    if moe.expert_format == "mxfp4":  # w2's UE8M0 scales are split by whole groups of 32 inputs
        dims[f"moe.intermediate_size / mxfp4_group_size ({moe.mxfp4_group_size})"] = moe.intermediate_size // moe.mxfp4_group_size
    for name, size in dims.items():
        if size % tp:
            raise TPError(f"tensor parallel degree {tp} does not divide {name} = {size} of model '{config.name}'")


def weight_split(name: str) -> int | None:
    """The split dim of weight `name` (None: replicated by design); an unknown weight is an error."""
    for pattern, dim in _WEIGHT_RULES:
        if re.search(rf"(?:^|\.){pattern}$", name):
            return dim
    raise TPError(f"weight '{name}' has no tensor-parallel rule (passes/tp_shard.py _WEIGHT_RULES)")


def state_split(name: str) -> tuple[int, int] | None:
    tail = name.rsplit(".", 1)[-1]
    if tail not in _STATE_RULES:
        raise TPError(f"state '{name}' has no tensor-parallel rule (passes/tp_shard.py _STATE_RULES)")
    return _STATE_RULES[tail]


@functools.lru_cache(maxsize=None)
def _infer(op, types: tuple) -> tuple:
    """`infer`, memoized: the layers repeat the same few (op, operand types), and shape inference runs
    the semantics on meta tensors (~1 ms a node)."""
    return tuple(infer(op, list(types)))


def _parse(token: str, ndim: int, tp: int) -> Dist:
    if token == "R":
        return None
    if token == "P":
        return PARTIAL
    dim, _, groups = token.partition("/")
    return ShardSpec(int(dim) % ndim, tp, int(groups or 1))


def _describe(d: Dist) -> str:
    return "replicated" if d is None else d if isinstance(d, str) else d.text()


class _Sharder:
    def __init__(self, graph: Graph, tp: int):
        self.src, self.tp = graph, tp
        self.out = Graph(meta={**graph.meta, "tp": tp})
        self.dist: dict[str, Dist] = {}
        self.converted: dict[tuple[str, str], str] = {}  # (tensor, target) -> converted tensor

    def run(self) -> Graph:
        for t in self.src.tensors.values():
            if t.role in (Role.WEIGHT, Role.STATE, Role.INPUT):
                self._add_input(t)
        self.out.add_tensor(Tensor(TP_RANK, (1,), torch.int32, Role.INPUT))
        self.dist[TP_RANK] = None
        for node in self.src.nodes:
            if node.op.name == "argmax":
                self._argmax(node)
            else:
                self._node(node)
        return self.out

    # --- graph inputs -------------------------------------------------------------------------------
    def _add_input(self, t: Tensor) -> None:
        spec = None
        if t.role == Role.WEIGHT:
            dim = weight_split(t.name)
            spec = None if dim is None else ShardSpec(dim, self.tp)
        elif t.role == Role.STATE:
            split = state_split(t.name)
            spec = None if split is None else ShardSpec(split[0], self.tp, split[1])
        shape = spec.local_shape(t.shape, f"{t.role.value} '{t.name}'") if spec else t.shape
        self.out.add_tensor(dataclasses.replace(t, shape=shape, shard=spec))
        self.dist[t.name] = spec

    # --- one node -----------------------------------------------------------------------------------
    def _where(self, node: Node) -> str:
        return f"node '{node.name}' ({node.op.name}{', from ' + node.origin if node.origin else ''})"

    def _node(self, node: Node) -> None:
        if node.op.name in _RULES:
            alternatives = _RULES[node.op.name]
        elif node.op.name in _REPLICATED_OPS:
            alternatives = ((" ".join("R" * len(node.inputs)), " ".join("R" * len(node.outputs)), ()),)
        else:
            raise TPError(f"{self._where(node)}: tp_shard has no rule for op kind '{node.op.name}'")
        best = None
        for operands, results, divided in alternatives:
            wanted = [_parse(tok, len(self.src.tensors[i].shape), self.tp) for tok, i in zip(operands.split(), node.inputs)]
            cost = self._cost(node.inputs, wanted)
            if cost is None:
                continue
            # a partial result will be reduced by some consumer: count it now, so that reducing the
            # small combined latent beats reducing every expert's output, and ties keep tensors whole
            cost += sum(self.src.tensors[o].numel for tok, o in zip(results.split(), node.outputs) if tok == "P")
            if best is None or cost < best[0]:
                best = (cost, wanted, results, divided)
        if best is None:
            have = ", ".join(f"{i}: {_describe(self.dist[i])}" for i in node.inputs)
            raise TPError(f"{self._where(node)}: no tensor-parallel form of '{node.op.name}' accepts its operands ({have})")
        _, wanted, results, divided = best
        inputs = tuple(self._convert(i, w, node) for i, w in zip(node.inputs, wanted))
        op = dataclasses.replace(node.op, **{a: getattr(node.op, a) // self.tp for a in divided})
        out_dists = [_parse(tok, len(self.src.tensors[o].shape), self.tp) for tok, o in zip(results.split(), node.outputs)]
        self._emit(node.name, op, inputs, node.outputs, out_dists, node.origin)

    def _cost(self, inputs: tuple[str, ...], wanted: list[Dist]) -> float | None:
        """Elements communicated to bring `inputs` to `wanted` (a local slice costs a token 1); None
        if impossible. Graph inputs (weights, state) are laid out once for all: they must match."""
        cost = 0.0
        for name, want in zip(inputs, wanted):
            have = self.dist[name]
            if have == want:
                continue
            if self.src.tensors[name].role in (Role.WEIGHT, Role.STATE, Role.INPUT):
                return None
            kind = self._conversion(have, want)
            if kind is None:
                return None
            if (name, f"{kind}:{_describe(want)}") not in self.converted:  # an earlier consumer paid for it
                cost += 1 if kind == "shard_slice" else self.src.tensors[name].numel
        return cost

    @staticmethod
    def _conversion(have: Dist, want: Dist) -> str | None:
        if want is None and have == PARTIAL:
            return "all_reduce"
        if want is None and isinstance(have, ShardSpec) and have.groups == 1:
            return "all_gather"
        if have is None and isinstance(want, ShardSpec) and want.groups == 1:
            return "shard_slice"
        return None

    def _convert(self, name: str, want: Dist, node: Node) -> str:
        have = self.dist[name]
        if have == want:
            return name
        kind = self._conversion(have, want)
        key = (name, f"{kind}:{_describe(want)}")
        if key not in self.converted:
            if kind == "all_reduce":
                op, inputs = AllReduce(self.tp), (name,)
            elif kind == "all_gather":
                op, inputs = AllGather(self.tp, have.dim), (name,)
            else:
                op, inputs = ShardSlice(want.dim, self.tp), (name, TP_RANK)
            new = f"{name}.{kind}"
            self._emit(new, op, inputs, (new,), [want], f"tp_shard, for {self._where(node)}")
            self.converted[key] = new
        return self.converted[key]

    def _emit(self, name, op, inputs, outputs, dists, origin) -> None:
        """Add node `name` and its outputs (local shapes from the semantics; roles from the source graph,
        new tensors are activations)."""
        types = _infer(op, tuple((self.out.tensors[i].shape, self.out.tensors[i].dtype) for i in inputs))
        for o, (shape, dtype), d in zip(outputs, types, dists):
            src = self.src.tensors.get(o)
            t = Tensor(o, shape, dtype, src.role if src else Role.ACTIVATION, src.alias if src else None)
            if t.role in (Role.OUTPUT, Role.STATE_OUT):
                if d == PARTIAL:
                    raise TPError(f"{t.role.value} '{o}' would be a partial sum (node '{name}')")
                if t.role == Role.STATE_OUT and d != self.dist[t.alias]:
                    raise TPError(f"state output '{o}' would be {_describe(d)}, its state '{t.alias}' is {_describe(self.dist[t.alias])}")
                t.shard = d
            self.out.add_tensor(t)
            self.dist[o] = d
        self.out.add_node(Node(name, op, tuple(inputs), tuple(outputs), origin))

    def _argmax(self, node: Node) -> None:
        """Greedy over vocab-split logits: per-rank candidates, all_gathered, first maximum wins."""
        (logits,), (tokens,) = node.inputs, node.outputs
        split = self.dist[logits]
        if split is None:
            return self._emit(node.name, node.op, (logits,), (tokens,), [None], node.origin)
        if not (isinstance(split, ShardSpec) and split.dim == 1 and split.groups == 1):
            raise TPError(f"{self._where(node)}: logits '{logits}' are {_describe(split)}, expected replicated or split by vocab")
        value, index = f"{node.name}.value", f"{node.name}.index"
        self._emit(f"{node.name}.partial", ArgmaxPartial(), (logits,), (value, index), [split, split], node.origin)
        gathered = [self._convert(t, None, node) for t in (value, index)]
        shard_size = self.out.tensors[logits].shape[1]
        self._emit(node.name, ArgmaxCombine(shard_size), tuple(gathered), (tokens,), [None], node.origin)
