from __future__ import annotations

import contextlib
import os

import pytest

from modelforge_appliance.core.clock import ManualClock
from tests.harness.control_plane import fresh_postgres_database, make_settings, serve, unavailable
from tests.parts import HEAVY_MARKERS


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    """Each store test runs on a real SQLite file and on the real PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/state/modelforge.sqlite3"
    else:
        with fresh_postgres_database() as url:
            yield url


@pytest.fixture
def settings(tmp_path, database_url):
    return make_settings(tmp_path / "state", database_url)


@pytest.fixture
def sqlite_settings(tmp_path):
    return make_settings(tmp_path / "state")


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def control_plane(settings):
    """A real waitress server on 127.0.0.1, on SQLite and on PostgreSQL."""
    with serve(settings) as cp:
        yield cp


@pytest.fixture
def sqlite_control_plane(sqlite_settings):
    """A real waitress server on 127.0.0.1 over a SQLite file (tests that need no matrix)."""
    with serve(sqlite_settings) as cp:
        yield cp


@pytest.fixture
def clocked_control_plane(settings, clock):
    """A control plane whose clock the test moves (liveness, expiry)."""
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(serve(settings, clock))


@pytest.fixture(scope="session")
def docker_client():
    """The real dockerd that scripts/test starts (images are built locally, never pulled)."""
    import docker

    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # the SDK raises several unrelated types for "no daemon"
        unavailable(f"no dockerd answers ({type(exc).__name__}): scripts/test starts one as root")
    yield client
    client.close()


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    """Debian's chromium, which Playwright drives through executable_path."""
    path = os.environ.get("MF_TEST_CHROMIUM", "/usr/bin/chromium")
    if not os.access(path, os.X_OK):
        unavailable(f"no Chromium at {path}: scripts/test installs Debian's chromium as root")
    return path


@pytest.fixture(scope="session")
def llama_server_binary():
    """llama.cpp's static llama-server that scripts/test builds (MF_TEST_LLAMA_SERVER)."""
    from tests.harness.llama import llama_server_path

    return llama_server_path()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A 0.5 MB llama GGUF with seeded random weights (tests/harness/tiny_gguf.py)."""
    from tests.harness.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# pytest-timeout's limit is [tool.pytest.ini_options] timeout (600 s) for a quick test; a heavy
# one may first build what its session shares (the release images, Debian roots, the probe
# image), so it gets longer. Still well inside CI's limit: a hang fails with its traceback.
HEAVY_TIMEOUT_SECONDS = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None and any(
            item.get_closest_marker(marker) for marker in HEAVY_MARKERS
        ):
            item.add_marker(pytest.mark.timeout(HEAVY_TIMEOUT_SECONDS))
