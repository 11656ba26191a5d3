# Sourced by scripts/run and scripts/test: make ./.venv with the pinned dependencies.
# Usage: ensure_venv EXTRAS   (e.g. "appliance" or "appliance,agent,test")
ensure_venv() {
    local extras="$1" py stamp want
    py=${MODELFORGE_PYTHON:-$(command -v python3)}
    if ! "$py" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))'; then
        echo "modelforge: CPython 3.10 to 3.13 is required (found $("$py" --version 2>&1))" >&2
        return 2
    fi
    if [ ! -x .venv/bin/python ]; then
        echo "==> creating .venv with $("$py" --version)" >&2
        "$py" -m venv .venv
    fi
    stamp=.venv/.modelforge-installed
    want="$(sha256sum pyproject.toml setup.cfg | sha256sum | cut -c1-16) $extras"
    if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
        echo "==> installing pinned dependencies ($extras) into .venv" >&2
        .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]" \
            2> >(grep -v '^WARNING: Location' >&2)
        echo "$want" >> "$stamp"
    fi
}
