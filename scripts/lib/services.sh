# Sourced by scripts/test: start the real services the tests use, and stop what we started.
# Each start_* function exports the variable the tests read; cleanup_services stops them.

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

# -- PostgreSQL on loopback (MF_TEST_POSTGRES_URL) ----------------------------------
start_postgres() {
    [ -n "$(pg_bin)" ] && [ -z "${MF_TEST_POSTGRES_URL:-}" ] || return 0
    PG_DIR=$(mktemp -d /tmp/modelforge-test-pg.XXXXXX)
    local port
    port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    [ "$(id -u)" = 0 ] && chown postgres: "$PG_DIR"
    log "starting PostgreSQL on 127.0.0.1:$port"
    as_pg "$(pg_bin)/initdb" -D "$PG_DIR/data" -A trust -U postgres --no-sync >/dev/null
    as_pg "$(pg_bin)/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w \
        -o "-h 127.0.0.1 -p $port -k $PG_DIR -c fsync=off -c max_connections=300" start >/dev/null
    export MF_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/postgres"
}

# -- dockerd (the tests use the docker SDK's default socket) --------------------------
docker_answers() { command -v docker >/dev/null && docker version >/dev/null 2>&1; }
start_dockerd() {
    docker_answers && return 0
    if [ "$(id -u)" != 0 ] || ! command -v dockerd >/dev/null; then
        log "no dockerd answers and none can be started here (needs root and docker.io)"
        return 0
    fi
    log "starting dockerd"
    DOCKERD_LOG=$(mktemp /tmp/modelforge-test-dockerd.XXXXXX)
    dockerd >"$DOCKERD_LOG" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
        docker_answers && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    log "dockerd did not start; its log:"
    tail -n 20 "$DOCKERD_LOG" >&2
    DOCKERD_PID=
}

# -- headless Chromium for the console tests (MF_TEST_CHROMIUM) -----------------------
find_chromium() {
    [ -x /usr/bin/chromium ] && export MF_TEST_CHROMIUM=/usr/bin/chromium
    return 0
}

cleanup_services() {
    if [ -n "${PG_DIR:-}" ]; then
        as_pg "$(pg_bin)/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
        rm -rf "$PG_DIR"
    fi
    if [ -n "${DOCKERD_PID:-}" ]; then
        kill "$DOCKERD_PID" 2>/dev/null || true
        wait "$DOCKERD_PID" 2>/dev/null || true
        rm -f "$DOCKERD_LOG"
    fi
}
