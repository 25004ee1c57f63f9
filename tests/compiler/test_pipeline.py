"""The compile driver: capture + the written prefix of the pipeline, the summary, `k3mk compile`'s options."""

from __future__ import annotations

import argparse

import pytest

from k3mk.compiler.cli import build_parser
from k3mk.compiler.config import load_config
from k3mk.compiler.pipeline import CompileError, compile_graph, run_compile, summary
from k3mk.passes.manager import PIPELINE, available


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["compile", *argv])


def test_compile_runs_passes_until_and_summarizes(tmp_path):
    """Stops after tp_shard, so the test does not depend on the later passes' state of progress."""
    lines = []
    result = compile_graph(load_config("k3-tiny"), tp=2, max_context=64, arch="sm_100a", dump_dir=tmp_path, progress=lines.append, until="tp_shard")
    written = [p.name for p in available(PIPELINE)]
    assert [r.name for r in result.run.records] == ["tp_shard"] and result.skipped == written[1:]
    assert result.missing == [p.name for p in PIPELINE[len(written) :]]
    # k3-tiny at tp 2, one token, 64 positions, per rank: 6 KDA layers x (conv 3 x 1536 bf16 + recurrent 4 x 128 x 128
    # fp32) / 2 ranks = 814,080 B; 2 MLA layers x the replicated latent cache 64 x 160 bf16 = 40,960 B
    assert lines[0] == "decode state per rank: 855.04 KB (KDA states 814.08 KB, MLA latent cache 40.96 KB)"
    assert lines[1].startswith("capture:") and lines[2].startswith("tp_shard:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_capture.txt", "01_tp_shard.txt"]
    assert result.sharded is result.output and result.sharded.meta["tp"] == 2
    text = summary(result)
    assert "tp=2" in text and "NOMINAL bandwidth 8.0 TB/s" in text and "not measured" in text
    assert "decode state per rank: 855.04 KB" in text
    assert "all_reduce x23" in text and "tasks and bytes per SM: not available" in text
    assert all(f"{name:16s} not run (until tp_shard)" in text for name in result.skipped)


def test_bad_targets_name_the_option():
    config = load_config("k3-tiny")
    with pytest.raises(CompileError, match=r"--tp 3: .*kda\.num_heads = 4"):
        compile_graph(config, tp=3)
    with pytest.raises(CompileError, match="--max-tokens 0: the megakernel runs 1 to 16 tokens per step"):
        compile_graph(config, max_tokens=0)
    with pytest.raises(CompileError, match="--until nope: no pass 'nope'"):
        compile_graph(config, until="nope")


def test_run_compile_prints_summary_and_rank_view(capsys):
    args = parse("--model", "k3-tiny", "--tp", "2", "--max-context", "32", "--show-rank", "1", "--until", "tp_shard")
    assert run_compile(args, load_config("k3-tiny")) == 0
    out, err = capsys.readouterr()
    assert out.startswith("k3mk compile k3-tiny: tp=2") and "rank 1 of 2:" in out
    assert "weight lm_head.weight: dim 0 [2048:4096] of 4096" in out
    assert "state layers.0.conv_state: dim 2 [256:512, 768:1024, 1280:1536] of 1536" in out
    assert "k3mk: capture:" in err
