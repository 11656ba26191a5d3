"""NVIDIA inventory and telemetry through NVML (the nvidia-ml-py bindings), failing closed.

Invariant 9: in ``nvidia`` mode the preflight needs NVML, at least
one GPU and telemetry that matches the inventory, or the agent exits 3 with
exactly one code word. Every value published comes from NVML; a field NVML
reports as unsupported is left out (or null where the contract requires the
key), never filled in. ``pynvml`` is imported only here and only when a GPU is
expected, so ``cpu`` mode never loads the library.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import runtime
from .settings import AgentSettings

log = logging.getLogger(__name__)

NVIDIA_NVML_UNAVAILABLE = "NVIDIA_NVML_UNAVAILABLE"
NVIDIA_DEVICE_NOT_FOUND = "NVIDIA_DEVICE_NOT_FOUND"
NVIDIA_TELEMETRY_UNAVAILABLE = "NVIDIA_TELEMETRY_UNAVAILABLE"

# The next step for each code, as the agent runs: in a container the driver library and the
# devices come from the NVIDIA Container Toolkit; on a host (systemd, a shell) from the driver.
NEXT_STEPS = {
    NVIDIA_NVML_UNAVAILABLE: {
        runtime.CONTAINER: "Install the NVIDIA driver on the host and start the container with "
        "the NVIDIA Container Toolkit (docker run --gpus all) so the host's "
        "libnvidia-ml.so.1 is injected; for a CPU-only node set "
        "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu.",
        None: "Install the NVIDIA driver on this host and check that nvidia-smi works (it loads "
        "the same libnvidia-ml.so.1); for a CPU-only node set "
        "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu (or join with --accelerator cpu).",
    },
    NVIDIA_DEVICE_NOT_FOUND: {
        runtime.CONTAINER: "Check that nvidia-smi on the host lists the GPU and that the "
        "container was given it (--gpus all, NVIDIA_VISIBLE_DEVICES).",
        None: "Check that nvidia-smi lists the GPU; under systemd, that the unit may open "
        "/dev/nvidia* (DeviceAllow=, and the video group where the devices need it).",
    },
    NVIDIA_TELEMETRY_UNAVAILABLE: {
        None: "Check that nvidia-smi -q shows utilization and memory use for every GPU; a GPU "
        "that needs a reset or reports Xid errors must be fixed first.",
    },
}


def next_step_for(code: str, how: str | None = None) -> str:
    steps = NEXT_STEPS[code]
    return steps.get(how or runtime.current()) or steps[None]


# Values NVIDIA's container toolkit uses for "no GPU in this container".
_NO_VISIBLE_DEVICES = ("", "void", "none")


class PreflightFailure(Exception):
    """The NVIDIA preflight failed with one code word; the CLI exits 3."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.next_step = next_step_for(code)


def nvidia_evidence(settings: AgentSettings) -> str | None:
    """What suggests this host has NVIDIA GPUs (auto mode), or None."""
    try:
        nodes = sorted(path.name for path in Path(settings.device_dir).glob("nvidia*"))
    except OSError:
        nodes = []
    if nodes:
        return f"{settings.device_dir}/{nodes[0]}"
    visible = (settings.nvidia_visible_devices or "").strip().lower()
    if visible not in _NO_VISIBLE_DEVICES:
        return f"NVIDIA_VISIBLE_DEVICES={settings.nvidia_visible_devices}"
    return None


def effective_mode(settings: AgentSettings) -> str:
    """``nvidia`` or ``cpu``: what this run must behave as."""
    if settings.accelerator_mode != "auto":
        return settings.accelerator_mode
    evidence = nvidia_evidence(settings)
    if evidence:
        log.info("auto mode: %s seen, so NVML is required", evidence)
        return "nvidia"
    log.info("auto mode: no /dev/nvidia* and no NVIDIA_VISIBLE_DEVICES; running CPU-only")
    return "cpu"


def _cuda_version(value: int) -> str:
    # NVML encodes CUDA 12.4 as 12040.
    return f"{value // 1000}.{value % 1000 // 10}"


@dataclass
class Nvml:
    """An initialised NVML session; calls are serialised because threads share it."""

    module: Any
    driver_version: str
    cuda_version: str | None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls) -> Nvml:
        """Load and initialise NVML, or PreflightFailure(NVIDIA_NVML_UNAVAILABLE)."""
        try:
            import pynvml
        except ImportError as exc:
            raise PreflightFailure(
                NVIDIA_NVML_UNAVAILABLE, f"the NVML bindings are not installed ({exc.name})"
            ) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise PreflightFailure(
                NVIDIA_NVML_UNAVAILABLE, f"NVML could not be initialised: {exc}"
            ) from None
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise PreflightFailure(
                NVIDIA_NVML_UNAVAILABLE, f"NVML did not report the driver version: {exc}"
            ) from None
        try:
            cuda: str | None = _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion_v2())
        except pynvml.NVMLError:
            cuda = None  # optional in the contract; older drivers lack it
        return cls(pynvml, driver, cuda)

    def close(self) -> None:
        with self._lock:
            try:
                self.module.nvmlShutdown()
            except self.module.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)

    def _optional(self, call: Any, *args: Any) -> Any:
        """A value NVML may legitimately not support on this GPU: None then, never a guess."""
        try:
            return call(*args)
        except self.module.NVMLError_NotSupported:
            return None

    def _handles(self) -> list[Any]:
        nvml = self.module
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise PreflightFailure(
                NVIDIA_DEVICE_NOT_FOUND, f"NVML could not count GPUs: {exc}"
            ) from None
        if count < 1:
            raise PreflightFailure(NVIDIA_DEVICE_NOT_FOUND, "NVML reports 0 GPUs")
        try:
            return [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
        except nvml.NVMLError as exc:
            raise PreflightFailure(
                NVIDIA_DEVICE_NOT_FOUND, f"NVML lists {count} GPU(s) but one is missing: {exc}"
            ) from None

    def read_inventory(self) -> list[dict[str, Any]]:
        """One entry per GPU in the inventory shape; PreflightFailure when NVML cannot say."""
        nvml = self.module
        with self._lock:
            handles = self._handles()
            accelerators = []
            for index, handle in enumerate(handles):
                try:
                    entry = {
                        "index": index,
                        "name": _text(nvml.nvmlDeviceGetName(handle)),
                        "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                        "memory_total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                        "driver_version": self.driver_version,
                        "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                    }
                    mig = self._optional(nvml.nvmlDeviceGetMigMode, handle)
                except nvml.NVMLError as exc:
                    raise PreflightFailure(
                        NVIDIA_DEVICE_NOT_FOUND, f"GPU {index} did not identify itself: {exc}"
                    ) from None
                if self.cuda_version:
                    entry["cuda_version"] = self.cuda_version
                if mig is not None:
                    entry["mig_mode"] = (
                        "enabled" if mig[0] == nvml.NVML_DEVICE_MIG_ENABLE else "disabled"
                    )
                accelerators.append(entry)
        return accelerators

    def read_telemetry(self, inventory: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One sample per inventoried GPU; PreflightFailure(TELEMETRY_UNAVAILABLE) otherwise."""
        nvml = self.module
        samples = []
        with self._lock:
            try:
                handles = self._handles()
            except PreflightFailure as failure:
                raise PreflightFailure(NVIDIA_TELEMETRY_UNAVAILABLE, failure.detail) from None
            for index, handle in enumerate(handles):
                try:
                    samples.append(self._sample(index, handle, _mig_enabled(inventory, index)))
                except nvml.NVMLError as exc:
                    raise PreflightFailure(
                        NVIDIA_TELEMETRY_UNAVAILABLE,
                        f"GPU {index}: {exc}{_mig_hint(inventory, index)}",
                    ) from None
        check_telemetry_matches(inventory, samples)
        return samples

    def _sample(self, index: int, handle: Any, mig_enabled: bool) -> dict[str, Any]:
        nvml = self.module
        # In MIG mode NVML has no whole-GPU utilization: that, and only that, is sent as
        # null. Anywhere else a missing utilization fails closed.
        read = self._optional if mig_enabled else (lambda call, *args: call(*args))
        utilization = read(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        temperature = self._optional(
            nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
        )
        power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
        sample: dict[str, Any] = {
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "index": index,
            "utilization_gpu_percent": None if utilization is None else int(utilization.gpu),
            "utilization_memory_percent": None if utilization is None else int(utilization.memory),
            "memory_used_bytes": int(memory.used),
            "memory_total_bytes": int(memory.total),
            "temperature_c": None if temperature is None else int(temperature),
            "power_w": None if power_mw is None else round(power_mw / 1000.0, 3),
        }
        optional = {
            "power_limit_w": (nvml.nvmlDeviceGetEnforcedPowerLimit, (handle,), 1000.0),
            "clock_sm_mhz": (nvml.nvmlDeviceGetClockInfo, (handle, nvml.NVML_CLOCK_SM), None),
            "clock_memory_mhz": (nvml.nvmlDeviceGetClockInfo, (handle, nvml.NVML_CLOCK_MEM), None),
        }
        for key, (call, args, divisor) in optional.items():
            value = self._optional(call, *args)
            if value is not None:
                sample[key] = round(value / divisor, 3) if divisor else int(value)
        return sample


def check_telemetry_matches(inventory: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
    """Telemetry must describe exactly the inventoried GPUs, with plausible values."""
    expected = {(gpu["index"], gpu["uuid"]): gpu for gpu in inventory}
    seen = {(sample["index"], sample["uuid"]) for sample in samples}
    if seen != set(expected):
        raise PreflightFailure(
            NVIDIA_TELEMETRY_UNAVAILABLE,
            f"telemetry covers {len(seen)} GPU(s) that do not match the {len(expected)} "
            "in the inventory",
        )
    for sample in samples:
        gpu = expected[(sample["index"], sample["uuid"])]
        problems = []
        if sample["memory_total_bytes"] != gpu["memory_total_bytes"]:
            problems.append("memory total differs from the inventory")
        if sample["memory_used_bytes"] > sample["memory_total_bytes"]:
            problems.append("memory used exceeds memory total")
        for key in ("utilization_gpu_percent", "utilization_memory_percent"):
            if sample[key] is not None and not 0 <= sample[key] <= 100:
                problems.append(f"{key} is {sample[key]}")
        if sample["temperature_c"] is not None and not 0 <= sample["temperature_c"] <= 200:
            problems.append(f"temperature is {sample['temperature_c']} C")
        if problems:
            raise PreflightFailure(
                NVIDIA_TELEMETRY_UNAVAILABLE, f"GPU {sample['index']}: {'; '.join(problems)}"
            )


@dataclass(frozen=True)
class PreflightResult:
    mode: str  # the effective mode: nvidia or cpu
    nvml: Nvml | None
    accelerators: list[dict[str, Any]]
    samples: list[dict[str, Any]]

    def summary(self) -> str:
        if self.nvml is None:
            return "CPU-only node: NVML not used, no accelerators to check"
        names = sorted({gpu["name"] for gpu in self.accelerators})
        cuda = f", CUDA {self.nvml.cuda_version}" if self.nvml.cuda_version else ""
        return (
            f"{len(self.accelerators)} GPU(s) ({', '.join(names)}), driver "
            f"{self.nvml.driver_version}{cuda}; telemetry matches the inventory"
        )


def run_preflight(settings: AgentSettings) -> PreflightResult:
    """The NVIDIA startup contract; raises PreflightFailure. Opens no network connection."""
    mode = effective_mode(settings)
    if mode == "cpu":
        return PreflightResult("cpu", None, [], [])
    nvml = Nvml.open()
    try:
        accelerators = nvml.read_inventory()
        samples = nvml.read_telemetry(accelerators)
    except PreflightFailure:
        nvml.close()
        raise
    return PreflightResult("nvidia", nvml, accelerators, samples)


def _mig_enabled(inventory: list[dict[str, Any]], index: int) -> bool:
    return any(gpu["index"] == index and gpu.get("mig_mode") == "enabled" for gpu in inventory)


def _mig_hint(inventory: list[dict[str, Any]], index: int) -> str:
    return " (MIG is enabled on this GPU)" if _mig_enabled(inventory, index) else ""


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
