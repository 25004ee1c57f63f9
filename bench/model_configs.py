"""The model config a bench tool runs: a preset, or one of the bench's own truncations in bench/configs/<name>/config.json
(a model's first layers, sized to fit one H100's 80 GB where the whole model needs an H200: relative timings of two
builds on an H100 when no H200 is lent; grid cells stay the whole model's)."""

from __future__ import annotations

from pathlib import Path

from k3mk.compiler.config import PRESETS, ModelConfig, load_config

CONFIGS = Path(__file__).resolve().parent / "configs"


def bench_config(name: str) -> ModelConfig:
    """Preset `name`, else bench/configs/`name` (a compile's manifest records the config directory's name)."""
    if name in PRESETS or not (CONFIGS / name).is_dir():
        return load_config(name)
    return load_config(CONFIGS / name)


def artifact_config(manifest: dict, where: str) -> ModelConfig:
    """The config an artifact (`where`, its manifest) was compiled from, checked by its hash: random weights of another
    config would not bind, or worse, bind to a different model."""
    config = bench_config(manifest["model"])
    if config.hash() != manifest["config_hash"]:
        raise SystemExit(f"{where}: compiled from a config named {manifest['model']!r} whose hash {manifest['config_hash']} is not "
                         f"that of the preset or bench/configs/ entry of that name ({config.hash()})")
    return config
