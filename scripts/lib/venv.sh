# Sourced by scripts/run and scripts/test: make ./.venv with the pinned dependencies.
# Usage: ensure_venv EXTRAS   (e.g. "appliance,agent" or "appliance,agent,test")
# A virtualenv already holding more extras for the same pyproject.toml is reused
# as it is: scripts/run after scripts/test installs nothing.
ensure_venv() {
    local extras="$1" py stamp hash
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
    hash=$(pyproject_hash)
    if ! venv_has_extras "$stamp" "$hash" "$extras"; then
        echo "==> installing pinned dependencies ($extras) into .venv" >&2
        .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]" \
            2> >(grep -v '^WARNING: Location' >&2)
        echo "$hash $extras" >> "$stamp"
    fi
}

# venv_has_extras STAMP HASH EXTRAS: a line of STAMP has HASH and every one of EXTRAS.
venv_has_extras() {
    local stamp="$1" hash="$2" wanted="$3" line_hash line_extras extra missing
    [ -f "$stamp" ] || return 1
    while read -r line_hash line_extras; do
        [ "$line_hash" = "$hash" ] || continue
        missing=0
        for extra in ${wanted//,/ }; do
            case ",$line_extras," in *",$extra,"*) ;; *) missing=1 ;; esac
        done
        [ "$missing" = 0 ] && return 0
    done < "$stamp"
    return 1
}

# pyproject_hash: what a virtualenv's stamp records of pyproject.toml (its pins and extras).
pyproject_hash() {
    sha256sum pyproject.toml | sha256sum | cut -c1-16
}
