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
        try:
            return _read_gpus(pynvml)
        except pynvml.NVMLError as exc:
            raise CapabilityFailure(SMOKE_FAILED, f"NVML query failed: {exc}") from None
        finally:
            pynvml.nvmlShutdown()


def _read_gpus(nvml: Any) -> list[dict[str, Any]]:
    count = nvml.nvmlDeviceGetCount()
    if count < 1:
        raise CapabilityFailure(SMOKE_FAILED, "NVML reports 0 GPUs on an NVIDIA node")
    gpus = []
    for index in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpu = {
            "index": index,
            "name": _text(nvml.nvmlDeviceGetName(handle)),
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(handle).busId),
            "memory_total_bytes": int(memory.total),
            "memory_used_bytes": int(memory.used),
        }
        for key, call in (
            (
                "temperature_c",
                lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            ),
            ("utilization_gpu_percent", lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
        ):
            try:
                gpu[key] = int(call(handle))
            except nvml.NVMLError_NotSupported:
                gpu[key] = None  # not reported by this GPU (MIG, some boards): never invented
        gpus.append(gpu)
    return gpus


def _bus_key(bus_id: str) -> tuple[int, str]:
    """NVML writes 00000000:18:00.0, CUDA 0000:18:00.0: compare domain as a number."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return int(domain or "0", 16), rest


def cuda_check(gpus: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run the kernel on every CUDA device and pair each with its NVML GPU by PCI bus."""
    try:
        driver = cuda.Driver()
        count = cuda.device_count(driver)
        if count != len(gpus):
            raise cuda.CudaError(f"CUDA sees {count} GPU(s) where NVML lists {len(gpus)}")
        runs = [cuda.check_device(driver, ordinal) for ordinal in range(count)]
    except cuda.CudaError as exc:
        raise CapabilityFailure(SMOKE_FAILED, f"the GPU computation failed: {exc}") from None
    by_bus = {_bus_key(gpu["pci_bus_id"]): gpu for gpu in gpus}
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
                f"GPU {gpu['index']} computed {run.mismatches} of {run.elements} elements wrong",
            )
        paired.append((gpu, run.view()))
    return sorted(paired, key=lambda pair: pair[0]["index"])
