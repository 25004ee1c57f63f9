"""Start the processes of a tensor-parallel `k3mk` command on this host, one per rank, as torchrun does
(the same environment variables, so the command also runs one rank per process under torchrun, across
hosts), and wait for them with a bound: after the first rank fails, the others fail within their own
deadlines (runtime/tp_group.py); one that has not ended `grace_s` later is stopped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
POLL_S = 0.1


def rank_from_env() -> tuple[int, int, str, int] | None:
    """(rank, world size, rendezvous address, port) when this process was started as one rank of a group
    (by `run_ranks` or torchrun); None otherwise."""
    if "WORLD_SIZE" not in os.environ:
        return None
    missing = [v for v in RANK_VARIABLES if v not in os.environ]
    if missing:
        raise ValueError(f"started as one rank of a group (WORLD_SIZE is set) but {', '.join(missing)} not")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], size: int, grace_s: float, say: Callable[[str], None]) -> int:
    """`python -m k3mk.compiler.cli ARGV` as ranks 0..size-1 (their stdout and stderr are this process's).
    Returns 0 if every rank did, else the largest exit status of a rank (2 for a rank ended by a signal
    or stopped here)."""
    port = _free_port()
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "k3mk.compiler.cli", *argv], env=env))
    say(f"started {size} processes, one per rank (pids {', '.join(str(p.pid) for p in procs)})")
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    say(f"rank {rank} (pid {p.pid}) did not end within {grace_s:g} s of another rank's failure: stopping it")
                    p.kill()
                    p.wait()
            break
        time.sleep(POLL_S)
    statuses = [p.returncode for p in procs]
    for rank, status in enumerate(statuses):
        if status < 0:
            say(f"rank {rank} was ended by signal {-status}")
    return max((2 if s < 0 else s) for s in statuses)
