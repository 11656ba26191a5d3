"""``smoke``: prove the node can do work, and say exactly what was checked.

On every node: the CPUs the worker may use, the memory available, and an integer matrix
product whose checksum is verified against an independent formula. On an NVIDIA node
also: every GPU answers NVML (name, UUID, PCI bus, memory, temperature, utilisation), and
every GPU runs a kernel through the CUDA driver whose output is checked element by element.
This is what the node-loss runbook's "capability smoke" runs (docs/runbooks/node-loss.md).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from modelforge_contract import SMOKE_FAILED, WORK_INPUT_INVALID

from .. import cuda
from . import CapabilityFailure, Outcome, RunContext, succeeded

DEFAULT_MATRIX_SIZE = 64
_NVML_LOCK = threading.Lock()  # NVML init/shutdown is process-wide


def run(given: dict[str, Any], context: RunContext) -> Outcome:
    size = given.get("matrix_size", DEFAULT_MATRIX_SIZE)
    unknown = set(given) - {"matrix_size"}
    if unknown or isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= 512:
        raise CapabilityFailure(WORK_INPUT_INVALID, 'smoke takes only {"matrix_size": 2..512}')
    checked: list[str] = []
    log: list[str] = []
    cpu = cpu_facts()
    checked.append(
        f"cpu: {cpu['usable_cpus']} usable of {cpu['logical_cpus']} logical CPUs, "
        f"{cpu['memory_available_bytes'] or 'unknown'} bytes of memory available"
    )
    computation = matrix_check(size, context)
    checked.append(
        f"computation: {size}x{size} integer matrix product, checksum {computation['checksum']} "
        "verified"
    )
    log.append(checked[-1])
    result: dict[str, Any] = {
        "mode": context.accelerator_mode,
        "cpu": cpu,
        "computation": computation,
    }
    if context.accelerator_mode == "nvidia":
        gpus = nvml_check()
        for gpu in gpus:
            checked.append(
                f"nvml: GPU {gpu['index']} {gpu['name']} ({gpu['uuid']}, {gpu['pci_bus_id']}) "
                f"answered; {gpu['memory_used_bytes']} of {gpu['memory_total_bytes']} bytes used"
            )
        context.check_time()
        for gpu, run in cuda_check(gpus):
            gpu["compute"] = run
            checked.append(
                f"cuda: saxpy over {run['elements']} floats exact on GPU {gpu['index']} "
                f"(CUDA device {run['cuda_ordinal']})"
            )
        result["gpus"] = gpus
        log += checked[-2 * len(gpus) :]
    result["checked"] = checked
    return succeeded(result, "\n".join(log) + "\n")


def cpu_facts() -> dict[str, Any]:
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "logical_cpus": os.cpu_count() or 0,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "memory_available_bytes": available,
    }


def matrix_check(size: int, context: RunContext) -> dict[str, Any]:
    """C = A·B in plain integers; sum(C) must equal Σ_k colsum(A)[k]·rowsum(B)[k]."""
    began = time.perf_counter()
    a = [[(i + 2 * j) % 97 + 1 for j in range(size)] for i in range(size)]
    b = [[(3 * i + j) % 89 + 1 for j in range(size)] for i in range(size)]
    columns_of_b = list(zip(*b, strict=True))
    total = 0
    for row in a:
        context.check_time()
        total += sum(
            sum(x * y for x, y in zip(row, column, strict=True)) for column in columns_of_b
        )
    expected = sum(sum(a[i][k] for i in range(size)) * sum(b[k]) for k in range(size))
    if total != expected:
        raise CapabilityFailure(
            SMOKE_FAILED,
            f"the CPU computed checksum {total} for the {size}x{size} product, expected {expected}",
        )
    return {
        "kind": "integer matrix product",
        "matrix_size": size,
        "checksum": total,
        "verified": True,
        "seconds": round(time.perf_counter() - began, 4),
    }


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def nvml_check() -> list[dict[str, Any]]:
    """Every GPU as NVML reports it; SMOKE_FAILED when NVML or a GPU does not answer."""
    try:
        import pynvml
    except ImportError:
        raise CapabilityFailure(
            SMOKE_FAILED, "the NVML bindings (nvidia-ml-py) are missing"
        ) from None
    with _NVML_LOCK:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise CapabilityFailure(SMOKE_FAILED, f"NVML could not be initialised: {exc}") from None
        failing = True
        try:
            gpus = _read_gpus(pynvml)
            failing = False
            return gpus
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                if not failing:  # never in place of the error that is already on its way
                    raise CapabilityFailure(
                        SMOKE_FAILED, f"NVML could not be shut down: {exc}"
                    ) from None


def _nvml_failure(gpu: dict[str, Any], call: str, exc: Exception) -> CapabilityFailure:
    return CapabilityFailure(SMOKE_FAILED, f"NVML query failed for {gpu_label(gpu)}: {call}: {exc}")


def gpu_label(gpu: dict[str, Any], cuda_ordinal: int | None = None) -> str:
    """``GPU 5 (UUID GPU-…, PCI 00000000:1B:00.0, CUDA device 5)``: every name an operator
    may look the GPU up by (nvidia-smi's index, its UUID, its slot, CUDA's ordinal)."""
    parts = [f"UUID {gpu['uuid']}" if gpu.get("uuid") else "UUID unknown"]
    parts.append(f"PCI {gpu['pci_bus_id']}" if gpu.get("pci_bus_id") else "PCI unknown")
    if cuda_ordinal is not None:
        parts.append(f"CUDA device {cuda_ordinal}")
    return f"GPU {gpu['index']} ({', '.join(parts)})"


def _read_gpus(nvml: Any) -> list[dict[str, Any]]:
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        raise CapabilityFailure(
            SMOKE_FAILED, f"NVML query failed: nvmlDeviceGetCount: {exc}"
        ) from None
    if count < 1:
        raise CapabilityFailure(SMOKE_FAILED, "NVML reports 0 GPUs on an NVIDIA node")
    return [_read_gpu(nvml, index) for index in range(count)]


# A GPU as the smoke result reports it, in this order.
_GPU_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci_bus_id",
    "memory_total_bytes",
    "memory_used_bytes",
    "temperature_c",
    "utilization_gpu_percent",
)


def _read_gpu(nvml: Any, index: int) -> dict[str, Any]:
    """One GPU; a failing NVML call is named with the GPU's index, UUID and PCI bus id
    (as much of them as NVML still gave): every read is tried once, the first failure is
    raised after the others filled in the label."""
    gpu: dict[str, Any] = {"index": index}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as exc:
        raise _nvml_failure(gpu, "nvmlDeviceGetHandleByIndex", exc) from None
    first: tuple[str, Exception] | None = None
    for key, call, read in (
        (
            "pci_bus_id",
            "nvmlDeviceGetPciInfo",
            lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        ),
        ("uuid", "nvmlDeviceGetUUID", lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        ("name", "nvmlDeviceGetName", lambda: _text(nvml.nvmlDeviceGetName(handle))),
        ("memory", "nvmlDeviceGetMemoryInfo", lambda: nvml.nvmlDeviceGetMemoryInfo(handle)),
    ):
        try:
            gpu[key] = read()
        except nvml.NVMLError as exc:
            first = first or (call, exc)
    if first is not None:
        raise _nvml_failure(gpu, *first) from None
    memory = gpu.pop("memory")
    gpu["memory_total_bytes"], gpu["memory_used_bytes"] = int(memory.total), int(memory.used)
    for key, read_value in (
        (
            "temperature_c",
            lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
        ),
        ("utilization_gpu_percent", lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
    ):
        try:
            gpu[key] = int(read_value(handle))
        except nvml.NVMLError_NotSupported:
            gpu[key] = None  # not reported by this GPU (MIG, some boards): never invented
        except nvml.NVMLError as exc:
            raise _nvml_failure(gpu, key, exc) from None
    return {key: gpu[key] for key in _GPU_FIELDS}


def _bus_key(bus_id: str) -> tuple[int, str]:
    """NVML writes 00000000:18:00.0, CUDA 0000:18:00.0: compare domain as a number."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return int(domain or "0", 16), rest


def cuda_check(gpus: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run the kernel on every CUDA device and pair each with its NVML GPU by PCI bus; a
    failure names the GPU by NVML index, UUID, PCI bus id and CUDA ordinal."""
    by_bus = {_bus_key(gpu["pci_bus_id"]): gpu for gpu in gpus}
    try:
        driver = cuda.Driver()
        count = cuda.device_count(driver)
        if count != len(gpus):
            raise cuda.CudaError(f"CUDA sees {count} GPU(s) where NVML lists {len(gpus)}")
        runs = [cuda.check_device(driver, ordinal) for ordinal in range(count)]
    except cuda.CudaError as exc:
        gpu = by_bus.get(_bus_key(exc.pci_bus_id)) if exc.pci_bus_id else None
        if gpu is not None:
            where = gpu_label(gpu, exc.ordinal)
        elif exc.ordinal is not None:
            where = f"CUDA device {exc.ordinal}" + (
                f" (PCI {exc.pci_bus_id})" if exc.pci_bus_id else ""
            )
        else:
            where = "the GPUs"
        raise CapabilityFailure(
            SMOKE_FAILED, f"the GPU computation failed on {where}: {exc.message}"
        ) from None
    paired = []
    for run in runs:
        gpu = by_bus.get(_bus_key(run.pci_bus_id))
        if gpu is None:
            raise CapabilityFailure(
                SMOKE_FAILED,
                f"CUDA device {run.ordinal} ({run.pci_bus_id}) is not a GPU NVML lists",
            )
        if run.mismatches:
            raise CapabilityFailure(
                SMOKE_FAILED,
                f"{gpu_label(gpu, run.ordinal)} computed {run.mismatches} of {run.elements} "
                "elements wrong",
            )
        paired.append((gpu, run.view()))
    return sorted(paired, key=lambda pair: pair[0]["index"])
