"""Runtime Worker settings: the only worker module that reads ``os.environ``.

Every variable is declared once in ``SETTINGS``, against the toolkit in
``modelforge_contract.settings`` (the unknown-name check, the one rule for blank values); ``--help`` prints them and
docs/work.md lists each. A bad value raises ``ConfigError``; the command exits 2.
"""

from __future__ import annotations

import grp
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelforge_contract import ACCELERATOR_MODES, EXIT_USAGE
from modelforge_contract.settings import SettingSpec, SettingTable

PREFIX = "MODELFORGE_WORKER_"
DEFAULT_SOCKET = "/run/modelforge/worker.sock"


SETTINGS: tuple[SettingSpec, ...] = (
    SettingSpec(
        "MODELFORGE_WORKER_SOCKET",
        DEFAULT_SOCKET,
        "Path of the unix socket the worker creates (mode 0660) and listens on; the agent's "
        "MODELFORGE_AGENT_WORKER_SOCKET must name the same path. Never a network port.",
    ),
    SettingSpec(
        "MODELFORGE_WORKER_SOCKET_GROUP",
        None,
        "Group (name or number) given the socket, so an agent running as another user in "
        "that group can connect. Unset: the worker's own group.",
    ),
    SettingSpec(
        "MODELFORGE_WORKER_ACCELERATOR_MODE",
        "nvidia",
        "nvidia: the smoke checks every GPU through NVML and runs a computation on each; "
        "cpu: a CPU-only node; auto: nvidia when /dev/nvidia* or NVIDIA_VISIBLE_DEVICES is "
        "seen. Should match the agent's MODELFORGE_AGENT_ACCELERATOR_MODE.",
    ),
    SettingSpec(
        "MODELFORGE_WORKER_DEVICE_DIR", "/dev", "Where auto mode looks for nvidia* device nodes."
    ),
    SettingSpec(
        "MODELFORGE_WORKER_LLAMA_SERVER",
        None,
        "Path of llama.cpp's llama-server for the llama.cpp runtime (scripts/llama-server-build "
        "makes one). Unset: llama-server on PATH; with neither, the worker offers no llama.cpp.",
    ),
    SettingSpec(
        "MODELFORGE_WORKER_LLAMA_RPC_SERVER",
        None,
        "Path of llama.cpp's ggml-rpc-server, which a helper of a model split across nodes "
        "runs (scripts/llama-server-build makes it beside llama-server). Unset: the one beside "
        "llama-server, else on PATH; with none, this node cannot be a helper.",
    ),
    SettingSpec("MODELFORGE_WORKER_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR."),
)
_NO_VISIBLE_DEVICES = ("", "void", "none")


class ConfigError(Exception):
    """A setting is wrong; the command prints the one-line message and exits 2."""

    exit_code = EXIT_USAGE


TABLE = SettingTable(SETTINGS, prefixes=(PREFIX,), error=ConfigError, unknown_hint="see --help")


@dataclass(frozen=True)
class WorkerSettings:
    socket_path: Path
    socket_group: int | None
    accelerator_mode: str  # the effective mode: nvidia or cpu
    log_level: str
    llama_server: str | None = None  # MODELFORGE_WORKER_LLAMA_SERVER
    llama_rpc_server: str | None = None  # MODELFORGE_WORKER_LLAMA_RPC_SERVER


_value = TABLE.value


def _group(raw: str | None) -> int | None:
    if raw is None:
        return None
    if raw.isdigit():
        return int(raw)
    try:
        return grp.getgrnam(raw).gr_gid
    except KeyError:
        raise ConfigError(f"MODELFORGE_WORKER_SOCKET_GROUP={raw!r} is not a known group") from None


def _mode(env: Mapping[str, str]) -> str:
    mode = (_value(env, "MODELFORGE_WORKER_ACCELERATOR_MODE") or "").lower()
    if mode not in ACCELERATOR_MODES:
        raise ConfigError(
            f"MODELFORGE_WORKER_ACCELERATOR_MODE={mode!r} is not one of "
            f"{', '.join(ACCELERATOR_MODES)}"
        )
    if mode != "auto":
        return mode
    device_dir = Path(_value(env, "MODELFORGE_WORKER_DEVICE_DIR") or "/dev")
    if any(device_dir.glob("nvidia*")):
        return "nvidia"
    visible = (env.get("NVIDIA_VISIBLE_DEVICES") or "").strip().lower()
    return "nvidia" if visible not in _NO_VISIBLE_DEVICES else "cpu"


def load_settings(env: Mapping[str, str] | None = None) -> WorkerSettings:
    """Parse and validate every MODELFORGE_WORKER_* variable once; raise ConfigError."""
    env = dict(os.environ if env is None else env)
    TABLE.check_names(env)
    socket_raw = _value(env, "MODELFORGE_WORKER_SOCKET") or DEFAULT_SOCKET
    socket_path = Path(socket_raw).expanduser()
    if not socket_path.is_absolute():
        raise ConfigError(f"MODELFORGE_WORKER_SOCKET={socket_raw!r} must be an absolute path")
    if len(os.fsencode(socket_path)) > 107:
        raise ConfigError(f"MODELFORGE_WORKER_SOCKET={socket_raw!r} is too long for a socket")
    log_level = TABLE.log_level(env, "MODELFORGE_WORKER_LOG_LEVEL")
    return WorkerSettings(
        socket_path=socket_path,
        socket_group=_group(_value(env, "MODELFORGE_WORKER_SOCKET_GROUP")),
        accelerator_mode=_mode(env),
        log_level=log_level,
        llama_server=_executable(env, "MODELFORGE_WORKER_LLAMA_SERVER"),
        llama_rpc_server=_executable(env, "MODELFORGE_WORKER_LLAMA_RPC_SERVER"),
    )


def _executable(env: Mapping[str, str], name: str) -> str | None:
    raw = _value(env, name)
    if raw is None:
        return None
    path = Path(raw).expanduser()
    if not path.is_absolute():
        raise ConfigError(f"{name}={raw!r} must be an absolute path")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(f"{name}={raw!r} is not an executable file")
    return str(path)
