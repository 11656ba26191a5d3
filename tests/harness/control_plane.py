"""Shared test parts: a real control plane on a loopback port over a real store."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import pytest
import requests

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.core.settings import Settings, load_settings
from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.runtime.server import create_server, run_until
from modelforge_appliance.store import audit
from modelforge_appliance.store.database import Store
from modelforge_contract import HEADER_ADMIN_TOKEN, HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION

# Re-exported for the tests that read pyproject.toml.
if sys.version_info >= (3, 11):
    import tomllib  # noqa: F401
else:  # CPython 3.10: the same parser, from PyPI (pyproject.toml's test extra)
    import tomli as tomllib  # noqa: F401

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
POSTGRES_ENV = "MF_TEST_POSTGRES_URL"


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_answering(
    url: str, process: subprocess.Popen, log_path: Path | None = None, timeout: float = 30
) -> requests.Response:
    """Poll url until it answers 200 while process lives; fail with its log otherwise."""
    deadline = time.monotonic() + timeout
    log = (lambda: f":\n{log_path.read_text()}") if log_path else (lambda: "")
    while True:
        assert process.poll() is None, f"exited {process.returncode} before answering{log()}"
        try:
            response = requests.get(url, timeout=2)
            if response.status_code == 200:
                return response
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout}s{log()}"
        time.sleep(0.1)


APPLIANCE_CLI = (sys.executable, "-m", "modelforge_appliance.cli")


def clean_env(**extra: str) -> dict[str, str]:
    """This run's environment without any MODELFORGE_* or SHIV_* setting, plus EXTRA: what a
    command started by hand on a fresh machine sees (explicit variables also win over any
    settings file the test's virtualenv could hold)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("MODELFORGE_", "SHIV_"))
    }
    return {**env, **extra}


def store_env(settings: Settings, **extra: str) -> dict[str, str]:
    """clean_env for a CLI that opens the store of SETTINGS (its state directory, and its
    database URL where one is set)."""
    env = clean_env(MODELFORGE_STATE_DIR=str(settings.state_dir), **extra)
    if settings.database_url:
        env["MODELFORGE_DATABASE_URL"] = settings.database_url
    return env


def run_cli(
    *args: str,
    env: Mapping[str, str],
    stdin: str | None = None,
    timeout: float = 60,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """``modelforge ARGS`` as its own process, its standard input closed unless STDIN is given.
    With CHECK a non-zero exit fails the test with what the command printed."""
    result = subprocess.run(
        [*APPLIANCE_CLI, *args],
        env=dict(env),
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return _checked(result, args, check)


def _checked(
    result: subprocess.CompletedProcess, args: tuple[str, ...], check: bool
) -> subprocess.CompletedProcess:
    """RESULT; with CHECK, a non-zero exit fails the test with what the command printed."""
    if check:
        assert result.returncode == 0, (
            f"modelforge {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout}{result.stderr}"
        )
    return result


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """What a command changes in its process and a test's process must get back: the umask
    (modelforge sets 0077), the root logger's handlers and level (configure_logging points them
    at the command's stderr), and the hooks for uncaught exceptions (pytest reads threads')."""
    umask = os.umask(0o077)
    os.umask(umask)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    hooks = sys.excepthook, threading.excepthook
    try:
        yield
    finally:
        os.umask(umask)
        root.handlers[:] = handlers
        root.setLevel(level)
        sys.excepthook, threading.excepthook = hooks


def invoke_cli(
    *args: str,
    env: Mapping[str, str],
    stdin: str | None = None,
    timeout: float = 60,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """``modelforge ARGS`` in this process (click's CliRunner), answered as run_cli answers:
    the same exit code, standard output and standard error, in a fraction of the time. The
    environment is ENV exactly, standard input empty unless STDIN is given. For what only a
    process shows (signals, a terminal, the entry points, the import of a missing extra) the
    tests use run_cli, and ``serve`` runs as run_cli runs it. In process, TIMEOUT is left to
    pytest-timeout: no other thread watches the command."""
    from click.testing import CliRunner

    from modelforge_appliance.cli.completion import PROG
    from modelforge_appliance.cli.main import main

    if args and args[0] == "serve":
        # Its own process still: serve sets the process's signal handlers and holds the state
        # directory's serve lock for as long as the process lives.
        return run_cli(*args, env=env, stdin=stdin, timeout=timeout, check=check)
    replaced = {name: None for name in os.environ if name not in env} | dict(env)
    with _process_state_kept():
        result = CliRunner(env=replaced).invoke(
            main, list(args), input=stdin or "", prog_name=PROG, catch_exceptions=True
        )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    answer = subprocess.CompletedProcess(
        [PROG, *args], result.exit_code, result.stdout, result.stderr
    )
    return _checked(answer, args, check)


@contextlib.contextmanager
def serving(
    env: Mapping[str, str], log_path: Path, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``modelforge serve`` as its own process on PORT of 127.0.0.1 (a free one unless given),
    its output appended to LOG_PATH: yields (url, process) once /healthz answers. If it still
    runs when the block ends it is stopped with SIGTERM, which must end it with exit code 0."""
    port = port or free_port()
    with log_path.open("a") as log:
        process = subprocess.Popen(
            [*APPLIANCE_CLI, "serve", "--listen", f"127.0.0.1:{port}"],
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until_answering(f"http://127.0.0.1:{port}/healthz", process, log_path)
            yield f"http://127.0.0.1:{port}", process
        finally:
            if process.poll() is None:  # not stopped (or killed) by the test itself
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=15) == 0, log_path.read_text()


def error_code(response: requests.Response) -> str:
    return response.json()["error"]["code"]


def make_settings(state_dir: Path, database_url: str | None = None, **overrides) -> Settings:
    """Settings built the way production builds them, then adjusted for the test."""
    env = {"MODELFORGE_STATE_DIR": str(state_dir)}
    if database_url:
        env["MODELFORGE_DATABASE_URL"] = database_url
    return replace(load_settings(env), **overrides)


def unavailable(message: str) -> NoReturn:
    """A real component a test needs is missing: skip on a workstation, fail in CI."""
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def postgres_admin_url() -> str:
    """The PostgreSQL server scripts/test started; skip locally, fail in CI, when absent."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        unavailable(f"{POSTGRES_ENV} is not set: scripts/test starts PostgreSQL and sets it")
    return url


@contextlib.contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty database on the test server; dropped afterwards."""
    admin_url = postgres_admin_url()
    name = f"mf_test_{secrets.token_hex(6)}"
    conn = psycopg2.connect(admin_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        parts = urlsplit(admin_url)
        yield urlunsplit(parts._replace(path=f"/{name}"))
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        conn.close()


@dataclass
class ControlPlane:
    """A control plane served by waitress on 127.0.0.1 for one test."""

    url: str
    settings: Settings
    store: Store
    admin_token: str
    heartbeats: object = None  # the server's HeartbeatBuffer
    server: object = None  # the waitress server (its bottle app is server.app)

    def admin(self, method: str, path: str, **kwargs) -> requests.Response:
        headers = {HEADER_ADMIN_TOKEN: self.admin_token, **kwargs.pop("headers", {})}
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def mint(self, name: str = "GPU Node", expires: int = 900) -> dict:
        response = self.admin(
            "POST",
            "/api/v1/admin/node-enrollments",
            json={"display_name": name, "expires_in_seconds": expires},
        )
        assert response.status_code == 201, response.text
        return response.json()

    def agent(
        self, method: str, path: str, credential: str | None = None, **kwargs
    ) -> requests.Response:
        headers = {HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION), **kwargs.pop("headers", {})}
        if credential is not None:
            headers["Authorization"] = f"Bearer {credential}"
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def enroll(
        self, token: str, hostname: str = "gpu-node-1", identity=None, headers=None, **extra
    ):
        body = {
            "token": token,
            "hostname": hostname,
            "agent_version": "0.1.0",
            "accelerator_mode": "cpu",
            **extra,
        }
        if identity is not None:
            body["identity"] = identity
        return self.agent("POST", "/api/v1/agent/enroll", json=body, headers=headers or {})

    def heartbeat(self, credential: str, node_id: str, **kwargs) -> requests.Response:
        body = {
            "node_id": node_id,
            "agent_version": "0.1.0",
            "health": {"status": "ok", "gpu_probe": "not_applicable"},
        }
        return self.agent("POST", "/api/v1/agent/heartbeat", credential, json=body, **kwargs)


def new_identity() -> dict:
    identity_id = secrets.token_hex(8)
    return {
        "identity_id": identity_id,
        "identity_secret": f"mfi_{identity_id}_{secrets.token_urlsafe(32)}",
    }


@contextlib.contextmanager
def serve(settings: Settings, clock: Clock | None = None) -> Iterator[ControlPlane]:
    """Migrate the store, mint an admin token and serve on a free loopback port."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(settings.database_url, clock or Clock())
    store.migrate()
    _, token = admin_tokens.create_admin_token(store, "tests", audit.CLI_ACTOR)
    server = create_server(settings, store, "127.0.0.1", 0)
    stop = threading.Event()
    thread = threading.Thread(target=run_until, args=(server, stop), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.effective_port}"
        yield ControlPlane(url, settings, store, token, server.heartbeats, server)
    finally:
        stop.set()
        thread.join(timeout=5)
        store.close()
