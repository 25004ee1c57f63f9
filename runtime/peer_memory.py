"""Device memory that the other processes of a tensor-parallel group map: each rank's comm region
(docs/task_table.md "Tensor parallelism"), allocated from the CUDA driver, never from torch's caching
allocator (its expandable segments cannot be exported through CUDA IPC: SERVING.md), and exported as a
handle of bytes that every other rank opens.

    memory = CudaIpcMemory(device_index)       # or FabricMemory(device_index): same interface
    region = memory.allocate(nbytes)           # zeroed; region.address, region.handle (bytes)
    address = memory.open(peer_handle, nbytes, peer_gpu)   # another rank's region as this process sees it
    memory.close_peers(); memory.free()        # every rank closes the peers' regions before anyone frees

Two implementations of `PeerMemory`:
- `CudaIpcMemory`: cuMemAlloc + cuIpcGetMemHandle / cuIpcOpenMemHandle (peer access enabled lazily):
  GPUs of one host (H200 over NVLink). Every rank's GPU must be visible to every process (no
  per-process CUDA_VISIBLE_DEVICES), so the peer path and its native atomics can be checked.
- `FabricMemory`: the VMM API with fabric handles (cuMemCreate, cuMemExportToShareableHandle /
  cuMemImportFromShareableHandle, cuMemMap, cuMemSetAccess), which reach across the hosts of one NVLink
  domain (GB200 / GB300 NVL72, with an IMEX channel). Not run yet: no machine here has a fabric.
NVLink multicast is never used (DESIGN.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from cuda.bindings import driver

from k3mk.runtime.driver import CudaError, check, check_peer_path, current_context, primary_context

IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE; also the size of a CUmemFabricHandle


@dataclass(frozen=True)
class Region:
    address: int  # as this process addresses it
    nbytes: int
    handle: bytes  # what another process opens


class PeerMemory:
    """Allocate this rank's region, open the other ranks' (module docstring). `gpu` names this rank's
    device to the others (its PCI bus id)."""

    kind = ""

    def __init__(self, device_index: int):
        self.device_index = device_index
        self.device, self.context = primary_context(device_index)
        self.gpu = check(driver.cuDeviceGetPCIBusId(32, self.device)).split(b"\0")[0].decode()
        self._allocated: list = []
        self._opened: list = []

    def allocate(self, nbytes: int) -> Region:
        raise NotImplementedError

    def open(self, handle: bytes, nbytes: int, peer_gpu: str) -> int:
        """Another rank's region (`handle` from its `allocate`, on the GPU with PCI bus id `peer_gpu`)."""
        raise NotImplementedError

    def close_peers(self) -> None:
        raise NotImplementedError

    def free(self) -> None:
        raise NotImplementedError

    def _zero(self, address: int, nbytes: int) -> None:
        """Zeroed before the handle leaves this process: a peer may push into it right after setup."""
        check(driver.cuMemsetD8(address, 0, nbytes))
        check(driver.cuCtxSynchronize())

    def close(self) -> None:
        self.close_peers()
        self.free()
        check(driver.cuDevicePrimaryCtxRelease(self.device))


class CudaIpcMemory(PeerMemory):
    kind = "cuda_ipc"

    def allocate(self, nbytes: int) -> Region:
        with current_context(self.context):
            address = int(check(driver.cuMemAlloc(nbytes)))
            self._allocated.append(address)
            self._zero(address, nbytes)
            handle = check(driver.cuIpcGetMemHandle(address))
        # cuda-bindings 13 exposes the handle's 64 bytes only through its address
        return Region(address, nbytes, ctypes.string_at(int(handle.getPtr()), IPC_HANDLE_BYTES))

    def open(self, handle: bytes, nbytes: int, peer_gpu: str) -> int:
        with current_context(self.context):
            try:
                peer_index = int(check(driver.cuDeviceGetByPCIBusId(peer_gpu.encode())))
            except CudaError:
                raise CudaError(f"the GPU {peer_gpu} is not visible to this process: every rank's GPU must be (CUDA_VISIBLE_DEVICES)") from None
            check_peer_path(self.device_index, peer_index)
            ipc = driver.CUipcMemHandle()
            ctypes.memmove(int(ipc.getPtr()), handle, IPC_HANDLE_BYTES)
            address = int(check(driver.cuIpcOpenMemHandle(ipc, int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))))
        self._opened.append(address)
        return address

    def close_peers(self) -> None:
        with current_context(self.context):
            while self._opened:
                check(driver.cuIpcCloseMemHandle(self._opened.pop()))

    def free(self) -> None:
        with current_context(self.context):
            while self._allocated:
                check(driver.cuMemFree(self._allocated.pop()))


class FabricMemory(PeerMemory):
    kind = "fabric"

    def __init__(self, device_index: int):
        super().__init__(device_index)
        self.location = driver.CUmemLocation()
        self.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.location.id = device_index
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = self.location
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        self.prop = prop
        granularity = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(check(driver.cuMemGetAllocationGranularity(prop, granularity)))

    def _map(self, handle, nbytes: int) -> tuple[int, int]:
        """Reserve an address range, map `handle` there, read-write for this GPU: (address, mapped size)."""
        size = -(-nbytes // self.granularity) * self.granularity
        address = int(check(driver.cuMemAddressReserve(size, self.granularity, 0, 0)))
        check(driver.cuMemMap(address, size, 0, handle, 0))
        access = driver.CUmemAccessDesc()
        access.location = self.location
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(driver.cuMemSetAccess(address, size, [access], 1))
        return address, size

    def allocate(self, nbytes: int) -> Region:
        with current_context(self.context):
            size = -(-nbytes // self.granularity) * self.granularity
            handle = check(driver.cuMemCreate(size, self.prop, 0))
            address, size = self._map(handle, nbytes)
            self._allocated.append((address, size, handle))
            self._zero(address, nbytes)
            fabric = check(driver.cuMemExportToShareableHandle(handle, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC, 0))
        return Region(address, nbytes, bytes(fabric.data))

    def open(self, handle: bytes, nbytes: int, peer_gpu: str) -> int:
        with current_context(self.context):
            fabric = driver.CUmemFabricHandle()
            fabric.data = handle
            imported = check(driver.cuMemImportFromShareableHandle(fabric.getPtr(), driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC))
            address, size = self._map(imported, nbytes)
        self._opened.append((address, size, imported))
        return address

    def _unmap(self, regions: list) -> None:
        """`regions`: (address, mapped size, generic handle) of allocated or opened regions."""
        with current_context(self.context):
            while regions:
                address, size, handle = regions.pop()
                check(driver.cuMemUnmap(address, size))
                check(driver.cuMemAddressFree(address, size))
                check(driver.cuMemRelease(handle))

    def close_peers(self) -> None:
        self._unmap(self._opened)

    def free(self) -> None:
        self._unmap(self._allocated)


MEMORY_KINDS = {cls.kind: cls for cls in (CudaIpcMemory, FabricMemory)}
