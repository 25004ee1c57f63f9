"""bench/configs/: each entry is its whole model's first layers (every field but the layer count and the per-layer
lists equal, those lists a prefix of the whole model's), sized for one H100; bench tools load it by the name a compile
records and refuse an artifact whose config hash is another's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from k3mk.bench.model_configs import CONFIGS, artifact_config, bench_config
from k3mk.compiler.config import load_config
from k3mk.compiler.limits import weight_bytes

H100_BYTES = 78 * 2**30  # what the device tool lends of an H100; the weights leave a fifth for state, arena, reference
WHOLE = {"kimi-linear-48b-a3b-16l": "kimi-linear-48b-a3b", "k3-proxy-12l-bf16": "k3-proxy-16l-bf16"}


def test_every_entry_is_listed():
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == sorted(WHOLE)


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_an_entry_is_its_whole_models_first_layers(name):
    cut, whole = bench_config(name), load_config(WHOLE[name])
    n = cut.num_layers
    assert 0 < n < whole.num_layers
    assert cut.layer_kinds == whole.layer_kinds[:n] and "mla" in cut.layer_kinds and "kda" in cut.layer_kinds
    same = {"num_layers", "layer_kinds", "name", "source"}
    for f in dataclasses.fields(whole):
        if f.name not in same:
            assert getattr(cut, f.name) == getattr(whole, f.name), f.name
    assert weight_bytes(cut, 2) < 0.8 * H100_BYTES < H100_BYTES < weight_bytes(whole, 2)


def test_a_preset_name_stays_the_preset():
    assert bench_config("k3-tiny") == load_config("k3-tiny")


def test_an_artifact_of_another_config_is_refused(tmp_path):
    cut = bench_config("kimi-linear-48b-a3b-16l")
    assert artifact_config({"model": "kimi-linear-48b-a3b-16l", "config_hash": cut.hash()}, "a") == cut
    with pytest.raises(SystemExit, match="kimi-linear-48b-a3b-16l.*not that of"):
        artifact_config({"model": "kimi-linear-48b-a3b-16l", "config_hash": load_config("kimi-linear-48b-a3b").hash()}, "art")
    # the manifest of a compile from that directory names it, and its hash is the entry's
    data = json.loads((CONFIGS / "kimi-linear-48b-a3b-16l" / "config.json").read_text())
    (tmp_path / "kimi-linear-48b-a3b-16l").mkdir()
    (tmp_path / "kimi-linear-48b-a3b-16l" / "config.json").write_text(json.dumps(data))
    assert load_config(tmp_path / "kimi-linear-48b-a3b-16l").name == "kimi-linear-48b-a3b-16l"
    assert load_config(tmp_path / "kimi-linear-48b-a3b-16l").hash() == cut.hash()
