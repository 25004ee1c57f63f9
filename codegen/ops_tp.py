"""Codegen entries of the tensor-parallel op kinds (spec 10, ir/collectives.py): the collectives
all_reduce / all_gather, which exchange through the ranks' comm regions and wait inside their body for
the other ranks (`sync`; docs/megakernel.md "Tensor parallelism"), and the rank-local shard_slice,
argmax_partial (the argmax template, also writing the maximum's value) and argmax_combine. Registered
into `k3mk.codegen.ops.OP_CODEGEN` at its import.
"""

from __future__ import annotations

from k3mk.codegen.ops import OpCodegen, _check_argmax, _check_batch, _none, _require
from k3mk.ir.task_table import ArgmaxCombineParams, CollectiveParams, ShardSliceParams

MAX_RANKS = 16  # TP16 on NVL72 (DESIGN.md); the templates unroll their loops over the ranks
COLLECTIVE_DTYPES = {"all_reduce": ("bfloat16",), "all_gather": ("bfloat16", "float32", "int32")}


def _check_ranks(ranks: int) -> None:
    _require(2 <= ranks <= MAX_RANKS, f"tensor-parallel ranks {ranks} outside [2, {MAX_RANKS}]")


def _check_collective(op: str):
    def check(p: CollectiveParams) -> None:
        _check_batch(p.rows)
        _check_ranks(p.ranks)
        _require(p.cols >= 1, f"{op} of {p.cols} columns")
        _require(p.dtype in COLLECTIVE_DTYPES[op], f"{op} dtype {p.dtype!r}; supported: {COLLECTIVE_DTYPES[op]}")

    return check


def _check_shard_slice(p: ShardSliceParams) -> None:
    _check_batch(p.rows)
    _check_ranks(p.parts)
    _require(p.cols % p.parts == 0, f"shard_slice of {p.cols} columns into {p.parts} parts")
    _require(p.dtype == "bfloat16", f"shard_slice dtype {p.dtype!r}")


def _check_argmax_combine(p: ArgmaxCombineParams) -> None:
    _check_batch(p.batch)
    _check_ranks(p.ranks)
    _require(p.ranks * p.shard_size < 2**31, f"vocabulary {p.ranks} x {p.shard_size} overflows int32 token ids")


TP_CODEGEN: dict[str, OpCodegen] = {
    "all_reduce": OpCodegen("all_reduce.py.j2", _none, _check_collective("all_reduce"), sync=True),
    "all_gather": OpCodegen("all_gather.py.j2", _none, _check_collective("all_gather"), sync=True),
    "shard_slice": OpCodegen("shard_slice.py.j2", _none, _check_shard_slice),
    "argmax_partial": OpCodegen("argmax.py.j2", _none, _check_argmax),
    "argmax_combine": OpCodegen("argmax_combine.py.j2", _none, _check_argmax_combine),
}
