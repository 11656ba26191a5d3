"""Which control plane: what ``modelforge serve`` really serves, and the origin tokens lock to.

``serve`` records the address it bound (the effective port too) in the state directory while
it runs; the CLI reads that record, so a token minted on the host is locked to the origin the
running server answers on, whatever ``--listen`` said. One rule decides a CLI token's origin
(:func:`token_origin`), and a wildcard or unspecified address never becomes one: no agent can
dial ``0.0.0.0``. Behind a reverse proxy (MODELFORGE_TRUSTED_PROXY) the bound address is not
one either: agents address the proxy, so a token needs MODELFORGE_PUBLIC_API_ORIGIN there.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from modelforge_contract.files import write_atomically

from ..core.settings import ConfigError, Settings, is_unspecified, normalize_origin

RECORD_NAME = "serving.json"


def origin_for(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return normalize_origin(f"http://{shown}:{port}")


@dataclass(frozen=True)
class Serving:
    """A running ``modelforge serve`` on this state directory."""

    pid: int
    host: str
    port: int
    started_at: float
    public_api_origin: str | None = None  # the server's MODELFORGE_PUBLIC_API_ORIGIN
    behind_proxy: bool = False  # the server trusts a reverse proxy (MODELFORGE_TRUSTED_PROXY)

    @property
    def listen(self) -> str:
        return f"{self.host}:{self.port}"


def record_path(settings: Settings) -> Path:
    return settings.state_dir / RECORD_NAME


def record_serving(settings: Settings, host: str, port: int) -> Serving:
    """Write the record atomically (mode 0600); the server calls it once it is bound."""
    serving = Serving(
        os.getpid(),
        host,
        int(port),
        time.time(),
        settings.public_api_origin,
        bool(settings.trusted_proxies),
    )
    write_atomically(record_path(settings), json.dumps(asdict(serving)))
    return serving


def clear_serving(settings: Settings, serving: Serving) -> None:
    """Remove the record if it is still ours (another serve may have started since)."""
    current = read_record(settings)
    if current is not None and current.pid == serving.pid:
        with contextlib.suppress(OSError):
            record_path(settings).unlink()


def read_record(settings: Settings) -> Serving | None:
    try:
        data = json.loads(record_path(settings).read_text())
        origin = data.get("public_api_origin")
        return Serving(
            int(data["pid"]),
            str(data["host"]),
            int(data["port"]),
            float(data["started_at"]),
            normalize_origin(origin) if origin else None,
            data.get("behind_proxy") is True,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def running(settings: Settings) -> Serving | None:
    """The serve process recorded in the state directory, if it still runs."""
    serving = read_record(settings)
    return serving if serving is not None and _alive(serving.pid) else None


def wildcard_warning(settings: Settings, host: str) -> str | None:
    """The warning for serving where agents have no origin to use (on every address, or
    behind a reverse proxy) with no MODELFORGE_PUBLIC_API_ORIGIN, or None."""
    if settings.public_api_origin:
        return None
    if settings.trusted_proxies:
        return (
            "behind a reverse proxy (MODELFORGE_TRUSTED_PROXY) without "
            "MODELFORGE_PUBLIC_API_ORIGIN: agents address the proxy, not this listen address, "
            "so `modelforge enroll` refuses, and tokens minted through the API lock to the "
            "origin the proxy forwards; set MODELFORGE_PUBLIC_API_ORIGIN=https://<the proxy's "
            "address> (docs/reverse-proxy.md)"
        )
    if not is_unspecified(host):
        return None
    return (
        f"listening on {host or '*'} (every address) without MODELFORGE_PUBLIC_API_ORIGIN: "
        "no token can be locked to that, so `modelforge enroll` refuses, and tokens minted "
        "through the API lock to the address each request used; set "
        "MODELFORGE_PUBLIC_API_ORIGIN=http://<this host's address>:<port>"
    )


@dataclass(frozen=True)
class TokenOrigin:
    origin: str
    source: str  # what decided it, for the operator


def token_origin(settings: Settings, override: str | None = None) -> TokenOrigin:
    """The origin a token minted on this host is locked to; ConfigError when there is none.

    In order: ``--origin``, MODELFORGE_PUBLIC_API_ORIGIN (this command's, then the running
    server's), the address the running server bound, the listen setting. A wildcard address
    is never an origin, nor the listen address behind a trusted reverse proxy.
    """
    if override:
        try:
            origin = normalize_origin(override)
        except ValueError as exc:
            raise ConfigError(f"--origin {override!r}: {exc}") from None
        if is_unspecified(origin.split("://", 1)[1].rsplit(":", 1)[0]):
            raise ConfigError(f"--origin {override!r} is every address, not one agents can use")
        return TokenOrigin(origin, "--origin")
    if settings.public_api_origin:
        return TokenOrigin(settings.public_api_origin, "MODELFORGE_PUBLIC_API_ORIGIN")
    serving = running(settings)
    if serving is not None and serving.public_api_origin:
        return TokenOrigin(
            serving.public_api_origin,
            f"MODELFORGE_PUBLIC_API_ORIGIN of the running control plane (pid {serving.pid})",
        )
    if settings.trusted_proxies or (serving is not None and serving.behind_proxy):
        raise ConfigError(
            "the control plane is behind a reverse proxy (MODELFORGE_TRUSTED_PROXY): agents "
            "address the proxy, not the address it listens on; set "
            "MODELFORGE_PUBLIC_API_ORIGIN=https://<the proxy's address> (and restart the "
            "control plane), or pass --origin https://<the proxy's address>"
        )
    host, port = (
        (serving.host, serving.port) if serving else (settings.listen_host, settings.listen_port)
    )
    where = (
        f"the running control plane, pid {serving.pid}"
        if serving
        else f"MODELFORGE_LISTEN; no control plane is running on {settings.state_dir}"
    )
    if is_unspecified(host):
        raise ConfigError(
            f"the control plane listens on {host or '*'}:{port} ({where}): every address, "
            "which is no origin an agent can dial; set "
            "MODELFORGE_PUBLIC_API_ORIGIN=http://<this host's address>:<port> (and restart "
            "the control plane), or pass --origin http://<address>:<port>"
        )
    return TokenOrigin(origin_for(host, port), where)
