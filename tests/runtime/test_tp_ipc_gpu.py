"""The CUDA IPC path of one process per GPU, on ONE GPU (runtime/peer_memory.py, runtime/tp_group.py):
two processes, each a rank on GPU 0, allocate their comm regions from the driver, exchange the IPC
handles over a gloo group (`connect`), and then read and write each other's region through the mapping:
each region starts zeroed, holds its owner's random words for the other to read, and receives the other
rank's pushed words and an atomic add per rank in its counter, as a collective's push does. Then both
close the peers' mappings before either frees its region. Skips without CUDA.

    python -m pytest -m gpu tests/runtime/test_tp_ipc_gpu.py      # the test starts the two processes
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
WORDS = 4096  # int64 words per region: [0] counter, [1, HALF) the owner's words, [HALF, WORDS) the peer's pushes
HALF = WORDS // 2


def raw_view(address: int, words: int) -> torch.Tensor:
    """int64 [words] over device memory that torch did not allocate (an opened IPC mapping)."""

    class Memory:
        __cuda_array_interface__ = {"shape": (words,), "typestr": "<i8", "data": (address, False), "version": 3}

    return torch.as_tensor(Memory(), device="cuda")


def words_of(rank: int, count: int) -> torch.Tensor:
    return torch.randint(-(2**62), 2**62, (count,), generator=torch.Generator().manual_seed(77 + rank), dtype=torch.int64)


def rank_main(rank: int, port: int) -> None:
    from k3mk.runtime.peer_memory import CudaIpcMemory
    from k3mk.runtime.tp_group import Hello, TPGroup, connect, init_group

    torch.cuda.set_device(0)
    group = TPGroup(init_group(rank, 2, "127.0.0.1", port, 120), 30, 120)
    memory = CudaIpcMemory(0)
    region = memory.allocate(WORDS * 8)
    own = raw_view(region.address, WORDS)
    assert int(own.count_nonzero()) == 0, "a fresh comm region must be zeroed"
    own[1:HALF].copy_(words_of(rank, HALF - 1).cuda())
    torch.cuda.synchronize()
    hello = Hello(rank, 2, "ipc-test", "tests/runtime/test_tp_ipc_gpu.py", memory.kind, memory.gpu, region.handle.hex(), region.nbytes)
    addresses = connect(group, hello, memory, region)
    assert addresses[rank] == region.address
    views = [raw_view(a, WORDS) for a in addresses]
    peer = 1 - rank
    assert torch.equal(views[peer][1:HALF].cpu(), words_of(peer, HALF - 1)), "the peer's words, read through the IPC mapping"
    views[peer][HALF:].copy_(words_of(10 + rank, HALF).cuda())  # a push into the peer's region
    for view in views:  # every rank adds 1 to every region's counter (atomic adds, as the collectives' flags)
        view[:1].index_add_(0, torch.zeros(1, dtype=torch.long, device="cuda"), torch.ones(1, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    group.barrier("pushed")
    assert torch.equal(own[HALF:].cpu(), words_of(10 + peer, HALF)), "the peer's push, seen by the owner"
    assert int(own[0]) == 2, f"counter {int(own[0])}: expected one add from each rank"
    memory.close_peers()
    group.barrier("closed")
    memory.close()
    print(f"rank {rank}: ok ({memory.gpu}, region {region.nbytes} B)", flush=True)


def test_two_processes_on_one_gpu_share_their_comm_regions():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"rank {rank}: ok" in out, f"rank {rank} (status {p.returncode}):\n{out}\n{err}"


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]))
