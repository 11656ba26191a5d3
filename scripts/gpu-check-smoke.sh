#!/usr/bin/env bash
# On a host with an NVIDIA GPU and its driver: the node agent's fail-closed preflight in
# nvidia mode and the runtime worker's `smoke` (an NVML query of every GPU, then saxpy over
# a million floats through libcuda, checked element by element), straight from this source
# tree. Needs python3 (3.10-3.13) and pynvml (nvidia-ml-py): found on the path, else in
# PYNVML_DIR (a folder holding pynvml.py), else in this checkout's .venv.
#
#   scripts/gpu-check-smoke.sh [OUT_DIR]
#
# Prints a report (also OUT_DIR/gpu-check-smoke.txt); exits 1 when either check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT:-/tmp/modelforge-gpu-check}}
mkdir -p "$OUT"
PY=$(command -v python3 || true)
if [ -z "$PY" ]; then
    echo "python3 is not installed on this host" >&2
    exit 1
fi
extra=${PYNVML_DIR:-}
if [ -z "$extra" ] && ! "$PY" -c 'import pynvml' 2>/dev/null; then
    extra=$(ls -d "$ROOT"/.venv/lib/python3.*/site-packages 2>/dev/null | head -n 1)
fi
export PYTHONPATH="$ROOT/contract:$ROOT/worker:$ROOT/agent${extra:+:$extra}"
{
    echo "== host"
    uname -srm
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 | head -n 9
    echo "python: $("$PY" --version 2>&1)"
    "$PY" - <<'PYEOF'
import json
import sys
import tempfile
import time

from modelforge_node_agent.nvidia import run_preflight
from modelforge_node_agent.settings import load_settings
from modelforge_worker.capabilities import CapabilityFailure, RunContext, smoke

failed = False
print("== agent preflight, nvidia mode")
settings = load_settings({
    "MODELFORGE_AGENT_CONTROL_PLANE_URL": "http://127.0.0.1:8000",
    "MODELFORGE_AGENT_ACCELERATOR_MODE": "nvidia",
    "MODELFORGE_AGENT_STATE_VOLUME": tempfile.mkdtemp(),
})
began = time.monotonic()
try:
    result = run_preflight(settings)
    print(f"passed in {time.monotonic() - began:.2f}s: {result.summary()}")
    print(json.dumps(result.accelerators, indent=1, default=str))
except Exception as failure:  # the report says what failed, whatever it was
    failed = True
    print(f"FAILED: {type(failure).__name__}: {failure}")
print("== worker smoke, nvidia mode")
began = time.monotonic()
try:
    outcome = smoke.run(
        {"matrix_size": 64},
        RunContext(work_id=None, timeout_seconds=150, accelerator_mode="nvidia"),
    )
    print(f"{outcome.outcome} in {time.monotonic() - began:.2f}s")
    print("\n".join(outcome.result["checked"]))
    print(json.dumps([gpu.get("compute") for gpu in outcome.result.get("gpus", [])], indent=1))
except CapabilityFailure as failure:
    failed = True
    print(f"FAILED: {failure}")
sys.exit(1 if failed else 0)
PYEOF
} 2>&1 | tee "$OUT/gpu-check-smoke.txt"
exit "${PIPESTATUS[0]}"
