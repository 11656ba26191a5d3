"""The checks behind ``modelforge doctor``: a host before (and after) the first start.

Each check answers ok or not, what it saw, and, when not ok, the one thing to do
about it. Nothing is created or migrated here: the doctor only looks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import platform
import pwd
import re
import shutil
import socket
import stat
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import peewee as pw

from ..core.clock import Clock, isoformat
from ..core.settings import ConfigError, Settings, load_settings, parse_listen
from ..store import tables
from ..store.database import SCHEMA_VERSION, Store, redact_url
from .doctor_tls import verify_origin
from .serving import running, wildcard_warning

log = logging.getLogger(__name__)

# pyproject.toml: requires-python = ">=3.10,<3.14"; the pyz carries the compiled modules
# of each of these CPython versions (packaging/build_pyz.py).
SUPPORTED_PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13))
# The python3 each system ships, keyed by os-release (ID, VERSION_ID), with its name.
SYSTEM_PYTHONS = {
    ("debian", "11"): ("Debian 11", (3, 9)),
    ("debian", "12"): ("Debian 12 / Proxmox VE 8", (3, 11)),
    ("debian", "13"): ("Debian 13 / Proxmox VE 9", (3, 13)),
    ("ubuntu", "20.04"): ("Ubuntu 20.04", (3, 8)),
    ("ubuntu", "22.04"): ("Ubuntu 22.04", (3, 10)),
    ("ubuntu", "24.04"): ("Ubuntu 24.04", (3, 12)),
}
# The clock may not be earlier than this year (a board without RTC battery boots in 1970)...
EARLIEST_SANE_YEAR = 2024
# ...nor behind the newest time the store recorded (liveness would be computed backwards)...
CLOCK_BEHIND_TOLERANCE_SECONDS = 300
# ...nor this far past it (an RTC that jumped decades ahead).
CLOCK_AHEAD_LIMIT_SECONDS = 5 * 365 * 86400


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    warning: bool = False  # passes, but deserves a look (shown as "warn", exit 0)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def supported_range() -> str:
    first, last = SUPPORTED_PYTHONS[0], SUPPORTED_PYTHONS[-1]
    return f"{first[0]}.{first[1]}–{last[0]}.{last[1]}"


def os_release() -> dict[str, str]:
    try:
        return platform.freedesktop_os_release()
    except OSError:
        return {}


def python_install_hint(release: Mapping[str, str]) -> str:
    """How to get a supported python3 on this distribution (os-release fields)."""
    key = (release.get("ID", ""), release.get("VERSION_ID", ""))
    known = SYSTEM_PYTHONS.get(key)
    if known is not None:
        name, (major, minor) = known
        if (major, minor) in SUPPORTED_PYTHONS:
            return (
                f"{name} ships Python {major}.{minor} as python3: `apt install python3` and run "
                "the archive with /usr/bin/python3 (./modelforge.pyz does that through its "
                "shebang)"
            )
        return (
            f"{name} ships Python {major}.{minor}, which is too old: upgrade the system "
            "(docs/install-systemd.md lists the supported ones) or run ModelForge in its "
            "container image"
        )
    pretty = release.get("PRETTY_NAME") or "this system"
    return (
        f"install CPython {supported_range()} from {pretty}'s packages (usually `python3`) "
        "and run the archive with it: python3 modelforge.pyz …"
    )


def check_python(
    version: tuple[int, ...] = tuple(sys.version_info[:3]),
    release: Mapping[str, str] | None = None,
) -> Check:
    running = ".".join(str(part) for part in version)
    if tuple(version[:2]) in SUPPORTED_PYTHONS:
        return Check("python", True, f"Python {running} (supported: {supported_range()})")
    return Check(
        "python",
        False,
        f"Python {running} is running; ModelForge needs CPython {supported_range()}",
        python_install_hint(os_release() if release is None else release),
    )


_ORDERING = re.compile(
    r"(MODELFORGE_\w+) \((\d+)\) must be greater than (MODELFORGE_\w+) \((\d+)\)"
)
_WHERE = (
    "in the environment or the env file (/etc/modelforge/modelforge.env under systemd); "
    "docs/configuration.md lists every setting"
)


def settings_fix(message: str) -> str:
    """What to change, naming the variable the settings module refused."""
    ordering = _ORDERING.search(message)
    if ordering:
        larger, _, smaller, smaller_value = ordering.groups()
        return f"set {larger} above {smaller_value} (or lower {smaller}) {_WHERE}"
    named = re.search(r"MODELFORGE_\w+", message)
    return f"correct {named.group(0) if named else 'the setting'} {_WHERE}"


def check_settings(
    env: Mapping[str, str] | None, env_file: Path | None
) -> tuple[Check, Settings | None]:
    try:
        settings = load_settings(env, env_file=env_file)
    except ConfigError as exc:
        return Check("settings", False, str(exc), settings_fix(str(exc))), None
    return (
        Check(
            "settings",
            True,
            f"heartbeat {settings.heartbeat_interval_seconds}s, stale after "
            f"{settings.stale_after_seconds}s, offline after {settings.offline_after_seconds}s",
        ),
        settings,
    )


def check_state_dir(state_dir: Path, uid: int | None = None) -> Check:
    """Exists, is a directory, belongs to the running user, no group or other access."""
    uid = os.geteuid() if uid is None else uid
    me = user_name(uid)
    try:
        info = state_dir.lstat()
    except FileNotFoundError:
        return Check(
            "state_dir",
            False,
            f"{state_dir} does not exist",
            f"run `modelforge init` as {me} (it creates the directory with mode 0700), or "
            "let systemd create it (StateDirectory=modelforge)",
        )
    except OSError as exc:
        return Check(
            "state_dir",
            False,
            f"cannot inspect {state_dir}: {exc.strerror}",
            f"make every parent of {state_dir} searchable by {me}",
        )
    if not stat.S_ISDIR(info.st_mode):
        return Check(
            "state_dir",
            False,
            f"{state_dir} is not a directory",
            "move it away and run `modelforge init`, or point MODELFORGE_STATE_DIR elsewhere",
        )
    if info.st_uid != uid:
        owner = user_name(info.st_uid)
        return Check(
            "state_dir",
            False,
            f"{state_dir} is owned by {owner}, but ModelForge runs as {me}",
            f"chown -R {me}: {state_dir}  (or run ModelForge as {owner})",
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return Check(
            "state_dir",
            False,
            f"{state_dir} has mode {mode:04o}: group or others can reach the store",
            f"chmod 0700 {state_dir}",
        )
    if mode & 0o700 != 0o700:
        return Check(
            "state_dir",
            False,
            f"{state_dir} has mode {mode:04o}: its owner cannot read, write and enter it",
            f"chmod 0700 {state_dir}",
        )
    return Check("state_dir", True, f"{state_dir} owned by {me}, mode {mode:04o}")


def _who_listens(port: int) -> str:
    """How to find the program on a port, with a tool this host has."""
    if shutil.which("ss"):
        return f"find it with `ss -ltnp 'sport = :{port}'`"
    if shutil.which("lsof"):
        return f"find it with `lsof -nP -iTCP:{port} -sTCP:LISTEN`"
    return f"find it in /proc/net/tcp (port {port:04X} in hex)"


def check_port(host: str, port: int, settings: Settings | None = None) -> Check:
    """Bind the listen address the way waitress will (SO_REUSEADDR), then let go. The
    control plane of this state directory, running there already, is not a problem."""
    where = f"{host}:{port}"
    serving = running(settings) if settings is not None else None
    if serving is not None and serving.port == port:
        return Check(
            "listen",
            True,
            f"this control plane already serves on {serving.host}:{serving.port} "
            f"(pid {serving.pid}, state directory {settings.state_dir})",
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Check(
            "listen",
            False,
            f"cannot resolve {host!r}: {exc.strerror}",
            "set MODELFORGE_LISTEN to an address of this host, e.g. 0.0.0.0:8000",
        )
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return Check(
                    "listen",
                    False,
                    f"{where} is already in use by another program (not this state "
                    "directory's control plane)",
                    f"{_who_listens(port)} and stop it, or set MODELFORGE_LISTEN to a free port",
                )
            if exc.errno == errno.EACCES:
                return Check(
                    "listen",
                    False,
                    f"not allowed to listen on {where}",
                    "use a port of 1024 or above in MODELFORGE_LISTEN (the service runs "
                    "without capabilities); put a reverse proxy in front for 80/443",
                )
            if exc.errno == errno.EADDRNOTAVAIL:
                return Check(
                    "listen",
                    False,
                    f"{host} is not an address of this host",
                    "set MODELFORGE_LISTEN to one of this host's addresses, or 0.0.0.0:PORT",
                )
            return Check(
                "listen",
                False,
                f"cannot listen on {where}: {exc.strerror}",
                "set MODELFORGE_LISTEN to a free HOST:PORT on this host",
            )
    return Check("listen", True, f"{where} is free")


def newest_store_time(store: Store) -> float | None:
    """The latest time the control plane wrote into the store (its own clock)."""
    values = [
        tables.AuditEvent.select(pw.fn.MAX(tables.AuditEvent.at)).scalar(),
        tables.SchemaVersion.select(pw.fn.MAX(tables.SchemaVersion.applied_at)).scalar(),
        tables.Node.select(pw.fn.MAX(tables.Node.last_heartbeat_at)).scalar(),
    ]
    stamps = [float(value) for value in values if value is not None]
    return max(stamps) if stamps else None


def sqlite_file(url: str) -> Path | None:
    """The file of a sqlite:/// URL, parsed as store.open_database parses it; else None."""
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        return None
    path = unquote(parts.path)
    if url.startswith("sqlite:////"):
        path = "/" + path.lstrip("/")
    return Path(path)


def check_store(settings: Settings, clock: Clock) -> tuple[Check, float | None]:
    """Reachable and at this program's schema version; never creates or migrates."""
    shown = redact_url(settings.database_url)
    store: Store | None = None
    try:
        path = sqlite_file(settings.database_url)
        # Opening a missing SQLite file would create it (and its directory).
        if path is not None and not path.is_file():
            return (
                Check(
                    "store",
                    False,
                    f"no store at {path}",
                    "run `modelforge init` as the service user to create it",
                ),
                None,
            )
        store = Store(settings.database_url, clock)
        version = store.current_version()
        if version != SCHEMA_VERSION:
            if version < SCHEMA_VERSION:
                fix = (
                    "run `modelforge init` (or start `modelforge serve`): it applies the "
                    "migrations; take a backup first"
                )
            else:
                fix = "run the ModelForge release that wrote this store, or a newer one"
            return (
                Check(
                    "store",
                    False,
                    f"{shown} is at schema version {version}; this program uses {SCHEMA_VERSION}",
                    fix,
                ),
                None,
            )
        newest = newest_store_time(store)
    except (pw.PeeweeException, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            Check(
                "store",
                False,
                f"cannot read the store at {shown}: {reason}",
                "check MODELFORGE_DATABASE_URL, that PostgreSQL is running and accepts this "
                "user, or that the SQLite file is readable by the service user",
            ),
            None,
        )
    finally:
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
    return Check("store", True, f"{shown} at schema version {version}"), newest


def check_clock(now: float, newest_in_store: float | None) -> Check:
    shown = isoformat(now)
    year = datetime.fromtimestamp(now, tz=timezone.utc).year
    sync = "enable time synchronisation (timedatectl set-ntp true, or chrony) and check the RTC"
    if year < EARLIEST_SANE_YEAR:
        return Check("clock", False, f"the system clock says {shown}", sync)
    if newest_in_store is not None:
        if now < newest_in_store - CLOCK_BEHIND_TOLERANCE_SECONDS:
            return Check(
                "clock",
                False,
                f"the system clock ({shown}) is behind the newest record in the store "
                f"({isoformat(newest_in_store)}); liveness would be computed backwards",
                sync,
            )
        if now > newest_in_store + CLOCK_AHEAD_LIMIT_SECONDS:
            return Check(
                "clock",
                False,
                f"the system clock ({shown}) is years past the newest record in the store "
                f"({isoformat(newest_in_store)})",
                sync,
            )
    return Check("clock", True, f"{shown}")


def run_checks(
    env: Mapping[str, str] | None = None,
    env_file: Path | None = None,
    listen: str | None = None,
    clock: Clock | None = None,
    ca_cert: Path | None = None,
) -> list[Check]:
    """Every check, in the order an operator fixes things."""
    clock = clock or Clock()
    checks = [check_python()]
    settings_check, settings = check_settings(env, env_file)
    checks.append(settings_check)
    newest: float | None = None
    if settings is not None:
        checks.append(check_state_dir(settings.state_dir))
        host, port = (
            parse_listen(listen, "--listen")
            if listen
            else (settings.listen_host, settings.listen_port)
        )
        checks.append(check_port(host, port, settings))
        origin = check_public_origin(settings, host)
        if origin is not None:
            checks.append(origin)
        store_check, newest = check_store(settings, clock)
        checks.append(store_check)
    checks.append(check_clock(clock.now(), newest))
    if ca_cert is not None and settings is not None:
        checks.append(Check("tls", *verify_origin(settings.public_api_origin, ca_cert)))
    return checks


def check_public_origin(settings: Settings, host: str) -> Check | None:
    """A warning when agents would have no origin to use: every address or a reverse proxy,
    and none named."""
    warning = wildcard_warning(settings, host)
    if warning is None:
        return None
    fix = (
        "set MODELFORGE_PUBLIC_API_ORIGIN=https://<the proxy's address> in the env file"
        if settings.trusted_proxies
        else "set MODELFORGE_PUBLIC_API_ORIGIN=http://<this host's LAN address>:<port> in the "
        "env file, or listen on that one address"
    )
    return Check("origin", True, warning.split("; set ", 1)[0], fix, warning=True)


def render_text(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        mark = "warn" if check.warning else "ok  " if check.ok else "FAIL"
        lines.append(f"{mark} {check.name:10} {check.detail}")
        if (not check.ok or check.warning) and check.fix:
            lines.append(f"     {'':10} fix: {check.fix}")
    failed = sum(not check.ok for check in checks)
    lines.append(
        "All checks passed." if not failed else f"{failed} check(s) failed; fix them and rerun."
    )
    return "\n".join(lines)


def report(checks: list[Check]) -> dict[str, Any]:
    return {"ok": all(check.ok for check in checks), "checks": [asdict(c) for c in checks]}
