"""The tensor-parallel runner without a GPU: its copies of the shard rules agree with the compiler's
(k3mk.runtime imports no compiler package), and the artifact's content key tells builds apart."""

from __future__ import annotations

import json

import pytest
import torch

from k3mk.ir import collectives
from k3mk.ir.collectives import ShardSpec
from k3mk.runtime.tp import TP_RANK, artifact_key, rank_pieces, shard_piece, shard_whole


@pytest.mark.parametrize("shape,dim,parts,groups", [((6, 8), 0, 2, 1), ((4, 3, 24), 2, 2, 3), ((2, 16), 1, 8, 1), ((4, 8, 6), 1, 4, 1)])
def test_shard_piece_and_whole_agree_with_shard_spec(shape, dim, parts, groups):
    full = torch.randn(shape)
    spec = ShardSpec(dim, parts, groups)
    shard = {"dim": dim, "parts": parts, "groups": groups}
    pieces = [shard_piece(full, shard, r) for r in range(parts)]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, spec.take(full, r)) and piece.is_contiguous()
    assert torch.equal(shard_whole(pieces, shard), spec.assemble(pieces))
    assert torch.equal(shard_whole(pieces, shard), full)


def test_rank_pieces_cut_the_split_weights_only():
    weights = {"a": torch.randn(8, 4), "b": torch.randn(3)}
    pieces = rank_pieces(weights, {"a": {"dim": 0, "parts": 4, "groups": 1}}, 2)
    assert torch.equal(pieces["a"], weights["a"][4:6]) and pieces["b"] is weights["b"]


def test_rank_input_name_agrees():
    assert TP_RANK == collectives.TP_RANK


def test_artifact_key_follows_the_manifest(tmp_path):
    manifests = [{"tp": 2, "files_sha256": {"cubin": h}} for h in ("ab" * 32, "cd" * 32)]
    keys = []
    for i, m in enumerate(manifests + manifests[:1]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "manifest.json").write_text(json.dumps(m))
        keys.append(artifact_key(tmp_path / str(i)))
    assert keys[0] == keys[2] != keys[1] and len(keys[0]) == 16
