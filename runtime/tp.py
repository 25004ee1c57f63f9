"""Tensor-parallel decode with one process per GPU, as serving engines run it (vLLM's and SGLang's
workers): ONE artifact compiled for `--tp N`, each process one rank with its own shard of the weights
(docs/megakernel.md "Tensor parallelism"; the host protocol: runtime/tp_group.py).

    group = TPGroup(cpu_process_group, deadline_s, setup_deadline_s)   # group rank = TP rank
    rank = TPRank(artifact_dir, my_weights, group, rank=group.rank, device=torch.cuda.current_device())
    next_tokens, logits = rank.step(token_ids, positions)   # every rank, the same inputs: whole results
    rank.launch(token_ids, positions); rank.wait()         # or: the launch alone (capturable), then the deadline

Setup, on every rank at once (`TPRank.__init__`): the artifact loaded onto this rank's GPU and rank r's
pieces of the weights bound (`shard_piece` cuts a full tensor; `k3mk.compiler.checkpoint.load_checkpoint`
reads only rank r's bytes of a checkpoint), the decode state allocated zeroed; this rank's comm region
allocated from the driver and zeroed (runtime/peer_memory.py: CUDA IPC, or fabric handles on NVL72);
then `connect` exchanges every rank's description, checks that all loaded the same artifact (its
`artifact_key`) for their own rank, opens every peer's region; the regions go into the kernel's pointer
table, `tp_rank` into the arena, and a barrier ends the setup (no kernel may push into a region its
owner has not zeroed). Any rank's failure fails every rank with one message.

A step: the inputs written and ONE launch on this rank's current stream, then a host wait with a
deadline: a kernel that does not finish (a peer died or hangs, so a collective never completes) makes
this rank report the stall to the others and raise; every rank does, naming each rank's state. A
release build's kernel cannot give up a wait yet, so after a stall it still spins: the process must end
(`TPGroupError.gpu_stuck`). The kernel-side deadline (DESIGN.md, not built) should set a sticky word
the host reads after each step: docs/megakernel.md "Tensor parallelism" has the interface this expects.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from pathlib import Path
from typing import Mapping

import torch

from k3mk.runtime import abi
from k3mk.runtime.model import DecodeModel
from k3mk.runtime.peer_memory import MEMORY_KINDS
from k3mk.runtime.tp_group import POLL_S, Hello, TPGroup, TPGroupError, connect
from k3mk.runtime.tokens import mark_nonfinite

TP_RANK = "tp_rank"  # the step input holding the rank (k3mk.ir.collectives.TP_RANK; a test checks they agree)
PROBE_S = 1.0  # how long a stall report waits for the kernel's step count


def shard_piece(full: torch.Tensor, shard: Mapping[str, int], rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` under a manifest shard {dim, parts, groups}: the dimension cut into
    `groups` blocks, piece `rank` of `parts` of each, in block order (k3mk.ir.collectives.ShardSpec.take;
    the runtime imports no compiler package, a test checks the two agree)."""
    dim = shard["dim"]
    blocks = full.chunk(shard.get("groups", 1), dim=dim)
    return torch.cat([b.chunk(shard["parts"], dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def shard_whole(pieces: list[torch.Tensor], shard: Mapping[str, int]) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (the inverse of `shard_piece`)."""
    dim, groups = shard["dim"], shard.get("groups", 1)
    per_rank = [p.chunk(groups, dim=dim) for p in pieces]
    return torch.cat([per_rank[r][g] for g in range(groups) for r in range(len(pieces))], dim=dim)


def rank_pieces(weights: Mapping[str, torch.Tensor], shards: Mapping[str, Mapping[str, int]], rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` binds for full `weights`: each split one's piece (a copy), the others as they are."""
    return {name: shard_piece(t, shards[name], rank) if name in shards else t for name, t in weights.items()}


def artifact_key(artifact_dir: str | Path) -> str:
    """The artifact's content key: the hash of its manifest, which holds the hashes of the cubin and the
    task table (copies of one build on other hosts have the same key)."""
    return hashlib.sha256((Path(artifact_dir) / "manifest.json").read_bytes()).hexdigest()[:16]


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


class TPRank:
    """One rank of a tensor-parallel group in this process (module docstring). `weights`: this rank's
    pieces by canonical name (`rank_pieces`, or a checkpoint read for the rank); `rank`: the rank they
    are for (checked against the group). A tp-1 artifact runs in a group of one."""

    def __init__(self, artifact_dir: str | Path, weights: Mapping[str, torch.Tensor], group: TPGroup, rank: int,
                 device: int | torch.device | None = None, states: Mapping[str, torch.Tensor] | None = None,
                 memory: str = "cuda_ipc"):  # fmt: skip
        self.group, self.rank, self.steps = group, rank, 0
        self.memory = region = None
        with group.local("loading the artifact and binding this rank's weights"):
            self.model = DecodeModel(artifact_dir, weights, states, device)
            mk = self.model.mk
            self.tp = mk.manifest.data.get("tp", 1)
            self.shards: dict[str, dict] = mk.manifest.data.get("tp_shards", {})
            peer = {}
            if self.tp > 1:
                if memory not in MEMORY_KINDS:
                    raise ValueError(f"peer memory {memory!r}: expected one of {', '.join(MEMORY_KINDS)}")
                self.memory = MEMORY_KINDS[memory](mk.device.index)
                region = self.memory.allocate(mk.comm["nbytes"])
                peer = {"memory": memory, "gpu": self.memory.gpu, "handle": region.handle.hex(), "comm_bytes": region.nbytes}
            hello = Hello(rank, self.tp, artifact_key(artifact_dir), str(artifact_dir), **peer)
        addresses = connect(group, hello, self.memory, region)
        with group.local("binding the comm regions"):
            if addresses:
                mk.bind_comm(addresses)
                mk.buffer(TP_RANK).fill_(rank)
            torch.cuda.synchronize(mk.device)
        group.barrier("setup done")
        self._done = torch.cuda.Event()
        self._probe = torch.empty(1, dtype=torch.int64, pin_memory=True)

    @property
    def batch(self) -> int:
        return self.model.batch

    @property
    def max_context(self) -> int:
        return self.model.max_context

    def launch(self, token_ids, positions) -> None:
        """This rank's step: the inputs written, ONE kernel launch on the current stream; no wait."""
        self.model.step(token_ids, positions)
        self.steps += 1
        self._done.record(torch.cuda.current_stream(self.model.mk.device))

    def wait(self) -> None:
        """Until this rank's last launch finished, at most the group's deadline; a stall is reported to
        every rank and raised on all (TPGroupError, `gpu_stuck` here)."""
        self.group.wait_until(self._done.query, f"step {self.steps}", lambda: f" (its kernel completed {self._completed_steps()} steps)")

    def _completed_steps(self) -> str:
        """The kernel's step count while it may still run: a copy on a side stream (the copy engines run
        beside a kernel that holds every SM); 'unknown' if even that does not finish."""
        mk = self.model.mk
        side = torch.cuda.Stream(mk.device)
        with torch.cuda.stream(side):
            self._probe.copy_(mk.control[abi.C_EPOCH : abi.C_EPOCH + 1], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
        deadline = time.monotonic() + PROBE_S
        while not copied.query():
            if time.monotonic() > deadline:
                return "unknown"
            time.sleep(POLL_S)
        return str(int(self._probe[0]))

    def step(self, token_ids, positions, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step on every rank (each calls it with the same inputs): (next_tokens int32 [batch],
        logits [batch, vocab]) on the CPU, whole, on every rank. The ranks' next tokens must agree.
        NONFINITE_TOKEN (-1) where a request's logits are not finite, as DecodeModel.step."""
        self.launch(token_ids, positions)
        self.wait()
        with self.group.local(f"reading step {self.steps}'s outputs"):
            if self.model.mk.debug_build:
                self.model.mk.check()  # a watchdog that fired in this rank's kernel (WatchdogError)
            tokens = self.model.buffer("next_tokens").cpu()
            logits = self.model.buffer("logits").cpu()
        tokens, logits = exchange_outputs(self.group, f"step {self.steps}", tokens, logits, self.shards.get("logits"))
        if check_finite:
            mark_nonfinite(tokens, logits)
        return tokens, logits

    def close(self) -> None:
        """Every rank closes the peers' regions, a barrier, then each frees its own (never after a stall:
        the kernel may still use them)."""
        if self.memory is None:
            return
        self.memory.close_peers()
        self.group.barrier("comm regions closed")
        self.memory.close()
        self.memory = None


def exchange_outputs(group: TPGroup, what: str, tokens: torch.Tensor, logits: torch.Tensor, logits_shard: Mapping[str, int] | None):
    """Every rank's (next tokens, logits piece) to every rank: (the tokens, which must agree, else a
    TPGroupError naming the ranks that differ from rank 0; the whole logits)."""
    payloads = group.exchange(f"{what} outputs", _bytes(tokens) + _bytes(logits))
    split = tokens.numel() * tokens.element_size()
    every = [torch.frombuffer(bytearray(p[:split]), dtype=tokens.dtype).view(tokens.shape) for p in payloads]
    differ = {q: f"next tokens {t.tolist()}, rank 0's {every[0].tolist()}" for q, t in enumerate(every) if not torch.equal(t, every[0])}
    if differ:
        listing = "; ".join(f"rank {q}: {d}" for q, d in differ.items())
        raise TPGroupError(f"tensor-parallel group of {group.size}: the ranks disagree at {what}: {listing}", differ)
    pieces = [torch.frombuffer(bytearray(p[split:]), dtype=logits.dtype).view(logits.shape) for p in payloads]
    return every[0], shard_whole(pieces, logits_shard) if logits_shard else pieces[0]
