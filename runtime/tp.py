"""Tensor-parallel decode: ONE artifact compiled for `--tp N`, run by this one process on N GPUs, each rank
its own Megakernel on its own device (docs/megakernel.md "Tensor parallelism").

    model = TPDecodeModel(artifact_dir, weights)        # FULL weights by name, on any device; GPUs 0..N-1
    next_tokens, logits = model.step(token_ids, positions)   # or model.launch(...): next_tokens only

Rank r (device `devices[r]`): the kernel and task table loaded there; every weight bound as rank r's piece
of the full tensor (the manifest's `tp_shards`: split along a dim, or replicated when absent); the decode
state allocated zeroed, or cut from full states; the `tp_rank` step input written once; a zeroed comm
region (the manifest's `comm`: counters, then the receive slots of both step parities). Peer access is
enabled between all the devices and every rank's pointer table lists all N comm regions (unified
addressing: one address per region, valid on every peer). A step writes every rank's inputs, THEN
launches every rank's kernel on its device's current stream: a rank's kernel waits for every other
rank's, so a host that synchronised with one rank between the launches would deadlock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from k3mk.runtime.driver import enable_peer_access
from k3mk.runtime.manifest import ArtifactError, load_manifest
from k3mk.runtime.megakernel import Megakernel
from k3mk.runtime.tokens import mark_nonfinite

TP_RANK = "tp_rank"  # the step input holding the rank (k3mk.ir.collectives.TP_RANK; a test checks they agree)


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


class TPDecodeModel:
    def __init__(self, artifact_dir: str | Path, weights: Mapping[str, torch.Tensor], states: Mapping[str, torch.Tensor] | None = None,
                 devices: list[int] | None = None):  # fmt: skip
        m = load_manifest(artifact_dir)
        self.tp, comm = m.data.get("tp", 1), m.data.get("comm")
        if self.tp < 2 or comm is None:
            raise ArtifactError(f"{artifact_dir} is not a tensor-parallel artifact (tp {self.tp}): run it with DecodeModel")
        self.devices = list(range(self.tp)) if devices is None else list(devices)
        if len(self.devices) != self.tp or len(set(self.devices)) != self.tp:
            raise ValueError(f"a tp {self.tp} artifact runs on {self.tp} distinct GPUs, got devices {self.devices}")
        self.shards: dict[str, dict] = m["tp_shards"]
        self.batch, self.max_context = m.data.get("max_tokens"), m.data.get("max_context")
        self.ranks = [Megakernel(artifact_dir, device) for device in self.devices]
        enable_peer_access(self.devices)
        self.comm = [torch.zeros(comm["nbytes"], dtype=torch.uint8, device=mk.device) for mk in self.ranks]
        names = [name for name, _, _ in self.ranks[0].weight_specs]
        missing = [n for n in names if n not in weights]
        if missing:
            raise KeyError(f"weights missing for this artifact: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        for rank, mk in enumerate(self.ranks):
            mk.bind_comm([region.data_ptr() for region in self.comm])
            mk.bind_weights({n: self.piece(n, weights[n], rank, mk.device) for n in names})
            if states is None:
                mk.allocate_states()
            else:
                mk.bind_states({n: self.piece(n, states[n], rank, mk.device) for n, _, _ in mk.state_specs})
            mk.buffer(TP_RANK).fill_(rank)

    def piece(self, name: str, full: torch.Tensor, rank: int, device: torch.device) -> torch.Tensor:
        """What rank `rank` binds for the full tensor `name`: its piece, or all of it when replicated."""
        local = shard_piece(full, self.shards[name], rank) if name in self.shards else full
        return local.to(device).contiguous()

    def step(self, token_ids, positions, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step on every rank: (next_tokens int32 [batch], rank 0's arena view; logits [batch,
        vocab] assembled from the ranks' vocabulary shards on rank 0's device: a copy and a torch.cat).
        NONFINITE_TOKEN (-1) where a request's logits are not finite, as DecodeModel.step."""
        next_tokens, logits = self.launch(token_ids, positions), self.output("logits")
        if check_finite:
            mark_nonfinite(next_tokens, logits)
        return next_tokens, logits

    def launch(self, token_ids, positions) -> torch.Tensor:
        """One decode step on every rank, one kernel launch each and nothing else on the GPUs but the
        input copies: next_tokens int32 [batch] (rank 0's arena view; every rank holds the same)."""
        # One conversion on the host (synchronises with the inputs' device), then plain copies into every
        # rank's arena, all before the first launch (module docstring).
        host = {name: torch.as_tensor(value).reshape(-1).to("cpu", torch.int32) for name, value in
                (("token_ids", token_ids), ("positions", positions))}  # fmt: skip
        for mk in self.ranks:
            for name, value in host.items():
                mk.buffer(name).copy_(value.view(mk.buffer(name).shape))
        for mk in self.ranks:
            mk.step()
        return self.ranks[0].buffer("next_tokens")

    def output(self, name: str) -> torch.Tensor:
        """A step output, whole on rank 0's device (a split one assembled from every rank's piece)."""
        if name not in self.shards:
            return self.ranks[0].buffer(name)
        return shard_whole([mk.buffer(name).to(self.ranks[0].device) for mk in self.ranks], self.shards[name])

    def states(self) -> dict[str, torch.Tensor]:
        """The decode state, whole on rank 0's device."""
        return {name: shard_whole([mk.states[name].to(self.ranks[0].device) for mk in self.ranks], self.shards[name])
                if name in self.shards else self.ranks[0].states[name] for name, _, _ in self.ranks[0].state_specs}  # fmt: skip

    def reset(self) -> None:
        """Every rank's counters, control words and comm regions back to zero (after an aborted step: the
        ranks' step counts must agree)."""
        for mk, region in zip(self.ranks, self.comm):
            mk.reset()
            region.zero_()

    def check(self) -> None:
        """Debug builds: raise the first rank's WatchdogError, if any rank's watchdog fired."""
        for mk in self.ranks:
            mk.check()
