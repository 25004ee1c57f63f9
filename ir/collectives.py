"""Tensor parallelism in the IR: shard specs, the collective ops, and the rank-local ops that
`passes/tp_shard.py` inserts (spec section 10, docs/ir.md "Tensor parallelism").

A sharded graph is ONE rank-generic (SPMD) graph. Every tensor's shape is the shape ONE rank holds;
a `ShardSpec` on a weight, state or output says which slice of the full tensor that is, and the rank
is a run-time input (`tp_rank`), never a compile-time constant. Tensors without a shard spec are
replicated: every rank holds all of it (bitwise the same, see `AllReduce`).

Collectives take one operand per rank and give one result per rank: `exchange(per_rank_inputs)`
is their semantics, run by `ir/ranks.py` over all ranks in lockstep. Their single-rank `semantics_fn`
only gives shapes (for `infer` on meta tensors) and refuses real tensors, so the one-rank interpreter
cannot silently run a sharded graph as if it were whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3mk.ir.ops import Op, op

F32 = torch.float32
TP_RANK = "tp_rank"  # the step input [1] int32 holding this rank's index (a run-time parameter)


@dataclass(frozen=True)
class ShardSpec:
    """Rank r holds piece r of `parts` equal pieces of dimension `dim` of the full tensor. With
    `groups` > 1 the dimension is first cut into `groups` equal blocks and rank r holds piece r of
    every block, in block order (the KDA conv state is q|k|v along its last dim, spec 8)."""

    dim: int
    parts: int
    groups: int = 1

    def local_shape(self, full: tuple[int, ...], where: str = "") -> tuple[int, ...]:
        size = full[self.dim]
        if size % (self.parts * self.groups):
            raise ValueError(f"{where}: dimension {self.dim} of size {size} does not split into {self.groups} x {self.parts} equal pieces")
        return full[: self.dim] + (size // self.parts,) + full[self.dim + 1 :]

    def ranges(self, size: int, rank: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges of the full dimension (of `size`) that rank `rank` holds, in order."""
        block = size // self.groups
        piece = block // self.parts
        return [(g * block + rank * piece, g * block + (rank + 1) * piece) for g in range(self.groups)]

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of the full tensor (what the loader binds on that rank)."""
        blocks = full.chunk(self.groups, dim=self.dim)
        return torch.cat([b.chunk(self.parts, dim=self.dim)[rank] for b in blocks], dim=self.dim).contiguous()

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order (the inverse of `take`)."""
        per_rank = [p.chunk(self.groups, dim=self.dim) for p in pieces]
        return torch.cat([per_rank[r][g] for g in range(self.groups) for r in range(self.parts)], dim=self.dim)

    def text(self) -> str:
        groups = f"x{self.groups}" if self.groups > 1 else ""
        return f"split(dim={self.dim}, parts={self.parts}{groups})"


class Collective(Op):
    """An op whose semantics need every rank's operand: `exchange` maps per-rank inputs to per-rank
    outputs. Every collective has the attribute `ranks` (the group size)."""

    def exchange(self, inputs: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
        raise NotImplementedError


def _shape_only(name: str, shape_fn):
    def semantics(x: torch.Tensor, *attributes):
        if not x.is_meta and attributes[0] > 1:
            raise RuntimeError(f"{name} needs the operands of all {attributes[0]} ranks: run the graph with k3mk.ir.ranks.run")
        return shape_fn(x, *attributes)

    return semantics


def _gathered(x: torch.Tensor, ranks: int, dim: int) -> torch.Tensor:
    return torch.cat([x] * ranks, dim=dim)


@op("all_reduce", semantics_fn=_shape_only("all_reduce", lambda x, ranks: x.clone()))
class AllReduce(Collective):
    """(x) -> the sum of every rank's x, same shape and dtype. Every rank adds the N operands in rank
    order in fp32 and rounds once, so every rank holds bitwise the same result: replicated decisions
    downstream (the router's top-k) are the same on every rank."""

    ranks: int

    def exchange(self, inputs):
        xs = [x for (x,) in inputs]
        total = rank_order_sum(xs)
        return [(total.clone(),) for _ in xs]


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """((x0 + x1) + x2) + ... in fp32, rounded once to the operands' dtype: the order the megakernel's
    all_reduce adds the ranks' slots in (codegen/templates/all_reduce.py.j2), so it is bitwise equal."""
    total = xs[0].to(F32)
    for x in xs[1:]:
        total = total + x.to(F32)
    return total.to(xs[0].dtype)


@op("all_gather", semantics_fn=_shape_only("all_gather", _gathered))
class AllGather(Collective):
    """(x) -> every rank's x concatenated along `dim` in rank order."""

    ranks: int
    dim: int

    def exchange(self, inputs):
        full = torch.cat([x for (x,) in inputs], dim=self.dim)
        return [(full.clone(),) for _ in inputs]


def shard_slice(x: torch.Tensor, rank: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """This rank's piece of a replicated x along `dim` (no communication). `rank` [1] int32 is the
    step input `tp_rank`; on meta tensors only the shape is known."""
    size = x.shape[dim] // parts
    start = 0 if rank.is_meta else int(rank.reshape(-1)[0]) * size
    return x.narrow(dim, start, size).clone()


@op("shard_slice", semantics_fn=shard_slice)
class ShardSlice(Op):
    """(x [.., n, ..], tp_rank [1]) -> [.., n/parts, ..]: the rank's piece, so a row-parallel linear
    can consume a replicated activation (the normed latent before routed_expert_up_proj, spec 5.3)."""

    dim: int
    parts: int


def argmax_partial(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy candidate of one vocab shard: (max logit [B, 1] fp32, its LOCAL index [B, 1] int32),
    lowest index on ties."""
    values, index = logits.to(F32).max(dim=-1, keepdim=True)
    return values, index.to(torch.int32)


def argmax_combine(values: torch.Tensor, index: torch.Tensor, shard_size: int) -> torch.Tensor:
    """The global greedy token from every rank's candidate ([B, ranks] each, rank order): the first
    rank holding the largest value wins, so ties go to the lowest vocab index as in `argmax`."""
    rank = values.argmax(dim=-1, keepdim=True)
    return (rank.to(torch.int32) * shard_size + index.gather(1, rank)).reshape(-1)


@op("argmax_partial", num_outputs=2, semantics_fn=argmax_partial)
class ArgmaxPartial(Op):
    """(logits [B, V/N]) -> (value [B, 1] fp32, local index [B, 1] int32)"""


@op("argmax_combine", semantics_fn=argmax_combine)
class ArgmaxCombine(Op):
    """(values [B, N] fp32, local indices [B, N] int32) -> next tokens [B] int32"""

    shard_size: int
