"""Checkpoint I/O in the published formats: HF safetensors <-> the canonical weight table.

`load_checkpoint` reads a checkpoint directory (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) into the CANONICAL names of compiler/weights.py; `save_checkpoint`
writes canonical weights back in the published form. Tensors are read lazily (`safe_open`, tensor by
tensor, then moved to the target device), so loading a 90 GB checkpoint onto a GPU peaks at about
one copy of the weights.

Published form (models/TENSORS.md; spec 3.1, 4.1, 5.5):
- names: the canonical names behind `config.checkpoint_prefix` (K3 `language_model.`, Kimi Linear
  none); routed experts one tensor per expert, `...block_sparse_moe.experts.{e}.w1.weight` or, for
  MXFP4, `...experts.{e}.w1.weight_packed` U8 [out, in/2] + `.weight_scale` U8 [out, in/32]. The
  loader stacks them into the canonical [E, ...] tensors.
- dtypes written: K3: BF16, except F32 for the spec's fp32 parameters (conv weights, A_log, dt_bias,
  o_norm, e_score_correction_bias; spec 9). Kimi Linear: BF16 except F32 A_log and dt_bias.
  Routed MXFP4 experts U8.
- K3 writes `A_log` padded to a multiple of 128 entries (F32[128] with 96 live in the real
  checkpoint); Kimi Linear writes it as [1, 1, H, 1].

Equivalent layouts accepted when loading (anything else is a CheckpointError):
1. `A_log` as [H], as a 1-D [roundup(H, 128)] whose padding is ignored (K3), or [1, 1, H, 1]
   (Kimi Linear, and transformers' save_pretrained).
2. The dense MLP of a non-MoE layer under `model.layers.{i}.block_sparse_moe.{gate,up,down}_proj`
   instead of `model.layers.{i}.mlp.*`: transformers 5.x's conversion mapping for `kimi_linear`
   renames `.block_sparse_moe.` -> `.mlp.` on load and reverses it on save for EVERY layer, so its
   save_pretrained moves layer 0's dense MLP there. Both names at once is an error.
3. Any floating dtype (F64, F32, F16, BF16) for a floating weight; it converts to the compute dtype
   (or F32 for the "float32" kind). Integer data where a float is expected, or anything but U8 where
   MXFP4 bytes are expected, is an error.
4. K3 only: tensors outside the `language_model.` prefix (the vision tower and `mm_projector` of the
   multimodal checkpoint) are not part of the text model and are skipped. Unknown names inside the
   text model's namespace are errors.

Refused besides (the loader reads every byte anyway): a NaN or Inf in any floating weight (after the
conversion to the compute dtype), an MXFP4 scale byte 0xFF (UE8M0's NaN), and an index whose shard
names point outside the checkpoint directory (an absolute path or a `..`).

What transformers 5.20 `KimiLinearForCausalLM.save_pretrained` writes (checked on a tiny model):
the published names (`q_conv1d`/`k_conv1d`/`v_conv1d` split back from its fused `conv1d`, per-expert
`experts.{e}.w1/w2/w3.weight` unstacked from its `gate_up_proj`/`down_proj`, `A_log` [1, 1, H, 1],
`f_a_proj`/`f_b_proj`/`dt_bias` back under `self_attn`), every tensor in the model's dtype (all F32
or all BF16, including A_log, dt_bias and the correction bias), the dense layer-0 MLP under
`block_sparse_moe.*` (layout 2), shards named `model-0000i-of-0000n.safetensors` with an index whose
metadata holds `total_size` and `total_parameters`.

MXFP4 (`quantize_mxfp4`; spec 5.5, settles open question 13.2): compressed-tensors 0.20.1
`mxfp4-pack-quantized` (MXFP4PackedCompressor, `pack_fp4_to_uint8`, `unpack_fp4_from_uint8`,
`generate_mx_scales`) stores per byte two E2M1 codes, the LOW nibble holding the EVEN input index;
a code is sign bit 3 | magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6); the scale byte is UE8M0,
2^(s - 127), one per 32 consecutive inputs of a row. This is what `ir.semantics.dequant_mxfp4`
decodes (tests/compiler/test_mxfp4.py checks it against compressed-tensors' own decoder).
compressed-tensors chooses the scale by rounding the group's max |w| to a power of two (a mantissa
>= 1.75 rounds up) and dividing by 4 = 2^emax(E2M1), so values beyond 6 clamp to 6; an all-zero group
gets scale byte 0. Elements round to nearest, ties to the even code; the sign bit is set for every
negative input, also one that rounds to zero (code 8, "-0"), but not for -0.0 itself.
`quantize_mxfp4` implements the same rules and reproduces its bytes exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from k3mk.compiler.config import PRESETS, ModelConfig, parse_config
from k3mk.compiler.weights import TensorSpec, weight_specs
from k3mk.ir.collectives import ShardSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_DENSE_MLP = re.compile(r"(model\.layers\.\d+)\.mlp\.((?:gate|up|down)_proj\.weight)")
A_LOG_PADDING = 128  # K3 pads A_log to a multiple of this (spec 3.1)


class CheckpointError(ValueError):
    """An unreadable or non-matching checkpoint. The message names the file (when known), the tensor,
    and what was expected versus found."""


# --- MXFP4 ------------------------------------------------------------------------------------------

def quantize_mxfp4(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor]:
    """w [..., out, in] float -> (packed uint8 [..., out, in/2], scale uint8 [..., out, in/group]),
    byte-identical to compressed-tensors' `mxfp4-pack-quantized` (module docstring)."""
    *lead, out, inp = w.shape
    if inp % group_size or group_size % 2:
        raise ValueError(f"MXFP4: the input width {inp} must be a multiple of the group size {group_size}")
    groups = w.to(torch.float32).reshape(*lead, out, inp // group_size, group_size)
    amax = groups.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # floor(log2(amax)) = exponent - 1; a mantissa >= 1.75 (frexp: >= 0.875) rounds up a power of two
    power = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)
    scale = torch.where(amax > 0, (power - 2 + 127).clamp(0, 255), 0)
    q = groups / torch.exp2(scale.to(torch.float32) - 127).unsqueeze(-1)
    # Round to nearest E2M1 magnitude (0, 0.5, 1, 1.5 | 2, 3 | 4, 6), ties to even as compressed-tensors'
    # cast_to_fp4: the grid step is 1/2, 1 and 2 on [0, 2), [2, 4) and [4, 6], and torch.round rounds
    # half to even, which on each segment is the even code (codes 0..3 | 4, 5 | 6, 7).
    m = q.abs().clamp(max=6.0)
    code = torch.where(m < 2, torch.round(2 * m), torch.where(m < 4, torch.round(m) + 2, torch.round(m / 2) + 4))
    # the sign bit marks x < 0, also when x rounds to zero (-0.0 itself encodes as +0)
    code = code.to(torch.uint8) | ((q < 0).to(torch.uint8) << 3)
    code = code.reshape(*lead, out, inp // 2, 2)
    return code[..., 0] | (code[..., 1] << 4), scale.to(torch.uint8)


# --- the mapping canonical <-> stored -----------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    """One stored tensor of a canonical weight: the names it may have (the published one first) and,
    for a routed expert weight, the expert it is within the canonical stacked tensor."""

    names: tuple[str, ...]
    expert: int | None


def _stored_tensors(config: ModelConfig, spec: TensorSpec) -> list[_Stored]:
    prefix = config.checkpoint_prefix
    if ".experts." in spec.name:
        head, tail = spec.name.split(".experts.")
        return [_Stored((f"{prefix}{head}.experts.{e}.{tail}",), e) for e in range(spec.shape[0])]
    names = (prefix + spec.name,)
    dense = _DENSE_MLP.fullmatch(spec.name)
    if dense:
        names += (f"{prefix}{dense[1]}.block_sparse_moe.{dense[2]}",)
    return [_Stored(names, None)]


def _canonical_stored_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Shape of one stored tensor of `spec` in the canonical layout: an expert's slice for experts."""
    return spec.shape[1:] if ".experts." in spec.name else spec.shape


def _padded(heads: int) -> int:
    return -(-heads // A_LOG_PADDING) * A_LOG_PADDING


def _layouts(spec: TensorSpec) -> dict[tuple[int, ...], Callable[[Tensor], Tensor]]:
    """Accepted stored shapes of one stored tensor of `spec`, each with its conversion to canonical."""
    shape = _canonical_stored_shape(spec)
    layouts: dict[tuple[int, ...], Callable[[Tensor], Tensor]] = {shape: lambda t: t}
    if spec.name.endswith(".A_log"):
        (heads,) = shape
        layouts[(_padded(heads),)] = lambda t: t[:heads]
        layouts[(1, 1, heads, 1)] = lambda t: t.reshape(heads)
    return layouts


def _published_dtype(config: ModelConfig, spec: TensorSpec) -> torch.dtype:
    if spec.dtype == "uint8":
        return torch.uint8
    fp32 = spec.name.endswith((".A_log", ".dt_bias")) if config.model_type == "kimi_linear" else spec.dtype == "float32"
    return torch.float32 if fp32 else torch.bfloat16


def _published_shape(config: ModelConfig, spec: TensorSpec) -> tuple[int, ...]:
    """Shape of one stored tensor of `spec` as published."""
    if spec.name.endswith(".A_log"):
        return (1, 1, spec.shape[0], 1) if config.model_type == "kimi_linear" else (_padded(spec.shape[0]),)
    return _canonical_stored_shape(spec)


def _published(config: ModelConfig, spec: TensorSpec, t: Tensor) -> Tensor:
    """One stored tensor of `spec` (an expert's slice for routed experts) in its published dtype and
    layout, as a fresh CPU tensor (per-expert views share storage, which safetensors refuses)."""
    t = t.detach().to(device="cpu", dtype=_published_dtype(config, spec), copy=True)
    shape = _published_shape(config, spec)
    if spec.name.endswith(".A_log") and len(shape) == 1:
        t = torch.cat([t, t.new_zeros(shape[0] - t.shape[0])])
    return t.reshape(shape)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# --- loading --------------------------------------------------------------------------------------


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Stored tensor name -> the file holding it, from the index or the single file."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    if single.exists() and index.exists():
        raise CheckpointError(f"{directory}: holds both {SINGLE_FILE} and {INDEX_FILE}; expected exactly one")
    if single.exists():
        with ExitStack() as stack:
            return {name: single for name in _open(single, stack).keys()}
    if not index.exists():
        raise CheckpointError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    for name, shard in weight_map.items():
        parts = PurePosixPath(shard).parts
        if not parts or PurePosixPath(shard).is_absolute() or ".." in parts or "\\" in shard:
            raise CheckpointError(f"{index}: tensor '{name}' points to shard '{shard}', outside the checkpoint directory {directory}")
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            first = next(name for name, s in weight_map.items() if s == shard)
            raise CheckpointError(f"{index}: shard '{shard}' (holding e.g. tensor '{first}') is missing from {directory}")
    return {name: directory / shard for name, shard in weight_map.items()}


def _open(path: Path, stack: ExitStack):
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def _check_names(
    config: ModelConfig, directory: Path, files: dict[str, Path], specs: list[TensorSpec], plan: dict[str, list[_Stored]]
) -> dict[str, list[str]]:
    """The stored name chosen for each stored tensor of each canonical weight; raises on missing,
    duplicated or unknown tensors."""
    prefix = config.checkpoint_prefix
    chosen: dict[str, list[str]] = {}
    missing: list[str] = []
    for spec in specs:
        chosen[spec.name] = []
        for s in plan[spec.name]:
            present = [n for n in s.names if n in files]
            if len(present) > 1:
                raise CheckpointError(f"{files[present[0]]}: tensor '{spec.name}' is stored under two names: {present}")
            if not present:
                missing.append(" or ".join(f"'{n}'" for n in s.names) + f" (expected shape {_fmt(_canonical_stored_shape(spec))})")
            else:
                chosen[spec.name].append(present[0])
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        hint = f"; no tensor name starts with '{prefix}'" if prefix and not any(n.startswith(prefix) for n in files) else ""
        listing = "; ".join(missing[:5])
        raise CheckpointError(f"{directory}: missing tensor {missing[0]}{hint}; {len(missing)} missing in all: {listing}{more}")
    claimed = {n for names in chosen.values() for n in names}
    unknown = sorted(n for n in files if n.startswith(prefix) and n not in claimed)
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise CheckpointError(
            f"{files[unknown[0]]}: unknown tensor '{unknown[0]}' (not in the weight table of config '{config.name}'); "
            f"{len(unknown)} unknown in all: {', '.join(unknown[:5])}{more}"
        )
    return chosen


def _read(handle, path: Path, name: str, spec: TensorSpec, dtype: torch.dtype, device, piece: tuple[ShardSpec, int] | None = None) -> Tensor:
    """One stored tensor, checked against `spec`, converted to its canonical layout and dtype. `piece`
    (shard, rank) with the shard's dim in the STORED tensor: only that rank's piece, and for a tensor in
    the canonical layout only its bytes are read (safetensors slices)."""
    try:
        view = handle.get_slice(name)
        shape, stored = tuple(view.get_shape()), view.get_dtype()
    except SafetensorError as e:
        raise CheckpointError(f"{path}: tensor '{name}' cannot be read (the index may point to the wrong shard): {e}") from None
    allowed = ("U8",) if spec.dtype == "uint8" else _FLOAT_DTYPES
    if stored not in allowed:
        kind = "MXFP4 bytes" if spec.dtype == "uint8" else f"a {spec.dtype} weight"
        raise CheckpointError(f"{path}: tensor '{name}': expected dtype {' or '.join(allowed)} for {kind}, found {stored}")
    layouts = _layouts(spec)
    if shape not in layouts:
        expected = " or ".join(_fmt(s) for s in layouts)
        raise CheckpointError(f"{path}: tensor '{name}': expected shape {expected}, found {_fmt(shape)}")
    canonical = shape == _canonical_stored_shape(spec)
    try:
        if piece is not None and canonical:
            shard, rank = piece
            lead = (slice(None),) * shard.dim
            t = torch.cat([view[lead + (slice(start, stop),)] for start, stop in shard.ranges(shape[shard.dim], rank)], dim=shard.dim)
        else:
            t = handle.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: tensor '{name}' cannot be read (truncated or corrupt file?): {e}") from None
    t = layouts[shape](t.to(device))
    if piece is not None and not canonical:  # another accepted layout (A_log's, a few bytes): read whole, then cut
        t = piece[0].take(t, piece[1])
    out = t.to(dtype)
    _check_finite(path, name, out)
    return out


def _shard(spec: TensorSpec, shards: Mapping[str, Mapping[str, int]] | None) -> ShardSpec | None:
    """The tensor-parallel split of canonical weight `spec` under `shards` (an artifact manifest's
    `tp_shards`: {name: {dim, parts, groups}}), checked against its shape; None: whole."""
    if not shards or spec.name not in shards:
        return None
    shard = ShardSpec(shards[spec.name]["dim"], shards[spec.name]["parts"], shards[spec.name].get("groups", 1))
    stacked = ".experts." in spec.name
    if shard.dim >= len(spec.shape) or (stacked and shard.dim == 0) or spec.shape[shard.dim] % (shard.parts * shard.groups):
        raise CheckpointError(f"tensor '{spec.name}' {_fmt(spec.shape)} cannot be split as {shard.text()} (routed experts split within each expert)")
    return shard


MXFP4_NAN_SCALE = 0xFF  # UE8M0's one non-number: the whole group of 32 would dequantise to NaN


def _check_finite(path: Path, name: str, t: Tensor) -> None:
    """Every value finite, after the conversion to the compute dtype (an F32 value beyond bf16's range
    becomes Inf there); MXFP4 scale bytes other than the NaN encoding (the E2M1 codes are all finite)."""
    if t.dtype.is_floating_point:
        bad = ~torch.isfinite(t)
        what = "a non-finite value"
    elif name.endswith(".weight_scale"):
        bad = t == MXFP4_NAN_SCALE
        what = f"the MXFP4 scale byte {MXFP4_NAN_SCALE:#x} (UE8M0 NaN)"
    else:
        return
    if bad.any():
        index = [int(i) for i in bad.nonzero()[0]]
        value = t[tuple(index)].item()
        raise CheckpointError(f"{path}: tensor '{name}' holds {what} at {index} ({value}; {int(bad.sum())} in all): refusing non-finite weights")


def load_checkpoint(
    config: ModelConfig,
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    shards: Mapping[str, Mapping[str, int]] | None = None,
    rank: int = 0,
) -> dict[str, Tensor]:
    """Every weight of `config` from a checkpoint directory, under canonical names (weights.py):
    floating weights in `dtype` (the "float32" kind in float32), MXFP4 bytes as uint8, on `device`.
    With `shards` (a tensor-parallel artifact's `tp_shards`), each weight named there is rank `rank`'s
    piece, and only its bytes are read from the files."""
    directory = Path(directory)
    files = _tensor_files(directory)
    specs = weight_specs(config)
    plan = {spec.name: _stored_tensors(config, spec) for spec in specs}
    chosen = _check_names(config, directory, files, specs, plan)
    out: dict[str, Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str, spec: TensorSpec, target: torch.dtype, piece) -> Tensor:
            path = files[name]
            if path not in handles:
                handles[path] = _open(path, stack)
            return _read(handles[path], path, name, spec, target, device, piece)

        for spec in specs:
            target = spec.torch_dtype(dtype)
            stored, shard = plan[spec.name], _shard(spec, shards)
            if stored[0].expert is None:
                out[spec.name] = read(chosen[spec.name][0], spec, target, shard and (shard, rank))
                continue
            # filled expert by expert (~1x peak memory); each stored expert lacks the stacked dim 0
            shape = shard.local_shape(spec.shape) if shard else spec.shape
            stacked = torch.empty(shape, dtype=target, device=device)
            piece = shard and (dataclasses.replace(shard, dim=shard.dim - 1), rank)
            for s, name in zip(stored, chosen[spec.name]):
                stacked[s.expert] = read(name, spec, target, piece)
            out[spec.name] = stacked
    return out


# --- saving ---------------------------------------------------------------------------------------


def source_config_json(config: ModelConfig) -> dict[str, Any]:
    """The raw config.json a config was parsed from (its preset file or `config.source`). Raises if it
    no longer describes `config` (a config changed with `replace`): pass the JSON explicitly then."""
    preset = re.fullmatch(r"preset '(.+)'", config.source)  # how load_config names a preset source
    if preset and preset[1] in PRESETS:
        raw = json.loads(resources.files("k3mk.compiler").joinpath("presets", f"{preset[1]}.json").read_text())
    elif config.source and Path(config.source).is_file():
        raw = json.loads(Path(config.source).read_text())
    else:
        raise CheckpointError(f"config '{config.name}': its source '{config.source}' is neither a preset nor a file; pass config_json")
    if parse_config(raw, where=config.source, name=config.name).hash() != config.hash():
        raise CheckpointError(
            f"config '{config.name}' differs from its source '{config.source}' (changed after loading?); pass config_json"
        )
    return raw


def _check_canonical(specs: list[TensorSpec], weights: dict[str, Tensor]) -> None:
    names = {s.name for s in specs}
    for name in weights:
        if name not in names:
            raise CheckpointError(f"weights: unknown tensor '{name}' (not in the weight table)")
    for spec in specs:
        if spec.name not in weights:
            raise CheckpointError(f"weights: missing tensor '{spec.name}' (expected shape {_fmt(spec.shape)})")
        t = weights[spec.name]
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"weights: tensor '{spec.name}': expected shape {_fmt(spec.shape)}, found {_fmt(t.shape)}")
        if (spec.dtype == "uint8") != (t.dtype == torch.uint8) or (spec.dtype != "uint8" and not t.dtype.is_floating_point):
            expected = "uint8" if spec.dtype == "uint8" else "a floating dtype"
            raise CheckpointError(f"weights: tensor '{spec.name}': expected {expected}, found {t.dtype}")


def save_checkpoint(
    config: ModelConfig,
    weights: dict[str, Tensor],
    directory: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    config_json: dict[str, Any] | None = None,
) -> Path:
    """Write canonical `weights` as a checkpoint in the published form (module docstring) plus
    config.json (`config_json`, default: the config's source JSON). Sharded with an index when the
    tensors exceed `max_shard_bytes`. Written into a temporary sibling directory and renamed into
    place, so an interrupted save never leaves a complete-looking checkpoint; `directory` must not
    exist or be empty."""
    directory = Path(directory)
    specs = weight_specs(config)
    _check_canonical(specs, weights)
    raw = config_json if config_json is not None else source_config_json(config)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise CheckpointError(f"{directory}: exists and is not an empty directory; refusing to overwrite")

    # (stored name, spec, expert) in table order, and their sizes, to plan shards before materializing
    entries = [(s.names[0], spec, s.expert) for spec in specs for s in _stored_tensors(config, spec)]

    def nbytes(spec: TensorSpec) -> int:
        return math.prod(_published_shape(config, spec)) * _published_dtype(config, spec).itemsize

    shards: list[list[tuple[str, TensorSpec, int | None]]] = [[]]
    size = 0
    for entry in entries:
        b = nbytes(entry[1])
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += b
    total = sum(nbytes(spec) for _, spec, _ in entries)
    names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        for file, shard in zip(names, shards):
            tensors = {
                name: _published(config, spec, weights[spec.name] if expert is None else weights[spec.name][expert])
                for name, spec, expert in shard
            }
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {name: file for file, shard in zip(names, shards) for name, _, _ in shard}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
        if directory.exists():
            directory.rmdir()
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
