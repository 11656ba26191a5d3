#!/usr/bin/env bash
# Re-lock packaging/requirements-*.txt from the *.in files: exact versions and the
# SHA-256 of every file PyPI publishes for them (all platforms), so the pyz builds can
# install with --require-hashes. Run after changing a pin in pyproject.toml or a *.in file;
# needs network access to PyPI. Local pip configuration (mirrors, find-links) is ignored
# on purpose so that the hashes are PyPI's.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(mktemp -d /tmp/modelforge-lock.XXXXXX)
trap 'rm -rf "$tools"' EXIT
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
python3 -m venv "$tools"
"$tools/bin/pip" install --quiet pip-tools==7.6.2
export CUSTOM_COMPILE_COMMAND="packaging/lock.sh"
for name in appliance agent build worker worker-cuda; do
    "$tools/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
        --no-emit-index-url \
        --output-file "packaging/requirements-$name.txt" "packaging/requirements-$name.in"
done
