"""Test mode: build a task table by hand from a small graph of ops, and its reference outputs.

A tiny stand-in for the scheduler passes, for op-level and topology tests of the megakernel
framework (one op; fork / join / diamond). Ops are added in dependency order; each op is split
into tiles, its tasks go round-robin over the CTAs, and every op signals one event that its
consumers wait on. `reference()` replays the same ops with k3mk.ir.semantics.

Pure Python + torch (no CuTe DSL): the GPU tests rebuild the same table to get its reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from k3mk.codegen.testing_kda import KdaOpsMixin
from k3mk.codegen.testing_moe_mla import MoeMlaOpsMixin
from k3mk.ir import semantics
from k3mk.ir.task_table import (
    ARENA_ALIGN,
    AddParams,
    ArgmaxParams,
    BufferSpec,
    EmbeddingParams,
    Event,
    GemvParams,
    NopParams,
    OpVariant,
    RmsnormParams,
    Task,
    TaskTable,
    WeightSpec,
)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32}


@dataclass(frozen=True)
class Buf:
    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """[begin, count) of `parts` near-equal pieces of n (uneven on purpose when n % parts)."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, begin = [], 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        out.append((begin, count))
        begin += count
    return out


class TableBuilder(KdaOpsMixin, MoeMlaOpsMixin):
    def __init__(self, num_ctas: int):
        self.num_ctas = num_ctas
        self.variants: list[OpVariant] = []
        self.lists: list[list[Task]] = [[] for _ in range(num_ctas)]
        self.events: list[Event] = []
        self.weights: list[WeightSpec] = []
        self.buffers: list[BufferSpec] = []
        self.arena_bytes = 0
        self._next_cta = 0
        self.ids_writer: dict[int, int] = {}  # arena offset of expert ids -> the event of the task writing them
        self.states: list[str] = []  # pointer-table entries that ops update in place (decode state)
        self._steps: list[Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]] = []

    # ---- declarations -------------------------------------------------------------------------
    def buffer(self, name: str, dtype: str, shape: tuple[int, ...]) -> Buf:
        spec = BufferSpec(name, self.arena_bytes, dtype, tuple(shape))
        self.buffers.append(spec)
        self.arena_bytes += (spec.nbytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
        return Buf(name, spec.offset, dtype, tuple(shape))

    def weight(self, name: str, dtype: str, shape: tuple[int, ...]) -> int:
        self.weights.append(WeightSpec(name, dtype, tuple(shape)))
        return len(self.weights) - 1

    def event(self, name: str) -> int:
        self.events.append(Event(name))
        return len(self.events) - 1

    def _opcode(self, op: str, params: object) -> int:
        variant = OpVariant(op, params)
        if variant not in self.variants:
            self.variants.append(variant)
        return self.variants.index(variant)

    def _emit(self, opcode: int, operands: dict, wait: tuple[int, ...], signal: int | None, label: str, cta: int | None,
              weight_wait: int | None = None) -> None:  # fmt: skip
        if cta is None:
            cta, self._next_cta = self._next_cta, (self._next_cta + 1) % self.num_ctas
        self.lists[cta].append(Task(opcode, operands, wait, signal, label, weight_wait))

    # ---- ops (each returns the event its tasks signal) ----------------------------------------
    def gemv(self, x: Buf, weight: int, out: Buf, *, tiles: int, wait: tuple[int, ...] = (),
             norm_weight: int | None = None, eps: float = 1e-6, residual: Buf | None = None, name: str = "gemv") -> int:  # fmt: skip
        batch, k = x.shape
        n = self.weights[weight].shape[0]
        params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, residuals=int(residual is not None), eps=eps)
        opcode = self._opcode("gemv", params)
        ev = self.event(name)
        for i, (begin, count) in enumerate(_split(n, tiles)):
            operands = {"x": x.offset, "out": out.offset, "weight": weight, "row_begin": begin, "row_count": count,
                        "batch_stride": n}  # fmt: skip
            if norm_weight is not None:
                operands["norm_weight"] = norm_weight
            if residual is not None:
                operands["residual"] = residual.offset
            # as passes/emit_task_table.py: a task right after one of this GEMV on its CTA skips staging the input
            last = self.lists[self._next_cta][-1] if self.lists[self._next_cta] else None
            if last is not None and last.signal == ev:
                operands["x_staged"] = 1
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        w_name = self.weights[weight].name
        g_name = None if norm_weight is None else self.weights[norm_weight].name
        r_name = None if residual is None else residual.name

        def step(env, weights):
            xin = env[x.name]
            if g_name is not None:
                xin = semantics.rmsnorm(xin, weights[g_name], eps)
            y = semantics.linear(xin, weights[w_name])
            if r_name is not None:
                y = semantics.add(y, env[r_name])
            env[out.name] = y

        self._steps.append(step)
        return ev

    def rmsnorm(self, x: Buf, weight: int, out: Buf, *, eps: float = 1e-6, tasks: int = 1, wait: tuple[int, ...] = (),
                name: str = "rmsnorm") -> int:  # fmt: skip
        batch, dim = x.shape
        opcode = self._opcode("rmsnorm", RmsnormParams(dim, batch, eps))
        ev = self.event(name)
        for i, (begin, count) in enumerate(_split(batch, tasks)):
            operands = {"x": x.offset, "out": out.offset, "weight": weight, "batch_begin": begin, "batch_count": count}
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        g_name = self.weights[weight].name
        self._steps.append(lambda env, w: env.__setitem__(out.name, semantics.rmsnorm(env[x.name], w[g_name], eps)))
        return ev

    def embedding(self, ids: Buf, table: int, out: Buf, *, wait: tuple[int, ...] = (), name: str = "embedding") -> int:
        vocab, dim = self.weights[table].shape
        opcode = self._opcode("embedding", EmbeddingParams(dim, vocab, ids.shape[0]))
        ev = self.event(name)
        self._emit(opcode, {"ids": ids.offset, "out": out.offset, "table": table, "batch_count": ids.shape[0]}, wait, ev,
                   f"{name}[0]", None)
        t_name = self.weights[table].name
        self._steps.append(lambda env, w: env.__setitem__(out.name, semantics.embedding(w[t_name], env[ids.name].long())))
        return ev

    def argmax(self, logits: Buf, out: Buf, *, tasks: int = 1, wait: tuple[int, ...] = (), name: str = "argmax") -> int:
        batch, vocab = logits.shape
        opcode = self._opcode("argmax", ArgmaxParams(vocab, batch, logits.dtype))
        ev = self.event(name)
        for i, (begin, count) in enumerate(_split(batch, tasks)):
            operands = {"logits": logits.offset, "out": out.offset, "batch_begin": begin, "batch_count": count}
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        self._steps.append(lambda env, w: env.__setitem__(out.name, semantics.argmax(env[logits.name])))
        return ev

    def add(self, a: Buf, b: Buf, out: Buf, *, tasks: int = 1, wait: tuple[int, ...] = (), name: str = "add") -> int:
        count = 1
        for s in out.shape:
            count *= s
        opcode = self._opcode("add", AddParams())
        ev = self.event(name)
        for i, (begin, n) in enumerate(_split(count, tasks)):
            operands = {"a": a.offset, "b": b.offset, "out": out.offset, "begin": begin, "count": n}
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        self._steps.append(lambda env, w: env.__setitem__(out.name, semantics.add(env[a.name], env[b.name])))
        return ev

    def nop(self, *, cta: int, wait: tuple[int, ...] = (), signal: int | None = None, name: str = "nop") -> None:
        self._emit(self._opcode("nop", NopParams()), {}, wait, signal, name, cta)

    # ---- results ------------------------------------------------------------------------------
    def table(self) -> TaskTable:
        return TaskTable(self.variants, self.lists, self.events, self.weights, self.buffers, self.arena_bytes)

    def reference(self, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every buffer the ops write, computed with k3mk.ir.semantics in construction order."""
        env = dict(inputs)
        for step in self._steps:
            step(env, weights)
        return env

    def random_weights(self, generator: torch.Generator, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Fresh random weights: N(0, 1/in) matrices, gains near 1, N(0, 1) embedding rows."""
        out = {}
        for w in self.weights:
            t = torch.randn(w.shape, generator=generator, dtype=torch.float32)
            if len(w.shape) == 1:
                t = 1.0 + 0.1 * t
            elif "embed" not in w.name:
                t = t / w.shape[1] ** 0.5
            out[w.name] = t.to(TORCH_DTYPES[w.dtype]).to(device)
        return out
