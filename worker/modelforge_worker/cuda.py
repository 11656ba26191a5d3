"""A small computation on each GPU through the CUDA driver API (``libcuda.so.1``), via ctypes.

The driver library comes with the NVIDIA driver (the container toolkit injects it), so
nothing beyond the driver is needed: the kernel below is PTX text that the driver
compiles for whatever GPU it finds. Each GPU runs ``y = a*x + y`` over a million
floats, and the answer is checked element by element on the host.
"""

from __future__ import annotations

import ctypes
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

# y[i] = a * x[i] + y[i] for i < n; one thread per element.
SAXPY_PTX = rb"""
.version 6.0
.target sm_50
.address_size 64

.visible .entry saxpy(.param .u32 n, .param .f32 a, .param .u64 x, .param .u64 y)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<8>;

    ld.param.u32 %r1, [n];
    ld.param.f32 %f1, [a];
    ld.param.u64 %rd1, [x];
    ld.param.u64 %rd2, [y];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r5, 4;
    add.s64 %rd6, %rd3, %rd5;
    add.s64 %rd7, %rd4, %rd5;
    ld.global.f32 %f2, [%rd6];
    ld.global.f32 %f3, [%rd7];
    fma.rn.f32 %f3, %f1, %f2, %f3;
    st.global.f32 [%rd7], %f3;
DONE:
    ret;
}
"""  # ctypes.c_char_p ends it with the NUL the driver wants

DEFAULT_ELEMENTS = 1 << 20  # 4 MiB per buffer; below 2**23 the answer is exact
log = logging.getLogger(__name__)
THREADS_PER_BLOCK = 256


class CudaError(Exception):
    """A driver call failed; the message names the call and the driver's error name, and,
    once the device is known, the device (``ordinal``, ``pci_bus_id``)."""

    def __init__(self, message: str, ordinal: int | None = None, pci_bus_id: str = "") -> None:
        super().__init__(message)
        self.message, self.ordinal, self.pci_bus_id = message, ordinal, pci_bus_id

    def on_device(self, ordinal: int, pci_bus_id: str) -> CudaError:
        return CudaError(self.message, ordinal, pci_bus_id)

    def __str__(self) -> str:
        if self.ordinal is None:
            return self.message
        bus = f", PCI {self.pci_bus_id}" if self.pci_bus_id else ""
        return f"CUDA device {self.ordinal}{bus}: {self.message}"


def _release(driver: Driver, calls: list[tuple[str, tuple[Any, ...]]], failing: bool) -> None:
    """Run cleanup calls; a cleanup that fails after an earlier failure is logged, never
    raised (the first error is what the operator needs), else the first one is raised."""
    first: CudaError | None = None
    for name, args in calls:
        try:
            driver(name, *args)
        except CudaError as exc:
            if failing or first is not None:
                log.warning("%s during cleanup after an earlier error: %s", name, exc)
            else:
                first = exc
    if first is not None:
        raise first


@dataclass(frozen=True)
class DeviceResult:
    ordinal: int
    name: str
    pci_bus_id: str
    elements: int
    mismatches: int
    seconds: float

    def view(self) -> dict[str, Any]:
        return {
            "cuda_ordinal": self.ordinal,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "kernel": "saxpy",
            "elements": self.elements,
            "mismatches": self.mismatches,
            "seconds": round(self.seconds, 4),
        }


class Driver:
    """The few driver entry points the check needs, with errors turned into CudaError."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as exc:
            raise CudaError(f"{library} cannot be loaded ({exc}); is the NVIDIA driver "
                            "visible in this container (--gpus)?") from None  # fmt: skip
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def __call__(self, name: str, *args: Any) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(text))
            label = text.value.decode() if text.value else f"error {code}"
            raise CudaError(f"{name} failed: {label}")


def device_count(driver: Driver) -> int:
    driver("cuInit", 0)
    count = ctypes.c_int()
    driver("cuDeviceGetCount", ctypes.byref(count))
    return count.value


def check_device(driver: Driver, ordinal: int, elements: int = DEFAULT_ELEMENTS) -> DeviceResult:
    """Run saxpy on one GPU and compare every element with the exact answer. A failure names
    the device: its CUDA ordinal and, once known, its PCI bus id."""
    began = time.perf_counter()
    bus = ctypes.create_string_buffer(64)
    try:
        device = ctypes.c_int()
        driver("cuDeviceGet", ctypes.byref(device), ordinal)
        driver("cuDeviceGetPCIBusId", bus, 64, device)
        name = ctypes.create_string_buffer(256)
        driver("cuDeviceGetName", name, 256, device)
        context = ctypes.c_void_p()
        driver("cuCtxCreate_v2", ctypes.byref(context), 0, device)
        failing = True
        try:
            mismatches = _saxpy(driver, elements)
            failing = False
        finally:
            _release(driver, [("cuCtxDestroy_v2", (context,))], failing)
    except CudaError as exc:
        raise exc.on_device(ordinal, bus.value.decode(errors="replace")) from None
    return DeviceResult(
        ordinal,
        name.value.decode(errors="replace"),
        bus.value.decode(errors="replace"),
        elements,
        mismatches,
        time.perf_counter() - began,
    )


def _saxpy(driver: Driver, elements: int) -> int:
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    driver("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(SAXPY_PTX))
    size = elements * ctypes.sizeof(ctypes.c_float)
    x_dev, y_dev = ctypes.c_uint64(), ctypes.c_uint64()
    failing = True
    try:
        driver("cuModuleGetFunction", ctypes.byref(function), module, b"saxpy")
        driver("cuMemAlloc_v2", ctypes.byref(x_dev), ctypes.c_size_t(size))
        driver("cuMemAlloc_v2", ctypes.byref(y_dev), ctypes.c_size_t(size))
        # Exactly representable: x = i, y = 1, a = 2, so y' = 2i + 1 for every i < 2**23.
        x_host = (ctypes.c_float * elements).from_buffer(array("f", range(elements)))
        y_host = (ctypes.c_float * elements).from_buffer(array("f", [1.0]) * elements)
        driver("cuMemcpyHtoD_v2", x_dev, x_host, ctypes.c_size_t(size))
        driver("cuMemcpyHtoD_v2", y_dev, y_host, ctypes.c_size_t(size))
        n, a = ctypes.c_uint32(elements), ctypes.c_float(2.0)
        params = (ctypes.c_void_p * 4)(
            *(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in (n, a, x_dev, y_dev))
        )
        blocks = (elements + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
        driver(
            "cuLaunchKernel", function, blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, None, params, None
        )
        driver("cuCtxSynchronize")
        result = array("f", [0.0]) * elements
        driver(
            "cuMemcpyDtoH_v2",
            (ctypes.c_float * elements).from_buffer(result),
            y_dev,
            ctypes.c_size_t(size),
        )
        failing = False
    finally:
        cleanup = [("cuMemFree_v2", (pointer,)) for pointer in (x_dev, y_dev) if pointer.value]
        if module.value:
            cleanup.append(("cuModuleUnload", (module,)))
        _release(driver, cleanup, failing)
    expected = array("f", range(1, 2 * elements, 2))
    if result == expected:
        return 0
    return sum(1 for got, want in zip(result, expected, strict=True) if got != want)
