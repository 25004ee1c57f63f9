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


class Module:
    """A cubin loaded into the device's primary context (the one torch uses)."""

    def __init__(self, cubin: bytes, kernel_name: str, device_index: int, dynamic_smem: int):
        check(driver.cuInit(0))
        self.device = check(driver.cuDeviceGet(device_index))
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.device))
        self._cubin = cubin  # keep alive while loading
        with self.current():
            self.module = check(driver.cuModuleLoadData(cubin))
            try:
                self.function = check(driver.cuModuleGetFunction(self.module, kernel_name.encode()))
            except CudaError as e:
                raise CudaError(f"kernel {kernel_name!r} not found in the cubin: {e}") from None
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(self.function, attr, dynamic_smem))

    @contextlib.contextmanager
    def current(self):
        """This module's context current for the block, the caller's restored after it: a launch on another
        GPU (a tensor-parallel rank) must not move torch's current device. A thread with no current context
        keeps this one (unbinding it would leave later driver calls with none)."""
        caller = check(driver.cuCtxGetCurrent())
        check(driver.cuCtxSetCurrent(self.context))
        try:
            yield
        finally:
            if int(caller) != 0:
                check(driver.cuCtxSetCurrent(caller))

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


def enable_peer_access(devices: list[int]) -> None:
    """Let each device's primary context read and write every other's memory (the collectives of a
    tensor-parallel artifact store into the other ranks' comm regions and add to their counters with
    system-scope atomics). Already enabled is fine; a pair of devices without a peer path or without
    native peer atomics (PCIe usually) is an error naming them. The caller's current context (torch's
    current device) is restored: each device's context is made current only to enable its peers."""
    check(driver.cuInit(0))
    caller = check(driver.cuCtxGetCurrent())
    handles = {d: check(driver.cuDeviceGet(d)) for d in devices}
    contexts = {d: check(driver.cuDevicePrimaryCtxRetain(handles[d])) for d in devices}
    try:
        for d in devices:
            check(driver.cuCtxSetCurrent(contexts[d]))
            for peer in devices:
                if peer == d:
                    continue
                if not check(driver.cuDeviceCanAccessPeer(handles[d], handles[peer])):
                    raise CudaError(f"GPU {d} cannot access GPU {peer}'s memory (no NVLink / PCIe peer path): tensor parallelism needs one")
                atomics = driver.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
                if not check(driver.cuDeviceGetP2PAttribute(atomics, handles[d], handles[peer])):
                    raise CudaError(f"GPU {d} has no native atomics on GPU {peer}'s memory: the collectives' counters need them (NVLink)")
                result = driver.cuCtxEnablePeerAccess(contexts[peer], 0)
                if (result[0] if isinstance(result, tuple) else result) != driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                    check(result)
    finally:
        if int(caller) != 0:
            driver.cuCtxSetCurrent(caller)
        for d in devices:
            driver.cuDevicePrimaryCtxRelease(handles[d])
