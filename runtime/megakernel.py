"""Load an artifact and run decode steps: one cooperative launch per step on the current torch
stream, capturable in a CUDA graph (every pointer is fixed at load; every per-step value lives in
device memory; event counters are monotonic, so nothing is reset between steps).

    mk = Megakernel(artifact_dir)               # checks manifest vs device, loads the cubin
    mk.bind_weights({name: tensor, ...})        # by the names in the manifest's weight table
    mk.bind_states({name: tensor, ...})         # or mk.allocate_states(): decode state (format 2)
    mk.buffer("x").copy_(...)                   # named regions of the activation arena
    mk.step()                                   # one launch; in debug builds, mk.check() after it
    mk.profile_records()                        # profile builds: the last step's per-task stamps (runtime/profile.py)

The kernel's pointer table holds the weights, then the states (task table format 2): a state tensor
is bound like a weight and updated in place by the kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from k3mk.runtime import abi
from k3mk.runtime.driver import Module, PackedParams, launch_cooperative
from k3mk.runtime.manifest import ArtifactError, Manifest, check_device, load_manifest
from k3mk.runtime.schema import DTYPE_BYTES
from k3mk.runtime.table import LoadedTable, TaskTableFormatError, read_table

DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}  # the manifest's dtype names (runtime/schema.py)
DEFAULT_WATCHDOG_US = 2_000_000


class NoDeviceError(RuntimeError):
    """The artifact is valid, but this machine has no GPU to run it on."""


class WatchdogError(RuntimeError):
    """A debug build's wait outlived its bound: the step was aborted instead of hanging."""

    def __init__(self, message: str, records: list[dict]):
        super().__init__(message)
        self.records = records


def load_artifact(artifact_dir: str | Path) -> tuple[Manifest, LoadedTable]:
    """The artifact's manifest and task table, both validated and checked against each other, before any
    GPU work (so a bad artifact is reported as such on any machine)."""
    manifest = load_manifest(artifact_dir)
    try:
        table = read_table(manifest.read_file("task_table"))
    except TaskTableFormatError as e:
        raise ArtifactError(f"{manifest.file('task_table')}: {e}: rebuild the artifact") from None
    m = manifest
    for what, found, expected in (("lists", table.num_lists, m["num_ctas"]), ("events", table.num_events, m["num_events"]),
                                  ("tasks", table.num_tasks, m["num_tasks"]), ("variants", table.num_variants, len(m["variants"]))):  # fmt: skip
        if found != expected:
            raise ArtifactError(f"{m.file('task_table')} has {found} {what}, its manifest says {expected}: rebuild the artifact")
    return manifest, table


def _check_mxfp4_scales(name: str, scales: torch.Tensor) -> None:
    """Refuse an MXFP4 scale tensor with a byte the kernel's decode cannot apply (abi.MXFP4_MAX_SCALE)."""
    top = int(scales.max())
    if top > abi.MXFP4_MAX_SCALE:
        count = int((scales > abi.MXFP4_MAX_SCALE).sum())
        raise ValueError(f"weight {name!r}: MXFP4 scale byte {top} (2^{top - 127}; {count} byte(s) above the limit) > "
                         f"{abi.MXFP4_MAX_SCALE} (2^{abi.MXFP4_MAX_SCALE - 127}), the largest scale the kernel's MXFP4 decode "
                         "applies (one bf16 multiply per group)")


class Megakernel:
    def __init__(self, artifact_dir: str | Path, device: int | torch.device | None = None, poison_arena: bool = True):
        self.manifest, self.table = load_artifact(artifact_dir)
        m = self.manifest
        if not torch.cuda.is_available():
            raise NoDeviceError(f"{m.path}: a valid {m['arch']} artifact, but no CUDA GPU is available to torch on this machine")
        if device is None:
            device = torch.cuda.current_device()
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        check_device(self.manifest, (props.major, props.minor), props.multi_processor_count, props.name)
        self.num_ctas = m["num_ctas"]
        self.threads = m["block_threads"]
        self.smem = m["dynamic_smem_bytes"]
        self.debug_build = bool(m["debug"])
        self.profile_build = bool(m.data.get("profile", False))
        torch.cuda.init()
        with torch.cuda.device(self.device):
            self.module = Module(m.read_file("cubin"), m["kernel_name"], self.device.index, self.smem)
            if self.module.max_blocks_per_sm(self.threads, self.smem) < 1:
                raise ArtifactError(f"the kernel cannot be resident with {self.threads} threads and {self.smem} B smem")
        dev = self.device
        self._table_words = torch.frombuffer(bytearray(self.table.device_bytes), dtype=torch.int32).to(dev)
        self.events = torch.zeros(max(self.table.num_events, 1), dtype=torch.int64, device=dev)
        self.control = torch.zeros(abi.CONTROL_WORDS, dtype=torch.int64, device=dev)
        # The `debug` parameter's buffer: the watchdog records, then (profile builds) the per-task records.
        watchdog_words = self.num_ctas * abi.DEBUG_WORDS
        profile_words = abi.profile_words(self.table.num_tasks) if self.profile_build else 0
        if watchdog_words + profile_words >= 2**31:
            raise ArtifactError(f"{self.table.num_tasks} tasks: the profile records exceed the kernel's int32 offsets")
        self._diagnostics = torch.zeros(watchdog_words + profile_words, dtype=torch.int64, device=dev)
        self.debug_records = self._diagnostics[:watchdog_words]
        self._profile_ring = self._diagnostics[watchdog_words:].view(-1, self.table.num_tasks, abi.PROFILE_WORDS) if profile_words else None
        self.arena = torch.empty(max(m["arena_bytes"], 16), dtype=torch.uint8, device=dev)
        if poison_arena:
            self.arena.fill_(0xFF)  # bf16 NaN everywhere: an unwritten output never looks right
        self.weight_specs = [(w["name"], w["dtype"], tuple(w["shape"])) for w in m["weights"]]
        self.state_specs = [(st["name"], st["dtype"], tuple(st["shape"])) for st in m.data.get("states", [])]
        # tensor-parallel artifacts: pointer-table entries after the states hold every rank's comm region
        self.comm: dict | None = m.data.get("comm")
        self._comm_bound = self.comm is None
        pointers = len(self.weight_specs) + len(self.state_specs) + (self.comm["ranks"] if self.comm else 0)
        self.weight_table = torch.zeros(max(pointers, 1), dtype=torch.int64, device=dev)
        self._states: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._buffers = {b["name"]: b for b in m["buffers"]}
        self._params: dict[int, PackedParams] = {}

    # ---- binding ---------------------------------------------------------------------------
    def bind_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Bind weights by name (checked: dtype, shape, device, contiguous, 16-byte aligned; MXFP4 scale
        bytes at most abi.MXFP4_MAX_SCALE). The tensors are referenced, not copied: keep them alive and
        unchanged in place."""
        index = {name: i for i, (name, _, _) in enumerate(self.weight_specs)}
        unknown = set(weights) - set(index)
        if unknown:
            raise KeyError(f"weights not in this artifact: {sorted(unknown)}")
        pointers = self.weight_table.cpu()
        for name, tensor in weights.items():
            _, dtype, shape = self.weight_specs[index[name]]
            if tensor.dtype != DTYPES[dtype] or tuple(tensor.shape) != shape:
                raise ValueError(f"weight {name!r}: expected {dtype}{list(shape)}, got {tensor.dtype}{list(tensor.shape)}")
            if tensor.device != self.device or not tensor.is_contiguous() or tensor.data_ptr() % 16:
                raise ValueError(f"weight {name!r} must be contiguous, 16-byte aligned, on {self.device}")
            if name.endswith(abi.MXFP4_SCALE_SUFFIX) and tensor.numel():
                _check_mxfp4_scales(name, tensor)
            pointers[index[name]] = tensor.data_ptr()
            self._weights[name] = tensor
        self.weight_table.copy_(pointers)

    def bind_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Bind decode state by name (pointer-table entries after the weights), checked like weights.
        The kernel updates them in place every step."""
        index = {name: i for i, (name, _, _) in enumerate(self.state_specs)}
        unknown = set(states) - set(index)
        if unknown:
            raise KeyError(f"states not in this artifact: {sorted(unknown)}")
        pointers = self.weight_table.cpu()
        for name, tensor in states.items():
            _, dtype, shape = self.state_specs[index[name]]
            if tensor.dtype != DTYPES[dtype] or tuple(tensor.shape) != shape:
                raise ValueError(f"state {name!r}: expected {dtype}{list(shape)}, got {tensor.dtype}{list(tensor.shape)}")
            if tensor.device != self.device or not tensor.is_contiguous() or tensor.data_ptr() % 16:
                raise ValueError(f"state {name!r} must be contiguous, 16-byte aligned, on {self.device}")
            pointers[len(self.weight_specs) + index[name]] = tensor.data_ptr()
            self._states[name] = tensor
        self.weight_table.copy_(pointers)

    def allocate_states(self) -> dict[str, torch.Tensor]:
        """Zero decode state in the manifest's layouts (a fresh sequence), bound and returned."""
        states = {name: torch.zeros(shape, dtype=DTYPES[dtype], device=self.device) for name, dtype, shape in self.state_specs}
        self.bind_states(states)
        return states

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return dict(self._states)

    def bind_comm(self, regions: list[int]) -> None:
        """Tensor-parallel artifacts: the device address of every rank's comm region, in rank order, as
        this process addresses it (peer-mapped; k3mk.runtime.tp binds them)."""
        if self.comm is None or len(regions) != self.comm["ranks"]:
            raise ValueError(f"this artifact takes {self.comm['ranks'] if self.comm else 'no'} comm regions, got {len(regions)}")
        pointers = self.weight_table.cpu()
        pointers[len(self.weight_specs) + len(self.state_specs) :] = torch.tensor(regions, dtype=torch.int64)
        self.weight_table.copy_(pointers)
        self._comm_bound = True

    def missing_weights(self) -> list[str]:
        return [name for name, _, _ in self.weight_specs if name not in self._weights] + [
            name for name, _, _ in self.state_specs if name not in self._states
        ] + ([] if self._comm_bound else ["the comm regions of a tensor-parallel artifact: run it with k3mk.runtime.tp.TPRank"])

    def buffer(self, name: str) -> torch.Tensor:
        """A view of a named arena region, with its dtype and shape."""
        b = self._buffers[name]
        dtype = DTYPES[b["dtype"]]
        count = 1
        for s in b["shape"]:
            count *= s
        nbytes = count * dtype.itemsize
        return self.arena[b["offset"] : b["offset"] + nbytes].view(dtype).view(b["shape"])

    # ---- running ---------------------------------------------------------------------------
    def _packed(self, watchdog_us: int) -> PackedParams:
        if watchdog_us not in self._params:
            values = {
                "lists": self._table_words.data_ptr() + 4 * self.table.lists_offset,
                "tasks": self._table_words.data_ptr() + 4 * self.table.tasks_offset,
                "events": self.events.data_ptr(),
                "control": self.control.data_ptr(),
                "arena": self.arena.data_ptr(),
                "weights": self.weight_table.data_ptr(),
                "debug": self.debug_records.data_ptr(),
                "num_ctas": self.num_ctas,
                "watchdog_us": watchdog_us,
            }
            self._params[watchdog_us] = PackedParams([(p.kind, values[p.name]) for p in abi.PARAMS])
        return self._params[watchdog_us]

    def step(self, watchdog_us: int = DEFAULT_WATCHDOG_US) -> None:
        """Exactly one kernel launch on the current torch stream (graph-capturable)."""
        missing = self.missing_weights()
        if missing:
            raise RuntimeError(f"unbound weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with self.module.current():
            launch_cooperative(self.module.function, self.num_ctas, self.threads, self.smem, stream, self._packed(watchdog_us))

    @property
    def epoch(self) -> int:
        """Completed steps (synchronises)."""
        return int(self.control[abi.C_EPOCH].item())

    def check(self) -> None:
        """Raise WatchdogError if a debug build's watchdog fired (synchronises)."""
        if int(self.control[abi.C_ABORT].item()) == 0:
            return
        raw = self.debug_records.view(self.num_ctas, abi.DEBUG_WORDS).cpu().tolist()
        records = [dict(zip(abi.DEBUG_FIELDS, r), cta=cta) for cta, r in enumerate(raw) if r[0] != 0]
        lines = []
        for r in records:
            where = f"  CTA {r['cta']} (SM {r['smid']})"
            if r["status"] == abi.STATUS_RING_TIMED_OUT:
                lines.append(f"{where} timed out in its streaming ring: {self._ring_barrier(r['event'], r['counter'])} "
                             f"(parity {r['target']}, step {r['epoch']})")  # fmt: skip
                continue
            what = "timed out" if r["status"] == abi.STATUS_TIMED_OUT else "aborted"
            lines.append(
                f"{where} {what} at task {r['task']} '{self.table.label(r['cta'], r['task'])}' "
                f"(opcode {r['opcode']}) waiting on event {r['event']} '{self.table.event_name(r['event'])}': "
                f"counter {r['counter']} < target {r['target']} (step {r['epoch']})"
            )
        raise WatchdogError("megakernel watchdog fired; per-CTA state:\n" + "\n".join(lines), records)

    def _ring_barrier(self, offset: int, index: int) -> str:
        """What a ring watchdog record's barrier (its byte offset in shared memory) hands over."""
        ring = self.manifest["ring"]  # required by the schema
        slots, records, base = ring["slots"], ring["records"], ring["barrier_offset"]
        which = (offset - base) // 8
        kinds = (("the consumers waiting for fill", slots), ("the producer waiting for a free slot for fill", slots),
                 ("the consumers waiting for the record of task", records), ("the producer waiting for the record slot of task", records))  # fmt: skip
        for text, count in kinds:
            if 0 <= which < count:
                return f"{text} {index} (barrier at smem byte {offset})"
            which -= count
        return f"barrier at smem byte {offset}, index {index}"

    def profile_records(self, step: int | None = None) -> torch.Tensor:
        """Profile builds: the per-task records of completed step `step` (1-based; default: the last one)
        as int64 [num_tasks, abi.PROFILE_WORDS] on the CPU, columns abi.PROFILE_FIELDS, row = global task
        index (synchronises). The last abi.PROFILE_RING_STEPS steps are kept. k3mk.runtime.profile turns
        them into a trace and a summary."""
        if self._profile_ring is None:
            raise RuntimeError("not a profile build: compile with `k3mk compile --profile` (KernelConfig(profile=True))")
        done = self.epoch
        step = done if step is None else step
        if not max(done - abi.PROFILE_RING_STEPS, 0) < step <= done:
            raise ValueError(f"step {step} is not among the last {abi.PROFILE_RING_STEPS} completed steps (steps run: {done})")
        records = self._profile_ring[(step - 1) % abi.PROFILE_RING_STEPS].cpu()
        stale = (records[:, abi.PROFILE_FIELDS.index("epoch")] != step).nonzero().flatten().tolist()
        if stale:
            raise RuntimeError(f"{len(stale)} tasks did not finish in step {step} (e.g. global task {stale[0]}): no complete profile")
        return records

    def reset(self) -> None:
        """Zero the event counters, control words, watchdog and profile records (after an aborted step)."""
        self.events.zero_()
        self.control.zero_()
        self._diagnostics.zero_()

    def close(self) -> None:
        self.module.unload()
