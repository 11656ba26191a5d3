#!/usr/bin/env bash
# On a host with an NVIDIA GPU, its driver and the CUDA toolkit (nvcc): llama.cpp's
# llama-server built for CUDA by scripts/llama-server-build --cuda, the tests' tiny GGUF
# (tests/harness/tiny_gguf.py) served fully offloaded (-ngl 99) on 127.0.0.1, /health, a
# greedy completion non-streamed and streamed, the offload lines of the server's log and
# its tokens/s. Needs python3 (3.10-3.13) with numpy and the gguf package: found by that
# python3, else in this checkout's .venv, else installed with pip into OUT_DIR/py.
#
#   scripts/gpu-check-serve.sh [OUT_DIR]
#
# MF_LLAMA_CUDA_ARCHITECTURES (default "native": only this host's GPUs, a much shorter
# compile than ggml's whole list) goes to CMAKE_CUDA_ARCHITECTURES. MF_GPU_CHECK_LLAMA_SERVER
# names a binary to use instead of building one.
# Prints a report (also OUT_DIR/gpu-check-serve.txt); exits 1 when a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT:-/tmp/modelforge-gpu-check}}
mkdir -p "$OUT"
REPORT="$OUT/gpu-check-serve.txt"
: >"$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }
fail() {
    say "FAILED: $*"
    exit 1
}

PY=$(command -v python3 || true)
[ -n "$PY" ] || fail "python3 is not installed on this host"
if ! "$PY" -c 'import gguf, numpy' 2>/dev/null; then
    if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
        PY="$ROOT/.venv/bin/python"
    else
        gguf_pin=$(grep -o '"gguf==[^"]*"' "$ROOT/pyproject.toml" | tr -d '"')
        say "installing ${gguf_pin:-gguf} into $OUT/py"
        "$PY" -m pip install --quiet --target "$OUT/py" "${gguf_pin:-gguf}" >>"$REPORT" 2>&1 ||
            fail "pip install ${gguf_pin:-gguf} failed"
        export PYTHONPATH="$OUT/py${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

say "== host"
say "$(uname -srm)"
say "$(nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv 2>&1 | head -n 9)"
say "nvcc: $( (command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null) | head -n 1)"

if [ -n "${MF_GPU_CHECK_LLAMA_SERVER:-}" ]; then
    # a binary already built (a dry run of this script elsewhere, or a rerun)
    BIN=$MF_GPU_CHECK_LLAMA_SERVER
    say "== binary given: $BIN"
else
    say "== build: scripts/llama-server-build --cuda"
    export MF_LLAMA_CUDA_ARCHITECTURES=${MF_LLAMA_CUDA_ARCHITECTURES:-native}
    began=$(date +%s)
    BIN=$(scripts/llama-server-build --cuda 2>"$OUT/llama-server-build.log") || {
        tail -n 40 "$OUT/llama-server-build.log" | tee -a "$REPORT"
        fail "scripts/llama-server-build --cuda failed (log: $OUT/llama-server-build.log)"
    }
    say "binary: $BIN ($(($(date +%s) - began))s, CMAKE_CUDA_ARCHITECTURES=$MF_LLAMA_CUDA_ARCHITECTURES)"
fi
[ -f "$(dirname "$BIN")/build-info.txt" ] && tee -a "$REPORT" <"$(dirname "$BIN")/build-info.txt"
if ldd "$BIN" | grep -q "not found"; then
    # the CUDA runtime and cuBLAS are the toolkit's shared libraries
    nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null | head -n 1)
    export LD_LIBRARY_PATH="$(dirname "$(dirname "$nvcc")")/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi
ldd "$BIN" 2>&1 | grep -E "cuda|cublas|not found" | tee -a "$REPORT"
"$BIN" --version 2>&1 | tee -a "$REPORT"

say "== serve the tiny GGUF, fully offloaded"
MODEL="$OUT/tiny.gguf"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import sys, time
from tests.harness.tiny_gguf import write_tiny_gguf
began = time.monotonic()
path = write_tiny_gguf(sys.argv[1])
print(f"{path}: {path.stat().st_size} bytes in {time.monotonic() - began:.2f}s")
' "$MODEL" 2>&1 | tee -a "$REPORT"
[ "${PIPESTATUS[0]}" = 0 ] || fail "writing the tiny GGUF failed"

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG="$OUT/llama-server.log"
launched=$("$PY" -c 'import time; print(time.monotonic())')
"$BIN" -m "$MODEL" --host 127.0.0.1 --port "$PORT" --alias tiny -c 256 -ngl 99 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT

"$PY" - "$PORT" "$SERVER" "$launched" <<'PYEOF' 2>&1 | tee -a "$REPORT"
import json
import os
import sys
import time
import urllib.error
import urllib.request

port, pid, launched = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 120
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as answer:
            if answer.status == 200:
                break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("llama-server exited before /health answered 200")
    if time.monotonic() > deadline:
        sys.exit("/health did not answer 200 within 120s")
    time.sleep(0.02)
print(f"/health 200 after {(time.monotonic() - launched) * 1000:.0f} ms")


def post(path, body, stream=False):
    request = urllib.request.Request(
        base + path,
        data=json.dumps({**body, "stream": stream}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        if not stream:
            return json.loads(answer.read())
        return [
            json.loads(line[6:])
            for line in (raw.decode().strip() for raw in answer)
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


greedy = {"prompt": "the model", "max_tokens": 64, "temperature": 0, "top_k": 1, "seed": 42}
first = post("/v1/completions", greedy)
second = post("/v1/completions", greedy)
text = first["choices"][0]["text"]
print(f"completion: {text!r}")
print(f"usage: {first.get('usage')}")
timings = first.get("timings") or {}
if timings:
    print(
        f"prompt {timings.get('prompt_per_second', 0):.0f} tokens/s, "
        f"generation {timings.get('predicted_per_second', 0):.0f} tokens/s"
    )
streamed = "".join(
    event["choices"][0].get("text", "") for event in post("/v1/completions", greedy, stream=True)
)
chat = post(
    "/v1/chat/completions",
    {"messages": [{"role": "user", "content": "the model"}], "max_tokens": 16, "temperature": 0},
)
print(f"chat: {chat['choices'][0]['message']['content']!r}")
problems = []
if not text:
    problems.append("the completion is empty")
if second["choices"][0]["text"] != text:
    problems.append("two greedy completions differ")
if streamed != text:
    problems.append(f"the streamed completion differs: {streamed!r}")
for problem in problems:
    print(f"FAILED: {problem}")
sys.exit(1 if problems else 0)
PYEOF
status=${PIPESTATUS[0]}

say "== offload (from $LOG)"
grep -E "offload|CUDA|using device|model buffer size|KV buffer|compute buffer" "$LOG" | head -n 30 | tee -a "$REPORT"
offload=$(grep -oE "offloaded [0-9]+/[0-9]+ layers to GPU" "$LOG" | head -n 1)
layers=${offload#offloaded }
layers=${layers%% *}
if [ -z "$offload" ]; then
    say "FAILED: the log does not say the layers were offloaded to the GPU"
    status=1
elif [ "${layers%/*}" != "${layers#*/}" ]; then
    say "FAILED: not every layer was offloaded ($offload)"
    status=1
fi
if [ "$status" = 0 ]; then
    say "== passed"
else
    say "== failed"
    tail -n 30 "$LOG" >>"$REPORT"
fi
exit "$status"
