# Sourced by scripts/test: the parts of the suite that run on every supported CPython, and
# the host set-up the Debian-root tests need (tests/packaging/test_debian_hosts.py).
#
# MF_TEST_PYTHONS lists the extra CPython versions (default: every supported one but that of
# .venv, which the main run covers: "3.10 3.12 3.13" where .venv is 3.11). Each is looked up
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

# run_other_pythons EXTRAS [PYTEST ARGS]: install the project with EXTRAS into .venv-pyX.Y and
# run the quick part of the suite on each extra CPython: everything but the tests marked slow
# (the main run has them), docker (image builds: dockerd does the work, not Python) or browser
# (the console's pages are the same whatever Python serves them).
QUICK_MARKERS="not slow and not docker and not browser"
# Prints one summary line per version; returns non-zero when any run failed or, with
# CI=true, when a version is missing.
run_other_pythons() {
    local extras="$1" version python venv stamp want status=0 started main versions
    shift
    main=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    versions=${MF_TEST_PYTHONS-$(for v in $SUPPORTED_PYTHONS; do [ "$v" = "$main" ] || echo "$v"; done)}
    if [ -z "$versions" ] && [ "${IN_CI:-}" = 1 ]; then
        echo "MF_TEST_PYTHONS is empty: with CI=true every supported CPython must run" >&2
        return 1
    fi
    for version in $versions; do
        if ! python=$(find_python "$version"); then
            if [ "${IN_CI:-}" = 1 ]; then
                echo "CPython $version not found (python$version on PATH or a pyenv build): with CI=true that fails the run" >&2
                status=1
            else
                log "CPython $version not found: its run is skipped (it fails with CI=true)"
            fi
            continue
        fi
        venv=".venv-py$version"
        stamp="$venv/.modelforge-installed"
        want="$(sha256sum pyproject.toml setup.cfg | sha256sum | cut -c1-16) $extras"
        if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
            log "making $venv with $("$python" --version 2>&1)"
            rm -rf "$venv"
            "$python" -m venv "$venv"
            "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
                -e ".[$extras]" 2> >(grep -v '^WARNING: Location' >&2)
            echo "$want" > "$stamp"
        fi
        log "pytest on $("$venv/bin/python" --version 2>&1) (-m '$QUICK_MARKERS')"
        started=$SECONDS
        set +e
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "$QUICK_MARKERS" "$@"
        case $? in
            0) log "CPython $version: passed in $((SECONDS - started)) s" ;;
            5) log "CPython $version: no quick test among those selected" ;;
            *) log "CPython $version: FAILED"; status=1 ;;
        esac
        set -e
    done
    return "$status"
}
