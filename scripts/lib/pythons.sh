# Sourced by scripts/test: the parts of the suite that run on every supported CPython, and
# the host set-up the Debian-root tests need (tests/packaging/test_debian_hosts.py).
#
# MF_TEST_PYTHONS lists the extra CPython versions (default: every supported one but that of
# .venv, which runs anyway: "3.10 3.12 3.13" where .venv is 3.11). Each is looked up
# as pythonX.Y on PATH, then among pyenv's builds. With CI=true a missing one fails the run
# instead of being skipped; MF_TEST_PYTHONS="" (not with CI=true) runs none.

SUPPORTED_PYTHONS="3.10 3.11 3.12 3.13"
case "${CI:-}" in 1 | true | True | TRUE | yes) IN_CI=1 ;; *) IN_CI= ;; esac

# System packages the Debian-root tests need; appended to the caller's `missing`.
root_test_packages() {
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v unshare >/dev/null || missing+=(util-linux)
    case "$(uname -m)" in
        x86_64) [ -x /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] || missing+=(qemu-user-static binfmt-support) ;;
        aarch64) [ -x /usr/libexec/qemu-binfmt/x86_64-binfmt-P ] || missing+=(qemu-user-static binfmt-support) ;;
    esac
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
}

# Let the kernel run the other machine's binaries through qemu (needs root; a container may
# refuse, and the qemu test then says why).
enable_foreign_binaries() {
    local other
    case "$(uname -m)" in
        x86_64) other=aarch64 ;;
        aarch64) other=x86_64 ;;
        *) return 0 ;;
    esac
    [ "$(id -u)" = 0 ] || return 0
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null ||
            log "cannot mount binfmt_misc: the qemu test will say why it cannot run"
    fi
    if [ -e /proc/sys/fs/binfmt_misc/register ] && command -v update-binfmts >/dev/null; then
        update-binfmts --enable "qemu-$other" 2>/dev/null ||
            log "update-binfmts --enable qemu-$other failed: the qemu test will say why"
    fi
}

# The interpreter for CPython X.Y, or nothing.
find_python() {
    local version="$1" candidate
    for candidate in "$(command -v "python$version" 2>/dev/null)" \
        "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python"$version"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ] &&
            "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

# The suite runs in three parts, chosen by marker (tests/parts.py says which; tests/test_parts.py
# checks that every test is in one). The heavy part (fleets of a thousand agents, image builds,
# Debian roots under qemu, Chromium, and the tests that change this checkout's own .venv) runs
# once, on .venv's CPython: the tests that change this checkout alone, then the builds
# (dockerd's, Debian roots) and the rest side by side, before the quick part. The quick part (everything else)
# runs once, on .venv's CPython too. The portable part, what depends on the interpreter (every
# module compiled and imported, the wire contract, the archives and their launcher, the
# operators' verifiers, an enrollment and heartbeat end to end, psycopg2 against the real
# server), runs on each other supported CPython. The quick and portable runs go side by side
# (MF_TEST_PARALLEL at a time, default all of them): most of a run waits on the processes and
# sockets its tests start. Each writes build/test-logs/pytest-pyX.Y.log, printed whole when it
# ends. They share only PostgreSQL (every test makes its own database), pip's download cache
# and the archives built once before them (MF_TEST_ARCHIVES, tests/harness/archives.py).
part_markers() { .venv/bin/python -m tests.parts "$1"; }
# How many runs (heavy and quick) selected at least one test; scripts/test fails when none did.
RUNS_WITH_TESTS=0

# pytest_run PYTHON [PYTEST ARGS]: PYTHON -m pytest with Ctrl-C's SIGINT and SIGQUIT at their
# defaults. A job started with & from a script, or a scripts/test itself started that way,
# inherits them ignored, and a signal ignored at exec stays ignored in every program the tests
# start: bash under test could then not trap Ctrl-C (tests/test_suite_signals.py checks).
pytest_run() {
    local python="$1"
    shift
    "$python" -c 'import os, signal, sys
for number in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(number, signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])' "$@"
}

# run_heavy_tests [PYTEST ARGS]: the heavy part on .venv's CPython, in the runs tests/parts.py
# names (HEAVY_RUNS): those that change this checkout alone, then the builds (dockerd's images,
# Debian roots) and the rest side by side, each writing build/test-logs/pytest-pyX.Y-heavy-*.log, printed whole when it ends.
run_heavy_tests() {
    local code=0 status=0 main logs=build/test-logs pids=() names=() name markers
    main=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    mkdir -p "$logs"
    markers=$(part_markers heavy-checkout)
    log "pytest on $(.venv/bin/python --version 2>&1), the heavy part's tests that change this checkout (-m '$markers')"
    pytest_run .venv/bin/python -m "$markers" "$@" || code=$?
    count_heavy_run "$code" || status=1
    for name in heavy-builds heavy-rest; do
        start_quick_run "$main-$name" .venv/bin/python "$name" 1/1 "$logs" "$@"
        pids+=("$!")
        names+=("$main-$name")
    done
    for ((i = 0; i < ${#names[@]}; i++)); do
        finish_quick_run "${names[i]}" "${pids[i]}" "$logs" || status=1
    done
    return "$status"
}

# count_heavy_run CODE: pytest's exit code of a foreground heavy run, counted.
count_heavy_run() {
    case $1 in
        0) RUNS_WITH_TESTS=$((RUNS_WITH_TESTS + 1)) ;;
        5) log "no test that changes this checkout among those selected" ;;
        *) RUNS_WITH_TESTS=$((RUNS_WITH_TESTS + 1)); return 1 ;;
    esac
}

# QUICK_SHARDS: how many runs side by side share the quick part on .venv's CPython (each takes
# every QUICK_SHARDS-th test file, tests/harness/shard.py): its tests mostly wait on the
# processes and sockets they start, so two runs on two cores take little more than one.
QUICK_SHARDS=${MF_TEST_QUICK_SHARDS:-2}

# make_python_venv VERSION PYTHON EXTRAS: .venv-pyVERSION with EXTRAS installed (editable),
# made again only when pyproject.toml or EXTRAS changed.
make_python_venv() {
    local version="$1" python="$2" extras="$3" venv stamp want
    venv=".venv-py$version"
    stamp="$venv/.modelforge-installed"
    want="$(pyproject_hash) $extras"  # scripts/lib/venv.sh
    if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
        log "making $venv with $("$python" --version 2>&1)"
        rm -rf "$venv"
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            -e ".[$extras]" 2> >(grep -v '^WARNING: Location' >&2)
        echo "$want" > "$stamp"
    fi
}

# run_quick_tests EXTRAS [PYTEST ARGS]: the quick part on .venv's CPython (in QUICK_SHARDS
# runs) and the portable part on every other supported one, each of those installed with
# EXTRAS into .venv-pyX.Y. MF_TEST_PYTHONS lists the other versions. Returns non-zero when any
# run failed or, with CI=true, when a version is missing.
run_quick_tests() {
    local extras="$1" version python status=0 main versions i shard
    local parallel=${MF_TEST_PARALLEL:-0} logs=build/test-logs pids=() names=() made=()
    local pythons=() parts=() shards=() others=()
    shift
    main=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    versions=${MF_TEST_PYTHONS-$(for v in $SUPPORTED_PYTHONS; do [ "$v" = "$main" ] || echo "$v"; done)}
    if [ -z "$versions" ] && [ "${IN_CI:-}" = 1 ]; then
        echo "MF_TEST_PYTHONS is empty: with CI=true every supported CPython must run" >&2
        return 1
    fi
    case "$parallel$QUICK_SHARDS" in
        '' | *[!0-9]*)
            echo "MF_TEST_PARALLEL and MF_TEST_QUICK_SHARDS must be whole numbers, not '$parallel' and '$QUICK_SHARDS'" >&2
            return 1
            ;;
    esac
    [ "$QUICK_SHARDS" -ge 1 ] || QUICK_SHARDS=1
    for ((shard = 1; shard <= QUICK_SHARDS; shard++)); do
        names+=("$main-quick-$shard")
        pythons+=(.venv/bin/python)
        parts+=(quick)
        shards+=("$shard/$QUICK_SHARDS")
    done
    # The other CPythons' virtualenvs, made side by side (pip mostly unpacks and writes).
    for version in $versions; do
        [ "$version" != "$main" ] || continue
        if ! python=$(find_python "$version"); then
            if [ "${IN_CI:-}" = 1 ]; then
                echo "CPython $version not found (python$version on PATH or a pyenv build): with CI=true that fails the run" >&2
                status=1
            else
                log "CPython $version not found: its run is skipped (it fails with CI=true)"
            fi
            continue
        fi
        make_python_venv "$version" "$python" "$extras" &
        made+=("$!")
        others+=("$version")
    done
    for ((i = 0; i < ${#made[@]}; i++)); do
        if ! wait "${made[i]}"; then
            echo "making .venv-py${others[i]} failed" >&2
            return 1
        fi
        names+=("${others[i]}")
        pythons+=(".venv-py${others[i]}/bin/python")
        parts+=(portable)
        shards+=("1/1")
    done
    [ "$parallel" -gt 0 ] || parallel=${#names[@]}
    mkdir -p "$logs"
    for ((i = 0; i < ${#names[@]}; i++)); do
        if [ "$i" -ge "$parallel" ]; then
            finish_quick_run "${names[i - parallel]}" "${pids[i - parallel]}" "$logs" || status=1
        fi
        start_quick_run "${names[i]}" "${pythons[i]}" "${parts[i]}" "${shards[i]}" "$logs" "$@"
        pids+=("$!")
    done
    for ((i = ${#names[@]} - parallel; i < ${#names[@]}; i++)); do
        [ "$i" -ge 0 ] || continue
        finish_quick_run "${names[i]}" "${pids[i]}" "$logs" || status=1
    done
    return "$status"
}

# start_quick_run NAME PYTHON PART SHARD LOGS [PYTEST ARGS]: one run in the background ($! is
# its pid), writing LOGS/pytest-pyNAME.log.
start_quick_run() {
    local name="$1" python="$2" part="$3" shard="$4" logs="$5" markers files=
    shift 5
    markers=$(part_markers "$part")
    [ "${shard#*/}" = 1 ] || files=" (test files $shard)"
    log "pytest on $("$python" --version 2>&1), the $part part$files (-m '$markers') in the background: $logs/pytest-py$name.log"
    (
        started=$SECONDS code=0
        MF_TEST_SHARD=$shard pytest_run "$python" -q -p no:cacheprovider -p tests.harness.shard \
            -m "$markers" "$@" || code=$?
        echo "(ran for $((SECONDS - started)) s)"
        exit "$code"
    ) > "$logs/pytest-py$name.log" 2>&1 &
}

# finish_quick_run NAME PID LOGS: wait for one run, print its log and a summary line.
finish_quick_run() {
    local name="$1" pid="$2" logs="$3" code=0
    wait "$pid" || code=$?
    echo "---- CPython $name ($logs/pytest-py$name.log) ----" >&2
    cat "$logs/pytest-py$name.log" >&2
    case $code in
        0)
            RUNS_WITH_TESTS=$((RUNS_WITH_TESTS + 1))
            log "CPython $name: passed ($(tail -n 1 "$logs/pytest-py$name.log" | tr -d '()'))"
            ;;
        5) log "CPython $name: no test of its part among those selected" ;;
        *)
            RUNS_WITH_TESTS=$((RUNS_WITH_TESTS + 1))
            log "CPython $name: FAILED"
            return 1
            ;;
    esac
}
