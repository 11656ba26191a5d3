"""The test NVML library and the recorded GPU hosts it impersonates.

The JSON files under ``tests/agent/fixtures/`` are the source of truth. ``write_nvml_config``
turns one into the line format tests/nvml/fake_nvml.c reads, resolving NVML
error names (``NVML_ERROR_NOT_SUPPORTED``) through the real pynvml constants.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pynvml

FIXTURES = Path(__file__).parents[1] / "agent" / "fixtures"
NVML_SOURCE = Path(__file__).parents[1] / "nvml" / "fake_nvml.c"
CUDA_SOURCE = Path(__file__).parents[1] / "nvml" / "fake_cuda.c"


def load_host(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def consumer_rtx_4090() -> dict[str, Any]:
    """One GeForce RTX 4090: no MIG, every telemetry value supported."""
    return load_host("consumer_rtx_4090")


def h100_80g_x8() -> dict[str, Any]:
    """An HGX H100 server: eight 80 GB GPUs, MIG capable and disabled."""
    return load_host("h100_80g_x8")


def a100_mig() -> dict[str, Any]:
    """Two A100 40 GB, GPU 0 in MIG mode, where NVML reports no whole-GPU utilization."""
    return load_host("a100_mig")


def without_devices(host: dict[str, Any]) -> dict[str, Any]:
    """The same driver with no GPU visible (a container started without --gpus)."""
    return {**copy.deepcopy(host), "devices": []}


def with_failure(
    host: dict[str, Any], call: str, error: str, device: int | None = None
) -> dict[str, Any]:
    """``call`` answers ``error`` (an NVML_ERROR_* name) everywhere or for one GPU."""
    host = copy.deepcopy(host)
    target = host if device is None else host["devices"][device]
    target.setdefault("failures", {})[call] = error
    return host


def _error_code(name: str) -> int:
    code = getattr(pynvml, name)
    assert isinstance(code, int) and name.startswith("NVML_ERROR_"), name
    return code


def nvml_config_lines(host: dict[str, Any]) -> list[str]:
    lines = [f"driver_version {host['driver_version']}"]
    if host.get("cuda_driver_version") is not None:
        lines.append(f"cuda_version {host['cuda_driver_version']}")
    lines += [f"fail {call} {_error_code(err)}" for call, err in host.get("failures", {}).items()]
    for gpu in host["devices"]:
        pci = gpu["pci"]
        values = {
            "name": gpu["name"],
            "uuid": gpu["uuid"],
            "pci_bus_id": pci["bus_id"],
            "pci_domain": pci["domain"],
            "pci_bus": pci["bus"],
            "pci_device": pci["device"],
            "pci_device_id": int(pci["device_id"], 16),
            "pci_subsystem_id": int(pci["subsystem_id"], 16),
            "memory_total": gpu["memory"]["total_bytes"],
            "memory_used": gpu["memory"]["used_bytes"],
            "temperature": gpu.get("temperature_c"),
            "power_mw": gpu.get("power_mw"),
            "power_limit_mw": gpu.get("power_limit_mw"),
            "clock_sm": (gpu.get("clocks_mhz") or {}).get("sm"),
            "clock_mem": (gpu.get("clocks_mhz") or {}).get("memory"),
            "mig": {None: None, "enabled": 1, "disabled": 0}[gpu.get("mig_mode")],
        }
        if gpu.get("utilization") is not None:
            values["util_gpu"] = gpu["utilization"]["gpu"]
            values["util_memory"] = gpu["utilization"]["memory"]
        lines.append("device")
        lines += [f"{key} {value}" for key, value in values.items() if value is not None]
        lines += [
            f"fail {call} {_error_code(err)}" for call, err in gpu.get("failures", {}).items()
        ]
        # The CUDA driver twin (tests/nvml/fake_cuda.c): raw CUresult codes, and a wrong sum.
        lines += [f"fail {call} {code}" for call, code in gpu.get("cuda_failures", {}).items()]
        if gpu.get("cuda_miscompute"):
            lines.append("cuda_miscompute 1")
    return lines


def write_nvml_config(host: dict[str, Any], path: Path) -> Path:
    path.write_text("\n".join(nvml_config_lines(host)) + "\n")
    return path
