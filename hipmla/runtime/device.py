"""Devices: how many, which one is current on this thread, and what each one is.

:func:`device_info` reads a device's properties once per process (:class:`DeviceInfo`,
what plans and launch shapes are made from); :func:`use_device` is the hot path's
"make this device current", one attribute read when hipmla already did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hipmla import runtime  # the process's runtime state: runtime.hip, the current device
from hipmla.runtime.library import RuntimeUnavailable, _ensure_runtime, check, platform

_HIP_ERROR_NO_DEVICE = 100


def available() -> bool:
    """True if a HIP device can be used. Never raises."""
    try:
        return device_count() > 0
    except Exception:
        return False


def device_count() -> int:
    _ensure_runtime()
    status, count = runtime.hip.hipGetDeviceCount()
    if int(status) == _HIP_ERROR_NO_DEVICE:
        return 0
    check((status,))
    return int(count)


def _check_device_index(index, name: str = "index") -> int:
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"{name}: expected a device index (int), got {type(index).__name__}")
    count = device_count()
    if not 0 <= index < count:
        raise ValueError(f"{name}: expected a device index in [0, {count}), got {index}")
    return int(index)


def set_device(index: int) -> None:
    """Make device ``index`` current for this host thread."""
    index = _check_device_index(index)  # initialises the runtime: binds ``hip``
    check(runtime.hip.hipSetDevice(index))
    runtime._thread.device = index


def use_device(index: int) -> None:
    """Make ``index`` current for this thread unless hipmla already did: one attribute
    read on the hot path instead of a HIP call."""
    if runtime._thread.device != index:
        set_device(index)


def synchronize() -> None:
    """Wait for all work on the current device."""
    _ensure_runtime()
    check(runtime.hip.hipDeviceSynchronize())


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    arch: str  # "gfx950", "gfx942", "sm_90": what --offload-arch takes
    arch_full: str  # with target features, e.g. "gfx950:sramecc+:xnack-"
    platform: str  # "amd" | "nvidia"
    num_cus: int  # compute units (AMD) / streaming multiprocessors (NVIDIA)
    warp_size: int
    max_shared_per_block: int  # bytes a block gets without opting in
    shared_optin: int  # bytes a block can get at most
    total_mem: int
    l2_bytes: int
    mem_clock_khz: int
    mem_bus_bits: int
    pci_bus_id: int
    #: Theoretical DDR peak 2 * clock * bus / 8 from the reported attributes, in GB/s.
    #: Vendors report memory clocks differently (HBM3 often as half the data rate),
    #: so rooflines should prefer a measured or datasheet number.
    peak_bandwidth_gbs: float


def split_arch(arch_full: str) -> str:
    """Offload arch without target features: ``"gfx950:sramecc+:xnack-"`` -> ``"gfx950"``."""
    return arch_full.split(":", 1)[0].strip()


def peak_bandwidth_gbs(mem_clock_khz: int, mem_bus_bits: int) -> float:
    return 2.0 * mem_clock_khz * 1e3 * mem_bus_bits / 8 / 1e9


def device_info(index: int = 0) -> DeviceInfo:
    """Properties of device ``index`` (cached); also makes it the current device."""
    set_device(index)
    index = int(index)
    info = runtime._device_infos.get(index)
    if info is not None:
        return info
    props = check(runtime.hip.hipGetDeviceProperties(index))
    names = runtime.hip.hipDeviceAttribute_t

    def attr(attribute) -> int:
        return int(check(runtime.hip.hipDeviceGetAttribute(attribute, index)))

    selected = platform()
    arch_full = str(props.gcnArchName).strip()
    if not arch_full and selected == "nvidia":
        major = attr(names.hipDeviceAttributeComputeCapabilityMajor)
        minor = attr(names.hipDeviceAttributeComputeCapabilityMinor)
        arch_full = f"sm_{major}{minor}"
    if not arch_full:
        raise RuntimeUnavailable(f"device {index} reports no architecture name (gcnArchName)")
    max_shared = attr(names.hipDeviceAttributeMaxSharedMemoryPerBlock)
    clock_khz = attr(names.hipDeviceAttributeMemoryClockRate)
    bus_bits = attr(names.hipDeviceAttributeMemoryBusWidth)
    info = DeviceInfo(
        index=index,
        name=str(props.name).strip(),
        arch=split_arch(arch_full),
        arch_full=arch_full,
        platform=selected,
        num_cus=attr(names.hipDeviceAttributeMultiprocessorCount),
        warp_size=attr(names.hipDeviceAttributeWarpSize),
        max_shared_per_block=max_shared,
        # Some runtimes report 0 when there is nothing to opt into.
        shared_optin=max(attr(names.hipDeviceAttributeSharedMemPerBlockOptin), max_shared),
        total_mem=int(props.totalGlobalMem),
        l2_bytes=attr(names.hipDeviceAttributeL2CacheSize),
        mem_clock_khz=clock_khz,
        mem_bus_bits=bus_bits,
        pci_bus_id=int(props.pciBusID),
        peak_bandwidth_gbs=peak_bandwidth_gbs(clock_khz, bus_bits),
    )
    runtime._device_infos[index] = info
    return info


def memory_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    _ensure_runtime()
    free, total = check(runtime.hip.hipMemGetInfo())
    return int(free), int(total)


def versions() -> dict[str, int]:
    """HIP driver and runtime version numbers, for reports."""
    _ensure_runtime()
    return {
        "driver": int(check(runtime.hip.hipDriverGetVersion())),
        "runtime": int(check(runtime.hip.hipRuntimeGetVersion())),
    }
