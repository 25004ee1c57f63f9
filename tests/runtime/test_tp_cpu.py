"""The tensor-parallel runner without a GPU: its copies of the shard rules agree with the compiler's
(k3mk.runtime imports no compiler package), and it refuses what it cannot run with clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from k3mk.ir import collectives
from k3mk.ir.collectives import ShardSpec
from k3mk.runtime.manifest import ArtifactError
from k3mk.runtime.tp import TP_RANK, TPDecodeModel, shard_piece, shard_whole

sys.path.insert(0, str(Path(__file__).parent))
from fake_artifact import edit_manifest, fake_artifact, model_meta  # noqa: E402


@pytest.mark.parametrize("shape,dim,parts,groups", [((6, 8), 0, 2, 1), ((4, 3, 24), 2, 2, 3), ((2, 16), 1, 8, 1), ((4, 8, 6), 1, 4, 1)])
def test_shard_piece_and_whole_agree_with_shard_spec(shape, dim, parts, groups):
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    spec = ShardSpec(dim, parts, groups)
    shard = {"dim": dim, "parts": parts, "groups": groups}
    pieces = [shard_piece(full, shard, r) for r in range(parts)]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, spec.take(full, r)) and piece.is_contiguous()
    assert torch.equal(shard_whole(pieces, shard), spec.assemble(pieces))
    assert torch.equal(shard_whole(pieces, shard), full)


def test_rank_input_name_agrees():
    assert TP_RANK == collectives.TP_RANK


def _artifact(tmp_path, tp: int):
    art = fake_artifact(tmp_path / "art", meta=model_meta())
    if tp > 1:  # what a tensor-parallel table adds (the diamond case is a tp-1 table)
        edit_manifest(art, lambda m: m.update(tp=tp, tp_shards={}, comm={"ranks": tp, "events": 1, "half": 16, "nbytes": 288}))
    return art


def test_refuses_a_single_rank_artifact(tmp_path):
    with pytest.raises(ArtifactError, match=r"not a tensor-parallel artifact \(tp 1\): run it with DecodeModel"):
        TPDecodeModel(_artifact(tmp_path, tp=1), {})


def test_refuses_the_wrong_number_of_devices(tmp_path):
    art = _artifact(tmp_path, tp=2)
    with pytest.raises(ValueError, match=r"runs on 2 distinct GPUs, got devices \[0, 0\]"):
        TPDecodeModel(art, {}, devices=[0, 0])
