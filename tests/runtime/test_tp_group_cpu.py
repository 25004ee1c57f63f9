"""The setup and failure handling of a tensor-parallel group of one process per GPU, without a GPU
(runtime/tp_group.py): ranks as threads (or processes) on gloo groups, comm regions as fake handles.
Every rank must agree: the same error on every rank, naming the rank at fault, within the deadline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from k3mk.runtime.peer_memory import Region
from k3mk.runtime.tp import exchange_outputs, shard_piece, shard_whole
from k3mk.runtime.tp_group import Hello, TPGroup, TPGroupError, connect, init_group

DEADLINE_S = 1.5


def run_ranks(size: int, body, deadline_s: float = DEADLINE_S, absent: tuple[int, ...] = ()) -> dict:
    """body(group, rank) on `size` threads, each rank its own gloo group over one store; rank -> the
    result, or the exception raised. Ranks in `absent` join the group but never call `body`."""
    store = dist.HashStore()
    out: dict = {}

    def rank_thread(rank: int) -> None:
        pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=30))
        if rank in absent:
            time.sleep(deadline_s * 3)  # alive, but never at an exchange
            return
        try:
            out[rank] = body(TPGroup(pg, deadline_s, setup_deadline_s=deadline_s), rank)
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            out[rank] = e

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    return out


def agreed_error(results: dict, ranks) -> TPGroupError:
    """Every rank in `ranks` raised a TPGroupError with the same message; that error."""
    errors = [results[r] for r in ranks]
    assert all(isinstance(e, TPGroupError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1, [str(e) for e in errors]
    return errors[0]


class FakeMemory:
    """A PeerMemory whose handles are random bytes and whose opened regions are recorded."""

    kind = "fake"

    def __init__(self, rank: int, fail_open: bool = False):
        self.gpu = f"0000:{0x10 + rank:02x}:00.0"
        self.generator = torch.Generator().manual_seed(1000 + rank)
        self.opened: list[tuple[bytes, int, str]] = []
        self.fail_open = fail_open

    def allocate(self, nbytes: int) -> Region:
        handle = bytes(torch.randint(0, 256, (64,), generator=self.generator, dtype=torch.uint8).tolist())
        return Region(int(torch.randint(1, 2**40, (1,), generator=self.generator)) * 256, nbytes, handle)

    def open(self, handle: bytes, nbytes: int, peer_gpu: str) -> int:
        if self.fail_open:
            raise RuntimeError(f"cannot map {peer_gpu}")
        self.opened.append((handle, nbytes, peer_gpu))
        return 2**48 + 4096 * len(self.opened)


def setup_rank(group: TPGroup, rank: int, *, key: str = "k0", claimed: int | None = None, tp: int | None = None,
               fail_open: bool = False) -> tuple[list[int], Hello, FakeMemory, Region]:  # fmt: skip
    memory = FakeMemory(rank, fail_open)
    region = memory.allocate(4096 + 256 * rank if key != "k0" else 4096)
    hello = Hello(rank if claimed is None else claimed, group.size if tp is None else tp, key, f"/artifacts/{key}", memory.kind, memory.gpu,
                  region.handle.hex(), region.nbytes)  # fmt: skip
    addresses = connect(group, hello, memory, region)
    group.barrier("setup done")
    return addresses, hello, memory, region


def test_setup_agrees_and_opens_every_peer_region():
    results = run_ranks(3, setup_rank)
    for rank, (addresses, _, memory, region) in results.items():
        others = [results[q] for q in range(3) if q != rank]
        assert addresses[rank] == region.address and len(addresses) == 3
        assert memory.opened == [(r.handle, r.nbytes, m.gpu) for _, _, m, r in others]  # each peer's own handle, in rank order
        assert [a for q, a in enumerate(addresses) if q != rank] == [2**48 + 4096, 2**48 + 8192]


def test_mismatched_artifact_fails_every_rank_with_one_message():
    results = run_ranks(3, lambda g, r: setup_rank(g, r, key="k0" if r != 2 else "k9"))
    error = agreed_error(results, range(3))
    assert error.failed == {2: "artifact_key k9"}
    assert "the ranks loaded different artifacts: artifact_key k0 on ranks 0, 1 (/artifacts/k0); artifact_key k9 on ranks 2 (/artifacts/k9)" in str(error)


def test_wrong_rank_and_wrong_degree_fail_every_rank():
    error = agreed_error(run_ranks(2, lambda g, r: setup_rank(g, r, claimed=0)), range(2))
    assert list(error.failed) == [1] and "rank 1 (pid" in str(error) and "loaded the shards of rank 0" in str(error)
    error = agreed_error(run_ranks(2, lambda g, r: setup_rank(g, r, tp=4 if r == 0 else 2)), range(2))
    assert error.failed == {0: "its artifact /artifacts/k0 is for tp 4, the group has 2 ranks"}


def test_a_rank_that_fails_locally_fails_every_rank():
    error = agreed_error(run_ranks(3, lambda g, r: setup_rank(g, r, fail_open=r == 1)), range(3))
    assert error.failed == {1: "opening the other ranks' comm regions: RuntimeError: cannot map 0000:10:00.0"}


def test_a_rank_absent_at_an_exchange_is_named_within_the_deadline():
    start = time.monotonic()
    results = run_ranks(3, setup_rank, absent=(2,))
    error = agreed_error(results, (0, 1))
    assert list(error.failed) == [2] and "no answer within 1.5 s at 'setup'" in str(error)
    assert time.monotonic() - start < 4 * DEADLINE_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("absent", [2, 0])
def test_a_rank_that_never_arrives_at_the_rendezvous_is_named(absent):
    port, out = free_port(), {}

    def rank_thread(rank: int) -> None:
        try:
            out[rank] = TPGroup(init_group(rank, 3, "127.0.0.1", port, DEADLINE_S), DEADLINE_S, DEADLINE_S).exchange("hello", bytes([rank]))
        except Exception as e:  # noqa: BLE001
            out[rank] = e

    start = time.monotonic()
    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(3) if r != absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - start < 4 * DEADLINE_S
    error = agreed_error(out, [r for r in range(3) if r != absent])
    assert list(error.failed) == [absent] and f"rank {absent}: did not arrive" in str(error)


def test_the_rendezvous_then_every_exchange_works():
    port, out = free_port(), {}
    payloads = {r: os.urandom(100 + r) for r in range(3)}

    def rank_thread(rank: int) -> None:
        group = TPGroup(init_group(rank, 3, "127.0.0.1", port, DEADLINE_S), DEADLINE_S, DEADLINE_S)
        out[rank] = group.exchange("hello", payloads[rank]), group.broadcast_json("inputs", {"tokens": [rank, 7]})

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == {r: ([payloads[q] for q in range(3)], {"tokens": [0, 7]}) for r in range(3)}


def test_a_stalled_step_fails_every_rank_naming_it():
    """Rank 1's kernel never finishes: it reports the stall; rank 0, done, hears it at the output exchange."""
    logits = torch.randn(2, 8).to(torch.bfloat16)

    def body(group: TPGroup, rank: int):
        group.wait_until(lambda: rank == 0, "step 1", lambda: " (its kernel completed 0 steps)")
        return exchange_outputs(group, "step 1", torch.tensor([3, 4], dtype=torch.int32), logits, None)

    results = run_ranks(2, body)
    error = agreed_error(results, range(2))
    assert error.failed == {1: "step 1 did not finish within 1.5 s (its kernel completed 0 steps)"}
    assert results[1].gpu_stuck and not results[0].gpu_stuck


def test_outputs_are_assembled_from_every_rank_and_must_agree():
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, 64, (3,), generator=gen, dtype=torch.int32)
    shard = {"dim": 1, "parts": 4, "groups": 1}
    results = run_ranks(4, lambda g, r: exchange_outputs(g, "step 1", tokens, shard_piece(full, shard, r), shard))
    for got_tokens, got_logits in results.values():
        assert torch.equal(got_tokens, tokens) and torch.equal(got_logits, full) and torch.equal(shard_whole([shard_piece(full, shard, r) for r in range(4)], shard), full)
    odd = tokens.clone()
    odd[1] += 1
    results = run_ranks(4, lambda g, r: exchange_outputs(g, "step 1", odd if r == 3 else tokens, shard_piece(full, shard, r), shard))
    error = agreed_error(results, range(4))
    assert list(error.failed) == [3] and "the ranks disagree at step 1: rank 3: next tokens" in str(error)


def test_a_group_of_one_lets_local_errors_through():
    group = TPGroup(None, DEADLINE_S, DEADLINE_S)
    assert group.exchange("x", b"abc") == [b"abc"]
    with pytest.raises(KeyError, match="mine"):
        with group.local("loading"):
            raise KeyError("mine")


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from k3mk.runtime.tp_group import TPGroup, TPGroupError, init_group
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    group = TPGroup(init_group(rank, 3, "127.0.0.1", port, 20.0), 20.0, 20.0)
    group.barrier("joined")
    if rank == 2:
        os._exit(3)  # dies between two exchanges
    start = time.monotonic()
    try:
        group.exchange("step 1 outputs", b"x")
    except TPGroupError as e:
        print(f"{time.monotonic() - start:.2f} {e}", flush=True)
""")


def test_a_rank_that_dies_is_named_at_once():
    """Processes this time: rank 2 exits; the others learn it from the closed connection, long before
    their 20 s deadline."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(3)]  # fmt: skip
    outputs = [p.communicate(timeout=120) for p in procs]
    assert procs[2].returncode == 3
    lines = [out.strip() for out, _ in outputs[:2]]
    for (out, err), line in zip(outputs[:2], lines):
        assert line, err
        seconds, message = line.split(" ", 1)
        assert float(seconds) < 10 and message == "tensor-parallel group of 3: rank 2: its connection closed (the process died?)"
