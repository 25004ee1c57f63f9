"""The host side of a tensor-parallel group of one process per GPU: every wait of one rank on another
has a deadline, and every failure is agreed, so that all ranks fail together with one message that
names the rank (SERVING.md: "refusals agreed across ranks"; nothing waits forever).

    group = TPGroup(process_group, 60, 900)          # a CPU (gloo) torch.distributed group (group rank = TP rank),
                                                    # the deadlines of a step and of the setup (below)
    payloads = group.exchange("what", data)         # bytes from every rank, in rank order
    with group.local("loading the artifact"):       # this rank's own work between two exchanges:
        ...                                         #   an exception here fails EVERY rank (below)
    hellos = connect(group, hello, memory, region)  # setup: agreement, then the peers' comm regions opened

Messages go point to point, each rank to each other, over the group's send / recv with a wait per
peer: unlike a collective, a wait that runs out says WHICH rank did not answer. Engines hand over a
CPU group (vLLM's and SGLang's GroupCoordinator.cpu_group); `init_group` makes one for launchers
that have none (`k3mk generate --tp N`, tests).

Deadlines: `deadline_s` bounds a wait for this rank's kernel (`wait_until`); an exchange waits up to twice
that for each peer, since a peer may be in such a wait until its own deadline runs out before it answers;
the setup exchange waits `setup_deadline_s`, since the ranks arrive after loading their weights, which may
take minutes and differs between ranks. The caller chooses both (an engine has its own: SGLang's
BuildContext.deadline_s).

Failure protocol: a rank that fails (its own error, or its kernel not finishing a step within the
deadline) sends its failure IN PLACE of its next message. Every rank, on receiving the messages of an
exchange, raises `TPGroupError` if one of them is a failure or did not arrive within the deadline; all
ranks receive the same messages, so they raise the same error. A rank that died closes its connections
(named at once); a hung one is named when the deadline runs out.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

POLL_S = 50e-6  # the host's poll interval while it waits for a kernel
OK, FAILED = 0, 1  # a message's status


class TPGroupError(RuntimeError):
    """Raised on every rank of a group with the same message: the ranks that failed or did not answer,
    and why. `gpu_stuck`: this rank's own kernel did not finish, so anything that synchronises with
    its GPU would hang (end the process instead)."""

    def __init__(self, message: str, failed: dict[int, str], gpu_stuck: bool = False):
        super().__init__(message)
        self.failed = failed
        self.gpu_stuck = gpu_stuck


def _as_bytes(t: torch.Tensor) -> bytes:
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


class TPGroup:
    """Deadline-bound exchanges between the ranks of `process_group` (module docstring); None: a group
    of one process (tensor parallel degree 1), where an exchange returns this rank's own data."""

    def __init__(self, process_group, deadline_s: float, setup_deadline_s: float):
        self.process_group = process_group
        self.rank = process_group.rank() if process_group is not None else 0
        self.size = process_group.size() if process_group is not None else 1
        self.deadline_s, self.setup_deadline_s = deadline_s, setup_deadline_s
        self._round = 0  # exchanges so far: every rank runs the same sequence, so it tags the messages

    # ---- exchanges -------------------------------------------------------------------------------
    def exchange(self, what: str, data: bytes = b"", wait_s: float | None = None) -> list[bytes]:
        """`data` to every rank, every rank's in rank order (this rank's included); each peer waited for
        `wait_s` (default: twice the deadline, module docstring)."""
        return self._exchange(what, OK, data, wait_s)

    def exchange_json(self, what: str, value, wait_s: float | None = None) -> list:
        return [json.loads(d) for d in self.exchange(what, json.dumps(value).encode(), wait_s)]

    def broadcast_json(self, what: str, value):
        """Rank 0's `value` on every rank (the others' are ignored)."""
        return self.exchange_json(what, value if self.rank == 0 else None)[0]

    def barrier(self, what: str) -> None:
        self.exchange(what)

    def fail(self, what: str, message: str, gpu_stuck: bool = False) -> NoReturn:
        """Report this rank's failure (`message`, which says what failed) to every rank in place of its next
        message, then raise the agreed TPGroupError (which also lists any other rank that failed then)."""
        self._exchange(what, FAILED, message.encode(), None, gpu_stuck)
        raise AssertionError("unreachable: a failed exchange raises")

    def wait_until(self, done: Callable[[], bool], what: str, why: Callable[[], str] = lambda: "") -> None:
        """Poll `done()` until it holds, at most the deadline; then `fail` (with `gpu_stuck`: what did
        not finish is this rank's kernel) with `why()` appended."""
        deadline = time.monotonic() + self.deadline_s
        while not done():
            if time.monotonic() > deadline:
                self.fail(what, f"{what} did not finish within {self.deadline_s:g} s{why()}", gpu_stuck=True)
            time.sleep(POLL_S)

    @contextlib.contextmanager
    def local(self, what: str):
        """Work of this rank alone between two exchanges: an exception becomes this rank's failure,
        reported to every rank (`fail`). A group of one lets the exception through as it is."""
        try:
            yield
        except TPGroupError:
            raise
        except Exception as e:
            if self.size == 1:
                raise
            try:
                self.fail(what, f"{what}: {type(e).__name__}: {e}")
            except TPGroupError as agreed:
                raise agreed from e

    # ---- one round of messages ---------------------------------------------------------------------
    def _exchange(self, what: str, status: int, data: bytes, wait_s: float | None, gpu_stuck: bool = False) -> list[bytes]:
        self._round += 1
        received: dict[int, tuple[int, bytes]] = {self.rank: (status, data)}
        failed: dict[int, str] = {}
        if self.size > 1:
            self._send_and_receive(what, status, data, 2 * self.deadline_s if wait_s is None else wait_s, received, failed)
        for q, (st, payload) in sorted(received.items()):
            if st == FAILED:
                failed[q] = payload.decode(errors="replace")
        if failed:
            listing = "; ".join(f"rank {q}: {reason}" for q, reason in sorted(failed.items()))
            raise TPGroupError(f"tensor-parallel group of {self.size}: {listing}", failed, gpu_stuck)
        return [received[q][1] for q in range(self.size)]

    def _send_and_receive(self, what: str, status: int, data: bytes, wait_s: float, received: dict, failed: dict) -> None:
        """A header (status, length) and a body (`what`, NUL, data) to and from every other rank, two tags
        per round; waits share one deadline. Fills `received` and, for ranks that did not answer, `failed`."""
        pg, tag = self.process_group, 2 * self._round
        header = torch.tensor([status, len(what.encode()) + 1 + len(data)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(what.encode() + b"\0" + data), dtype=torch.uint8)
        peers = [q for q in range(self.size) if q != self.rank]
        sends = [pg.send([header], q, tag) for q in peers] + [pg.send([body], q, tag + 1) for q in peers]
        headers = {q: torch.empty(2, dtype=torch.int64) for q in peers}
        pending = {q: pg.recv([headers[q]], q, tag) for q in peers}
        deadline = time.monotonic() + wait_s
        for q in peers:
            try:
                self._wait(pending[q], deadline)
                st, length = headers[q].tolist()
                buffer = torch.empty(length, dtype=torch.uint8)
                self._wait(pg.recv([buffer], q, tag + 1), deadline)
            except RuntimeError as e:
                failed[q] = self._silence(what, wait_s, e)
                continue
            their_what, _, payload = _as_bytes(buffer).partition(b"\0")
            if OK == st == status and their_what.decode() != what:  # a failure replaces whatever message was due
                failed[q] = f"is at '{their_what.decode()}' while this rank is at '{what}' (the ranks run different programs)"
            received[q] = (st, payload)
        for work in sends:  # the tensors must outlive the sends; a peer that is gone is already named
            with contextlib.suppress(RuntimeError):
                self._wait(work, deadline)

    @staticmethod
    def _wait(work, deadline: float) -> None:
        work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))

    @staticmethod
    def _silence(what: str, wait_s: float, error: RuntimeError) -> str:
        text = str(error)
        if "closed" in text.lower() or "reset by peer" in text.lower():
            return "its connection closed (the process died?)"
        if "timed out" in text.lower():
            return f"no answer within {wait_s:g} s at '{what}' (its process is hung, or stopped before this point)"
        return f"unreachable ({text.splitlines()[0][:200]})"


def init_group(rank: int, size: int, address: str, port: int, deadline_s: float):
    """A gloo process group of `size` processes that meet at a TCP store on address:port (hosted by rank
    0), for launchers without a group of their own. Every rank that arrives fails within the deadline
    naming the ranks that did not."""
    timeout = timedelta(seconds=deadline_s)
    try:
        store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, dist.DistError) as e:
        if rank == 0:
            raise
        reason = f"did not arrive within {deadline_s:g} s (nothing listens at {address}:{port} for the rendezvous)"
        raise TPGroupError(f"tensor-parallel group of {size}: rank 0: {reason}", {0: reason}) from e
    keys = [f"k3mk/arrived/{q}" for q in range(size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except (RuntimeError, dist.DistError) as e:
        reason = f"did not arrive at the rendezvous within {deadline_s:g} s"
        missing = {q: reason for q, key in enumerate(keys) if not store.check([key])}
        listing = "; ".join(f"rank {q}: {reason}" for q in missing)
        raise TPGroupError(f"tensor-parallel group of {size}: {listing}", missing) from e
    return dist.ProcessGroupGloo(dist.PrefixStore("k3mk/gloo", store), rank, size, timeout)


# ---- setup: agreement, then the comm regions -------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """What a rank says about itself at setup; `agree` checks them all, identically on every rank."""

    rank: int  # the rank whose shards this process loaded
    tp: int  # the artifact's degree
    artifact_key: str  # runtime.tp.artifact_key: the same artifact everywhere
    artifact: str  # its directory, for the messages
    memory: str = ""  # PeerMemory.kind ("" at tp 1)
    gpu: str = ""  # PCI bus id of its GPU
    handle: str = ""  # hex of its comm region's handle
    comm_bytes: int = 0
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)


def agree(hellos: list[Hello]) -> None:
    """Every rank loaded the same artifact, for its own rank, for a group of this size, with the same kind
    of peer memory; else TPGroupError naming the ranks (the same on every rank: same input)."""
    size = len(hellos)

    def where(q: int) -> str:
        return f"rank {q} (pid {hellos[q].pid} on {hellos[q].host})"

    failed = {q: f"loaded the shards of rank {h.rank}" for q, h in enumerate(hellos) if h.rank != q}
    failed.update({q: f"its artifact {h.artifact} is for tp {h.tp}, the group has {size} ranks" for q, h in enumerate(hellos) if h.tp != size})
    if failed:
        raise TPGroupError(f"tensor-parallel group of {size}: " + "; ".join(f"{where(q)} {r}" for q, r in sorted(failed.items())), failed)
    for name, what in (("artifact_key", "loaded different artifacts"), ("memory", "use different peer memory")):
        values = [getattr(h, name) for h in hellos]
        if len(set(values)) > 1:
            groups = {v: [q for q in range(size) if values[q] == v] for v in dict.fromkeys(values)}
            listing = "; ".join(f"{name} {v or '(none)'} on ranks {', '.join(map(str, qs))} ({hellos[qs[0]].artifact})" for v, qs in groups.items())
            odd = {q: f"{name} {values[q]}" for q in range(size) if values[q] != values[0]}
            raise TPGroupError(f"tensor-parallel group of {size}: the ranks {what}: {listing}", odd)


def connect(group: TPGroup, hello: Hello, memory, region) -> list[int]:
    """Setup of one rank (the same call on every rank): exchange the Hellos, `agree`, then open every other
    rank's comm region. Returns every rank's region as this process addresses it, in rank order (this
    rank's own `region.address` at its index; [] at tp 1). Bind them, then `group.barrier` before the
    first launch: a kernel pushes into the peers' regions, so every rank must have zeroed and published
    its own (`memory.allocate` zeroes before the handle leaves) and bound the others'."""
    hellos = [Hello(**h) for h in group.exchange_json("setup", asdict(hello), group.setup_deadline_s)]
    agree(hellos)
    if region is None:
        return []
    addresses = []
    with group.local("opening the other ranks' comm regions"):
        for q, h in enumerate(hellos):
            addresses.append(region.address if q == group.rank else memory.open(bytes.fromhex(h.handle), h.comm_bytes, h.gpu))
    return addresses
