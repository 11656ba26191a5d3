"""Console sign-in, sessions and CSRF over real HTTP (the browser suite drives the same pages).

Time moves on the injectable clock: idle and absolute expiry, throttling windows.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from modelforge_appliance.identity import sessions
from modelforge_appliance.store.tables import ConsoleSession, User
from modelforge_contract import SESSION_COOKIE
from tests.harness.console_client import PASSWORD, ConsoleClient, set_password
from tests.harness.control_plane import (
    APPLIANCE_CLI,
    clean_env,
    error_code,
    make_settings,
    run_cli,
    serve,
)


def test_sign_in_page_names_the_command_before_a_password_exists(sqlite_control_plane):
    cp = sqlite_control_plane
    page = ConsoleClient(cp).http.get(cp.url + "/console/", timeout=30)
    assert page.url.endswith("/console/sign-in")
    assert "modelforge admin-password set" in page.text
    assert 'data-testid="login-password"' not in page.text
    refused = ConsoleClient(cp).sign_in()
    assert refused.status_code == 409
    assert error_code(refused) == "ADMIN_PASSWORD_NOT_SET"
    assert "modelforge admin-password set" in refused.json()["error"]["next_step"]


def test_sign_in_sets_a_strict_http_only_cookie_and_stores_only_digests(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    response = client.sign_in()
    assert response.status_code == 200
    cookie_header = response.headers["Set-Cookie"]
    assert cookie_header.startswith(f"{SESSION_COOKIE}=mfs_")
    assert "HttpOnly" in cookie_header and "SameSite=strict" in cookie_header
    assert "Path=/" in cookie_header and "Secure" not in cookie_header  # plain HTTP here
    cookie = client.http.cookies[SESSION_COOKIE]
    with cp.store.connection():
        stored = [row.digest for row in ConsoleSession.select()]
        password_hash = User.get_by_id("admin").password_hash
    assert cookie not in stored and len(stored) == 1
    assert password_hash.startswith("$2b$12$") and PASSWORD not in password_hash
    raw = Path(cp.store.sqlite_path).read_bytes() + _wal(cp)
    assert cookie.encode() not in raw and client.csrf.encode() not in raw
    assert PASSWORD.encode() not in raw


def _wal(cp) -> bytes:
    wal = Path(cp.store.sqlite_path + "-wal")
    return wal.read_bytes() if wal.exists() else b""


def test_the_cookie_is_secure_behind_the_trusted_tls_proxy(tmp_path):
    settings = replace(make_settings(tmp_path / "state"), trusted_proxies=("127.0.0.1",))
    with serve(settings) as cp:
        set_password(cp)
        client = ConsoleClient(
            cp, headers={"X-Forwarded-Proto": "https", "X-Forwarded-Host": "cp.lan"}
        )
        response = client.http.post(
            cp.url + "/console/sign-in", json={"password": PASSWORD}, timeout=30
        )
        assert response.status_code == 200
        assert "Secure" in response.headers["Set-Cookie"]


def test_a_wrong_password_says_so_without_hinting(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    for attempt in ("correct horse battery stapl", "x", PASSWORD.upper()):
        response = ConsoleClient(cp).sign_in(attempt)
        assert response.status_code == 401
        assert response.json()["error"] == {
            "code": "PASSWORD_INCORRECT",
            "message": "wrong user name or password",
            "next_step": response.json()["error"]["next_step"],
        }
        assert SESSION_COOKIE not in response.headers.get("Set-Cookie", "")


def test_repeated_failures_from_one_address_are_slowed_down(clocked_control_plane, clock):
    cp = clocked_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    for _ in range(sessions.FREE_FAILURES):
        assert client.sign_in("not the password").status_code == 401
    # Now even the right password waits: the password is not checked while throttled.
    throttled = client.sign_in()
    assert throttled.status_code == 429
    assert error_code(throttled) == "SIGN_IN_THROTTLED"
    assert throttled.headers["Retry-After"] == str(sessions.FIRST_WAIT_SECONDS)
    clock.advance(sessions.FIRST_WAIT_SECONDS - 1)
    assert client.sign_in().headers["Retry-After"] == "1"
    clock.advance(1)
    # Another failure after the wait doubles it.
    assert client.sign_in("still wrong").status_code == 401
    assert client.sign_in().headers["Retry-After"] == str(2 * sessions.FIRST_WAIT_SECONDS)
    clock.advance(2 * sessions.FIRST_WAIT_SECONDS)
    assert client.sign_in().status_code == 200
    # A success forgets the failures.
    assert ConsoleClient(cp).sign_in("wrong again").status_code == 401
    assert ConsoleClient(cp).sign_in().status_code == 200


def test_a_state_changing_call_without_the_csrf_token_gets_403_and_changes_nothing(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    assert client.sign_in().status_code == 200
    enrolled = cp.enroll(cp.mint()["token"]).json()
    node_id = enrolled["node_id"]
    before = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]

    for headers in ({}, {"X-CSRF-Token": "0" * 64}, {"X-CSRF-Token": ""}):
        attempts = [
            client.api(
                "POST",
                "/admin/node-enrollments",
                csrf=False,
                headers=dict(headers),
                json={"display_name": "evil", "expires_in_seconds": 900},
            ),
            client.api(
                "POST", f"/admin/hardware/nodes/{node_id}/cordon", False, headers=dict(headers)
            ),
            client.api(
                "DELETE",
                f"/admin/hardware/nodes/{node_id}/credential",
                False,
                headers=dict(headers),
            ),
            client.api(
                "POST",
                f"/admin/hardware/nodes/{node_id}/decommission/preview",
                False,
                headers=dict(headers),
            ),
        ]
        for attempt in attempts:
            assert attempt.status_code == 403, attempt.text
            assert error_code(attempt) == "CSRF_TOKEN_INVALID"

    after = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
    assert after == before
    node = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}").json()
    assert node["cordoned"] is False
    credentials = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}/credentials").json()
    assert credentials["active"] == 1
    assert len(cp.admin("GET", "/api/v1/admin/node-enrollments").json()["enrollments"]) == 1

    # Reads need no CSRF token; with it, the same calls work and are audited as the session.
    assert client.api("GET", "/admin/hardware/nodes", csrf=False).status_code == 200
    cordoned = client.api("POST", f"/admin/hardware/nodes/{node_id}/cordon")
    assert cordoned.status_code == 200 and cordoned.json()["cordoned"] is True
    newest = cp.admin("GET", "/api/v1/admin/audit-events?limit=1").json()["events"][0]
    assert newest["action"] == "node.cordoned" and newest["actor"].startswith("console:")


def test_admin_tokens_keep_working_beside_sessions(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    client.sign_in()
    # An admin token with a stale cookie alongside: the token decides. The stale cookie
    # replaces the signed-in one (two cookies of one name would leave the pick to the jar).
    client.http.cookies.clear()
    client.http.cookies.set(SESSION_COOKIE, "mfs_0000000000000000_" + "x" * 43)
    minted = client.http.post(
        cp.url + "/api/v1/admin/node-enrollments",
        json={"display_name": "automation", "expires_in_seconds": 300},
        headers={"X-ModelForge-Admin-Token": cp.admin_token},
        timeout=30,
    )
    assert minted.status_code == 201
    assert minted.json()["created_by"].startswith("admin:")
    nobody = client.http.get(cp.url + "/api/v1/admin/hardware/nodes", timeout=30)
    assert nobody.status_code == 401 and error_code(nobody) == "SESSION_EXPIRED"


def test_sessions_expire_when_idle_and_at_their_absolute_limit(clocked_control_plane, clock):
    cp = clocked_control_plane
    settings = cp.settings
    set_password(cp)
    client = ConsoleClient(cp)
    client.sign_in()
    clock.advance(settings.session_idle_seconds - 1)
    assert client.api("GET", "/admin/hardware/nodes").status_code == 200
    clock.advance(settings.session_idle_seconds - 1)  # still alive: that use counted
    assert client.api("GET", "/admin/hardware/nodes").status_code == 200
    clock.advance(settings.session_idle_seconds)
    idle = client.api("GET", "/admin/hardware/nodes")
    assert idle.status_code == 401 and error_code(idle) == "SESSION_EXPIRED"
    assert client.http.get(cp.url + "/console/", timeout=30).url.endswith("/console/sign-in")

    busy = ConsoleClient(cp)
    busy.sign_in()
    step = settings.session_idle_seconds // 2
    used = 0
    while used + step < settings.session_max_seconds:
        clock.advance(step)
        used += step
        assert busy.api("GET", "/admin/alerts").status_code == 200
    clock.advance(settings.session_max_seconds - used)
    assert error_code(busy.api("GET", "/admin/alerts")) == "SESSION_EXPIRED"


def test_sign_out_needs_the_csrf_token_and_ends_the_session(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    client.sign_in()
    refused = client.http.post(cp.url + "/console/sign-out", timeout=30)
    assert refused.status_code == 403 and error_code(refused) == "CSRF_TOKEN_INVALID"
    assert client.api("GET", "/admin/alerts").status_code == 200
    cookie = client.http.cookies[SESSION_COOKIE]
    done = client.http.post(
        cp.url + "/console/sign-out", headers={"X-CSRF-Token": client.csrf}, timeout=30
    )
    assert done.status_code == 200
    assert (
        f'{SESSION_COOKIE}=""' in done.headers["Set-Cookie"]
        or "Max-Age=0" in done.headers["Set-Cookie"]
    )
    client.http.cookies.set(SESSION_COOKIE, cookie)  # a copied cookie is dead too
    assert error_code(client.api("GET", "/admin/alerts")) == "SESSION_EXPIRED"
    actions = [e["action"] for e in cp.admin("GET", "/api/v1/admin/audit-events").json()["events"]]
    assert actions[:2] == ["console.signed_out", "console.signed_in"]


def test_setting_a_new_password_signs_everyone_out(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    client.sign_in()
    set_password(cp, "another long passphrase")
    assert error_code(client.api("GET", "/admin/alerts")) == "SESSION_EXPIRED"
    assert ConsoleClient(cp).sign_in().status_code == 401
    assert ConsoleClient(cp).sign_in("another long passphrase").status_code == 200


# -- modelforge admin-password set -----------------------------------------------------


def cli(state: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return run_cli(*args, env=clean_env(MODELFORGE_STATE_DIR=str(state)), stdin=stdin)


def stored_hash(state: Path) -> str | None:
    import sqlite3

    if not (state / "modelforge.sqlite3").exists():
        return None
    with sqlite3.connect(state / "modelforge.sqlite3") as db:
        row = db.execute("SELECT password_hash FROM admin_password").fetchone()
    return row[0] if row else None


def initialised(tmp_path: Path) -> Path:
    """A state directory with a store: only init and serve create one."""
    state = tmp_path / "state"
    assert cli(state, "init").returncode == 0
    return state


def test_admin_password_set_reads_one_line_from_stdin(tmp_path):
    state = initialised(tmp_path)
    short = cli(state, "admin-password", "set", stdin="too short\n")
    assert short.returncode == 2 and "at least 12 characters" in short.stderr
    assert stored_hash(state) is None
    done = cli(state, "admin-password", "set", stdin=f"{PASSWORD}\nignored second line\n")
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    import bcrypt

    assert bcrypt.checkpw(PASSWORD.encode(), stored_hash(state).encode())
    empty = cli(state, "admin-password", "set", stdin="")
    assert empty.returncode == 2 and "no password on stdin" in empty.stderr


def test_admin_password_set_follows_the_cli_conventions(tmp_path):
    """No store: refused before any prompt, naming where it looked, and nothing created.
    --json: the answer parses and carries no password; a terminal is not prompted."""
    missing = tmp_path / "missing"
    refused = cli(missing, "admin-password", "set", stdin=f"{PASSWORD}\n")
    assert refused.returncode == 2 and "no ModelForge store at" in refused.stderr
    assert "Traceback" not in refused.stderr and not missing.exists()
    state = initialised(tmp_path)
    done = cli(state, "admin-password", "set", "--json", stdin=f"{PASSWORD}\n")
    assert done.returncode == 0, done.stderr
    # Where to sign in: no server runs, so the listen setting's address (the default).
    assert json.loads(done.stdout) == {
        "password_set": True,
        "sessions_signed_out": 0,
        "console_url": "http://127.0.0.1:8000/console/",
    }
    plain = cli(state, "admin-password", "set", stdin=f"{PASSWORD}\n")
    assert "Sign in at http://127.0.0.1:8000/console/." in plain.stdout
    assert PASSWORD not in done.stdout + done.stderr
    helped = cli(state, "admin-password", "set", "-h")
    assert helped.returncode == 0 and "--json" in helped.stdout


def test_admin_password_is_never_taken_from_the_command_line(tmp_path):
    state = initialised(tmp_path)
    refused = cli(state, "admin-password", "set", PASSWORD, stdin=f"{PASSWORD}\n")
    assert refused.returncode == 2
    assert "unexpected extra argument" in refused.stderr.lower()
    assert stored_hash(state) is None


PROMPTS = (b"New admin password: ", b"Repeat it: ")


def _run_on_a_terminal(state: Path, typed: list[str], *args: str) -> tuple[int, str]:
    env = clean_env(MODELFORGE_STATE_DIR=str(state))
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [*APPLIANCE_CLI, "admin-password", "set", *args],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        close_fds=True,
    )
    os.close(secondary)
    output = b""
    pending = list(typed)
    while True:
        ready, _, _ = select.select([primary], [], [], 30)
        assert ready, f"no prompt within 30 s: {output!r}"
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the other side closed: the program ended
            break
        if not chunk:
            break
        output += chunk
        # Type only at a prompt (echo is off there); other lines (which store) come first.
        asked = sum(output.count(prompt) for prompt in PROMPTS)
        if pending and asked > len(typed) - len(pending):
            os.write(primary, pending.pop(0).encode() + b"\r")
    os.close(primary)
    return process.wait(timeout=30), output.decode(errors="replace")


def test_admin_password_prompts_twice_without_echo_on_a_terminal(tmp_path):
    state = initialised(tmp_path)
    status, output = _run_on_a_terminal(state, [PASSWORD, PASSWORD + "!"])
    assert status == 2 and "differ" in output
    assert PASSWORD not in output
    status, output = _run_on_a_terminal(state, [PASSWORD, PASSWORD])
    assert status == 0, output
    assert output.count("password") >= 1 and PASSWORD not in output
    assert stored_hash(state).startswith("$2b$")
    # A script (--json) is never prompted, even on a terminal: it sends the line on stdin.
    status, output = _run_on_a_terminal(state, [], "--json")
    assert status == 2 and "--json does not ask questions" in output


@pytest.mark.parametrize("bad", ["   leading spaces ok?", "x" * 73])
def test_unusable_passwords_are_refused_before_hashing(bad):
    with pytest.raises(sessions.PasswordRefused):
        sessions.check_new_password(bad)


def test_guesses_sent_in_parallel_meet_the_same_limit(sqlite_control_plane):
    """The check raced with bcrypt: 12 parallel guesses got 12 checks instead of 5."""
    cp = sqlite_control_plane
    set_password(cp)
    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(lambda _: ConsoleClient(cp).sign_in("wrong").status_code, range(12)))
    assert sorted(codes) == [401] * sessions.FREE_FAILURES + [429] * (12 - sessions.FREE_FAILURES)


def test_guesses_from_many_addresses_meet_one_global_limit(tmp_path, clock, monkeypatch):
    """Each address under its own limit, all of them together are bounded too; the wait is
    short, said plainly, audited, and a new password clears it."""
    monkeypatch.setattr(sessions, "GLOBAL_FREE_FAILURES", 8)
    settings = replace(make_settings(tmp_path / "proxied"), trusted_proxies=("127.0.0.1",))
    with serve(settings, clock) as cp:
        set_password(cp)
        for index in range(8):
            guess = ConsoleClient(cp, headers={"X-Forwarded-For": f"203.0.113.{index}"})
            assert guess.sign_in("wrong").status_code == 401
        fresh = ConsoleClient(cp, headers={"X-Forwarded-For": "198.51.100.1"})
        slowed = fresh.sign_in()
        assert slowed.status_code == 429
        assert "from many addresses" in slowed.json()["error"]["message"]
        assert "modelforge admin-password set" in slowed.json()["error"]["next_step"]
        assert slowed.headers["Retry-After"] == str(sessions.GLOBAL_FIRST_WAIT_SECONDS)
        events = cp.admin("GET", "/api/v1/admin/audit-events").json()["events"]
        assert [e for e in events if e["action"] == "console.sign_in_slowed"]
        clock.advance(sessions.GLOBAL_FIRST_WAIT_SECONDS)
        assert fresh.sign_in().status_code == 200  # the admin was slowed, not locked out
        for index in range(8):
            guess = ConsoleClient(cp, headers={"X-Forwarded-For": f"203.0.113.{index}"})
            guess.sign_in("wrong")
        assert fresh.sign_in().status_code == 429
        set_password(cp, PASSWORD)  # on the host: a new password clears every wait
        assert fresh.sign_in().status_code == 200


def test_throttling_counts_the_real_client_address(tmp_path, sqlite_control_plane):
    """Spoofed X-Forwarded-For never escapes the throttle; behind the trusted proxy, one
    client's failures do not lock out another."""
    cp = sqlite_control_plane
    set_password(cp)
    for attempt in range(sessions.FREE_FAILURES):
        spoofed = ConsoleClient(cp, headers={"X-Forwarded-For": f"10.0.0.{attempt}"})
        assert spoofed.sign_in("wrong").status_code == 401
    assert ConsoleClient(cp, headers={"X-Forwarded-For": "10.9.9.9"}).sign_in().status_code == 429

    settings = replace(make_settings(tmp_path / "proxied"), trusted_proxies=("127.0.0.1",))
    with serve(settings) as proxied:
        set_password(proxied)
        for _ in range(sessions.FREE_FAILURES):
            attacker = ConsoleClient(proxied, headers={"X-Forwarded-For": "203.0.113.7"})
            assert attacker.sign_in("wrong").status_code == 401
        assert attacker.sign_in().status_code == 429
        admin = ConsoleClient(proxied, headers={"X-Forwarded-For": "192.0.2.10"})
        assert admin.sign_in().status_code == 200


def test_a_restore_revives_no_session_and_no_replaced_password(tmp_path):
    from .test_backup_restore import Host

    host = Host(tmp_path)
    cli(Path(host.env["MODELFORGE_STATE_DIR"]), "admin-password", "set", stdin=PASSWORD + "\n")
    backup = tmp_path / "backup.sqlite3"
    with host.serving():
        plane = _Plane(host.url)
        signed_out = ConsoleClient(plane)
        assert signed_out.sign_in().status_code == 200
        host.cli("backup", str(backup))
        cookie = signed_out.http.cookies[SESSION_COOKIE]
        assert signed_out.http.post(
            host.url + "/console/sign-out", headers={"X-CSRF-Token": signed_out.csrf}, timeout=30
        ).ok
    state = Path(host.env["MODELFORGE_STATE_DIR"])
    assert cli(state, "admin-password", "set", stdin="a newer long password\n").returncode == 0
    host.cli("restore", str(backup), "--yes")
    with host.serving():
        revived = ConsoleClient(_Plane(host.url))
        revived.http.cookies.set(SESSION_COOKIE, cookie)
        assert error_code(revived.api("GET", "/admin/alerts")) == "SESSION_EXPIRED"
        assert ConsoleClient(_Plane(host.url)).sign_in().status_code == 401
        assert ConsoleClient(_Plane(host.url)).sign_in("a newer long password").status_code == 200


class _Plane:
    """What ConsoleClient needs of a control plane that runs as its own process."""

    def __init__(self, url: str) -> None:
        self.url = url


def test_the_hardware_page_through_a_wildcard_address_says_no_token_can_be_locked(
    sqlite_control_plane,
):
    """Opened as http://0.0.0.0:8000/ (serve's banner on a wildcard listen address), the wizard
    cannot promise an origin: the page says why instead of showing "unknown" as one."""
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    assert client.sign_in().ok
    usual = client.http.get(cp.url + "/console/", timeout=30).text
    assert 'data-testid="enroll-origin"' in usual and cp.url in usual
    # requests matches cookies against the Host header: send the session's own.
    cookie = "; ".join(f"{c.name}={c.value}" for c in client.http.cookies)
    wildcard = requests.get(
        cp.url + "/console/", headers={"Host": "0.0.0.0:8000", "Cookie": cookie}, timeout=30
    )
    assert wildcard.status_code == 200
    assert 'data-testid="enroll-origin-unusable"' in wildcard.text
    assert 'data-testid="enroll-origin"' not in wildcard.text
    assert "MODELFORGE_PUBLIC_API_ORIGIN" in wildcard.text
