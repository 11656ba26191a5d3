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
# huggingface-hub's hf-xet (an 11 MB native module per machine) serves only its Xet storage
# transfers; `models pull` downloads through the hub's HTTP routes alone, and the pyz builds
# install the lock with --no-deps, so the appliance archive is built without it.
"$tools/bin/python" - packaging/requirements-appliance.txt <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
block = r"hf-xet==[0-9.]+ \\\n(    --hash=sha256:[0-9a-f]+ \\\n)*    --hash=sha256:[0-9a-f]+\n(    # via .*\n)*"
open(path, "w").write(re.sub(block, "", text))
PY
