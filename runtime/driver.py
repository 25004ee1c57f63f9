"""The few CUDA driver calls the runtime makes (cuda-bindings), each checked."""

from __future__ import annotations

import contextlib
import ctypes

from cuda.bindings import driver


class CudaError(RuntimeError):
    pass


def check(result):
    """Unwrap a cuda-bindings result tuple, raising on any error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise CudaError(f"{err.name}: {msg.decode() if msg else ''}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


@contextlib.contextmanager
def current_context(context):
    """`context` current for the block, the caller's restored after it: work on another GPU (a module of
    another device, a peer's comm region) must not move torch's current device. A thread with no current
    context keeps this one (unbinding it would leave later driver calls with none)."""
    caller = check(driver.cuCtxGetCurrent())
    check(driver.cuCtxSetCurrent(context))
    try:
        yield
    finally:
        if int(caller) != 0:
            check(driver.cuCtxSetCurrent(caller))


def primary_context(device_index: int):
    """(device, primary context) of a GPU, retained (the context torch uses): release it with
    cuDevicePrimaryCtxRelease(device)."""
    check(driver.cuInit(0))
    device = check(driver.cuDeviceGet(device_index))
    return device, check(driver.cuDevicePrimaryCtxRetain(device))


class Module:
    """A cubin loaded into the device's primary context (the one torch uses)."""

    def __init__(self, cubin: bytes, kernel_name: str, device_index: int, dynamic_smem: int):
        self.device, self.context = primary_context(device_index)
        self._cubin = cubin  # keep alive while loading
        with self.current():
            self.module = check(driver.cuModuleLoadData(cubin))
            try:
                self.function = check(driver.cuModuleGetFunction(self.module, kernel_name.encode()))
            except CudaError as e:
                raise CudaError(f"kernel {kernel_name!r} not found in the cubin: {e}") from None
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(self.function, attr, dynamic_smem))

    def current(self):
        """This module's context current for the block (`current_context`)."""
        return current_context(self.context)

    def max_blocks_per_sm(self, threads: int, dynamic_smem: int) -> int:
        with self.current():
            return check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, threads, dynamic_smem))

    def unload(self) -> None:
        if getattr(self, "module", None) is not None:
            driver.cuModuleUnload(self.module)
            self.module = None
            driver.cuDevicePrimaryCtxRelease(self.device)


class PackedParams:
    """Kernel parameters packed once (ctypes values + the void*[] the driver reads)."""

    def __init__(self, values: list[tuple[str, int]]):
        self._values = [ctypes.c_uint64(v) if kind == "ptr" else ctypes.c_int32(v) for kind, v in values]
        self._array = (ctypes.c_void_p * len(self._values))(*[ctypes.addressof(v) for v in self._values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self._array)


def launch_cooperative(function, grid: int, threads: int, dynamic_smem: int, stream: int, params: PackedParams) -> None:
    """cuLaunchKernelEx with the cooperative attribute: all `grid` CTAs co-resident or an error
    (never a silent deadlock); capturable in a CUDA graph."""
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = dynamic_smem
    config.hStream = driver.CUstream(stream)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    attr.value.cooperative = 1
    config.attrs = [attr]
    config.numAttrs = 1
    check(driver.cuLaunchKernelEx(config, function, params.address, 0))


def check_peer_path(device_index: int, peer_index: int) -> None:
    """GPU `device_index` can store into GPU `peer_index`'s memory with native atomics (the collectives
    of a tensor-parallel artifact push into every rank's comm region and add to its counters with
    system-scope atomics); otherwise an error naming both (PCIe peers usually lack the atomics)."""
    if peer_index == device_index:
        return
    check(driver.cuInit(0))
    device, peer = check(driver.cuDeviceGet(device_index)), check(driver.cuDeviceGet(peer_index))
    if not check(driver.cuDeviceCanAccessPeer(device, peer)):
        raise CudaError(f"GPU {device_index} cannot access GPU {peer_index}'s memory (no NVLink / PCIe peer path): tensor parallelism needs one")
    atomics = driver.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
    if not check(driver.cuDeviceGetP2PAttribute(atomics, device, peer)):
        raise CudaError(f"GPU {device_index} has no native atomics on GPU {peer_index}'s memory: the collectives' counters need them (NVLink)")
