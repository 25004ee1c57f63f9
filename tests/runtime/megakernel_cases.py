"""The megakernel test cases, shared by the artifact build (CPU, CuTe DSL) and the GPU tests.

Each case builds a task table with k3mk.codegen.testing.TableBuilder and draws fresh inputs. The
build script writes one artifact per case under the artifacts directory (default: <repo>/
artifacts_dev, or $K3MK_TEST_ARTIFACTS); the GPU tests rebuild the same table (no compile) to get
its reference and to check the artifact is not stale. Shapes are odd on purpose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3mk.codegen.testing import TableBuilder

REPO = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    return Path(os.environ.get("K3MK_TEST_ARTIFACTS") or REPO / "artifacts_dev")


@dataclass
class Case:
    name: str
    builder: TableBuilder
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    debug: bool = False  # build with the watchdog
    check: bool = True  # validate the table (False: planted deadlock)
    outputs: list[str] = field(default_factory=list)  # buffers compared with the reference
    exact: tuple[str, ...] = ()  # outputs that must match bit for bit
    argmax_of: tuple[str, str] | None = None  # (next, logits): next must be argmax of the KERNEL's logits


def _bf16(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def gemv_case(name: str, batch: int, k: int, n: int, tiles: int, ctas: int, norm: bool, residual: bool) -> Case:
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k))
    r = b.buffer("r", "bfloat16", (batch, n)) if residual else None
    y = b.buffer("y", "bfloat16", (batch, n))
    w = b.weight("w", "bfloat16", (n, k))
    g = b.weight("g", "bfloat16", (k,)) if norm else None
    b.gemv(x, w, y, tiles=tiles, norm_weight=g, residual=r, eps=1e-5)

    def inputs(gen):
        d = {"x": _bf16(gen, batch, k) * 3}
        if residual:
            d["r"] = _bf16(gen, batch, n)
        return d

    return Case(name, b, inputs, outputs=["y"])


def rmsnorm_case() -> Case:
    b = TableBuilder(3)
    x = b.buffer("x", "bfloat16", (3, 1048))
    y = b.buffer("y", "bfloat16", (3, 1048))
    b.rmsnorm(x, b.weight("g", "bfloat16", (1048,)), y, eps=1e-6, tasks=2)
    return Case("rmsnorm_b3", b, lambda gen: {"x": _bf16(gen, 3, 1048) * 2}, outputs=["y"])


def embedding_case() -> Case:
    b = TableBuilder(2)
    ids = b.buffer("ids", "int32", (4,))
    y = b.buffer("y", "bfloat16", (4, 264))
    b.embedding(ids, b.weight("embed", "bfloat16", (1001, 264)), y)
    return Case("embedding_b4", b, lambda gen: {"ids": torch.randint(0, 1001, (4,), generator=gen, dtype=torch.int32)},
                outputs=["y"], exact=("y",))  # fmt: skip


def argmax_case(name: str, batch: int, vocab: int, dtype: str, tasks: int) -> Case:
    b = TableBuilder(tasks)
    logits = b.buffer("logits", dtype, (batch, vocab))
    out = b.buffer("next", "int32", (batch,))
    b.argmax(logits, out, tasks=tasks)

    def inputs(gen):
        t = torch.randn(batch, vocab, generator=gen)
        t[0, vocab - 1] = 10.0  # the last element wins in row 0 (tail handling)
        if batch > 1:
            t[1, 3] = t[1, 17] = 10.0  # a tie: the lower index wins
        return {"logits": t.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)}

    return Case(name, b, inputs, outputs=["next"], exact=("next",))


def add_case() -> Case:
    b = TableBuilder(4)
    a = b.buffer("a", "bfloat16", (4, 1000))
    c = b.buffer("c", "bfloat16", (4, 1000))
    y = b.buffer("y", "bfloat16", (4, 1000))
    b.add(a, c, y, tasks=3)
    return Case("add", b, lambda gen: {"a": _bf16(gen, 4, 1000), "c": _bf16(gen, 4, 1000)}, outputs=["y"], exact=("y",))


def diamond_case() -> Case:
    """rmsnorm -> two GEMVs (fork) -> add (join on two events) -> argmax, over 8 CTAs."""
    b = TableBuilder(8)
    x = b.buffer("x", "bfloat16", (4, 1024))
    xn = b.buffer("xn", "bfloat16", (4, 1024))
    ya = b.buffer("ya", "bfloat16", (4, 776))
    yb = b.buffer("yb", "bfloat16", (4, 776))
    y = b.buffer("out", "bfloat16", (4, 776))
    nxt = b.buffer("next", "int32", (4,))
    e_norm = b.rmsnorm(x, b.weight("g", "bfloat16", (1024,)), xn, name="norm")
    e_a = b.gemv(xn, b.weight("wa", "bfloat16", (776, 1024)), ya, tiles=6, wait=(e_norm,), name="gemv_a")
    e_b = b.gemv(xn, b.weight("wb", "bfloat16", (776, 1024)), yb, tiles=5, wait=(e_norm,), name="gemv_b")
    e_add = b.add(ya, yb, y, tasks=4, wait=(e_a, e_b))
    b.argmax(y, nxt, tasks=2, wait=(e_add,))
    return Case("diamond", b, lambda gen: {"x": _bf16(gen, 4, 1024)}, outputs=["xn", "ya", "yb", "out"],
                argmax_of=("next", "out"))  # fmt: skip


def chain_case() -> Case:
    """A miniature decode step: embed -> (norm -> gemv + residual) -> norm -> lm_head -> argmax."""
    b = TableBuilder(16)
    ids = b.buffer("ids", "int32", (4,))
    x0 = b.buffer("x0", "bfloat16", (4, 512))
    h = b.buffer("h", "bfloat16", (4, 512))
    logits = b.buffer("logits", "bfloat16", (4, 4104))
    nxt = b.buffer("next", "int32", (4,))
    e0 = b.embedding(ids, b.weight("embed", "bfloat16", (3000, 512)), x0)
    e1 = b.gemv(x0, b.weight("w1", "bfloat16", (512, 512)), h, tiles=16, wait=(e0,),
                norm_weight=b.weight("g1", "bfloat16", (512,)), residual=x0, name="mixer")  # fmt: skip
    e2 = b.gemv(h, b.weight("lm_head", "bfloat16", (4104, 512)), logits, tiles=32, wait=(e1,),
                norm_weight=b.weight("g2", "bfloat16", (512,)), name="lm_head")  # fmt: skip
    b.argmax(logits, nxt, tasks=4, wait=(e2,))
    return Case("chain", b, lambda gen: {"ids": torch.randint(0, 3000, (4,), generator=gen, dtype=torch.int32)},
                outputs=["x0", "h", "logits"], exact=("x0",), argmax_of=("next", "logits"))  # fmt: skip


def hang_case() -> Case:
    """A planted deadlock (debug build): CTA 0 and CTA 1 wait on each other; CTA 2 waits on CTA 0."""
    b = TableBuilder(3)
    e0, e1 = b.event("from_cta0"), b.event("from_cta1")
    b.nop(cta=0, wait=(e1,), signal=e0, name="waits_for_cta1")
    b.nop(cta=1, wait=(e0,), signal=e1, name="waits_for_cta0")
    b.nop(cta=2, wait=(e0,), name="bystander")
    return Case("hang", b, lambda gen: {}, debug=True, check=False)


def bench_case(batch: int, k: int, n: int, ctas: int, tasks_per_cta: int) -> Case:
    """One large GEMV over every SM: bandwidth, not correctness (bench/megakernel_gemv.py)."""
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k))
    y = b.buffer("y", "bfloat16", (batch, n))
    b.gemv(x, b.weight("w", "bfloat16", (n, k)), y, tiles=ctas * tasks_per_cta)
    return Case(f"bench_gemv_b{batch}_{n}x{k}", b, lambda gen: {"x": _bf16(gen, batch, k)}, outputs=["y"])


def bench_layers_case(batch: int, dim: int, layers: int, ctas: int, tasks_per_cta: int) -> Case:
    """`layers` dependent GEMVs (x_{l+1} = W_l x_l): every tile waits for the whole previous layer,
    so streaming weights before the wait is what keeps HBM busy across layer boundaries."""
    b = TableBuilder(ctas)
    x = b.buffer("x0", "bfloat16", (batch, dim))
    prev: tuple[int, ...] = ()
    for layer in range(layers):
        y = b.buffer(f"x{layer + 1}", "bfloat16", (batch, dim))
        w = b.weight(f"w{layer}", "bfloat16", (dim, dim))
        prev = (b.gemv(x, w, y, tiles=ctas * tasks_per_cta, wait=prev, name=f"layer{layer}"),)
        x = y
    return Case(f"bench_layers{layers}_b{batch}_{dim}", b, lambda gen: {"x0": _bf16(gen, batch, dim)},
                outputs=[f"x{layers}"])  # fmt: skip


def bench_chain_case(batch: int, k: int, n: int, length: int, ctas: int, tasks_per_cta: int) -> Case:
    """`length` dependent GEMVs alternating [n, k] and [k, n] weights (x_{l+1} = W_l x_l; the streaming
    loop issue's chain: 4 x 16384 x 7168 bf16 = 940 MB), each tiled over every SM."""
    b = TableBuilder(ctas)
    x = b.buffer("x0", "bfloat16", (batch, k))
    prev: tuple[int, ...] = ()
    for layer in range(length):
        rows, cols = (n, k) if layer % 2 == 0 else (k, n)
        y = b.buffer(f"x{layer + 1}", "bfloat16", (batch, rows))
        prev = (b.gemv(x, b.weight(f"w{layer}", "bfloat16", (rows, cols)), y, tiles=ctas * tasks_per_cta, wait=prev, name=f"gemv{layer}"),)
        x = y
    return Case(f"bench_chain{length}_b{batch}_{n}x{k}", b, lambda gen: {"x0": _bf16(gen, batch, k)}, outputs=[f"x{length}"])


def bench_nop_case(ctas: int) -> Case:
    """One nop per CTA: the cost of a step with no work (launch, epoch read, last-CTA-out)."""
    b = TableBuilder(ctas)
    for i in range(ctas):
        b.nop(cta=i, name=f"nop{i}")
    return Case(f"bench_nop_{ctas}", b, lambda gen: {})


def bench_handoff_case(ctas: int, length: int) -> Case:
    """A chain of `length` dependent nops hopping across CTAs: the event hand-off latency."""
    b = TableBuilder(ctas)
    prev = ()
    for i in range(length):
        ev = b.event(f"hop{i}")
        b.nop(cta=i % ctas, wait=prev, signal=ev, name=f"hop{i}")
        prev = (ev,)
    return Case(f"bench_handoff_{length}", b, lambda gen: {})


def all_cases() -> dict[str, Case]:
    cases = [
        gemv_case("gemv_b1", 1, 520, 333, tiles=7, ctas=5, norm=False, residual=False),
        gemv_case("gemv_b4_norm_residual", 4, 1032, 257, tiles=9, ctas=4, norm=True, residual=True),
        # 4 rows x 4 chunks of 1792 per fill (ir/streaming.py fill_plan at batch > 1), short last groups
        gemv_case("gemv_b4_norm_chunked", 4, 7168, 70, tiles=3, ctas=2, norm=True, residual=True),
        gemv_case("gemv_b16_norm", 16, 264, 100, tiles=3, ctas=3, norm=True, residual=False),
        # row MMAs (ir/streaming.py ROW_MMA_ROWS) at b8 / b16 (two n-tiles): tiles of 43 / 34 rows, so a task's last group
        # of 16 is short; b8 a shorter last chunk (2304 = 4 x 480 + 384)
        gemv_case("gemv_b8_norm_tiles", 8, 2304, 300, tiles=7, ctas=3, norm=True, residual=True),
        gemv_case("gemv_b16_norm_tiles", 16, 1056, 100, tiles=3, ctas=3, norm=True, residual=False),
        rmsnorm_case(),
        embedding_case(),
        argmax_case("argmax_bf16_b4", 4, 50257, "bfloat16", tasks=2),
        argmax_case("argmax_f32_b1", 1, 32000, "float32", tasks=1),
        add_case(),
        diamond_case(),
        chain_case(),
        hang_case(),
        bench_case(1, 7168, 16384, ctas=132, tasks_per_cta=4),
        bench_case(4, 7168, 16384, ctas=132, tasks_per_cta=4),
        bench_case(8, 7168, 16384, ctas=132, tasks_per_cta=4),
        bench_layers_case(1, 7168, 8, ctas=132, tasks_per_cta=2),
        bench_chain_case(1, 7168, 16384, 4, ctas=132, tasks_per_cta=4),
        bench_chain_case(4, 7168, 16384, 4, ctas=132, tasks_per_cta=4),
        bench_nop_case(132),
        bench_handoff_case(132, 1024),
    ]
    from kda_cases import kda_cases  # KDA-side Kimi ops (tests/runtime/kda_cases.py)

    cases += kda_cases()
    from moe_mla_cases import moe_mla_cases  # MoE / MLA Kimi ops (tests/runtime/moe_mla_cases.py)

    cases += moe_mla_cases()
    return {c.name: c for c in cases}
