#!/usr/bin/env bash
# Check the release images' GPU paths on a real NVIDIA GPU, with or without Docker.
#
#   scripts/gpu-check-images.sh [LAYER_DIR] [OUT_DIR]
#
# LAYER_DIR holds the layer tars `modelforge-release images` wrote (build/images/layers).
# Run as root on a host with the NVIDIA driver. The layers are unpacked into root
# filesystems and, as the NVIDIA Container Toolkit would, the host's libnvidia-ml.so.1 and
# libcuda.so.1 are copied into their library directory; then, chrooted:
#   - the node agent image's preflight in nvidia mode must pass (and fail with exit 3 and
#     NVIDIA_NVML_UNAVAILABLE before the library is added);
#   - the runtime worker image's pinned CUDA runtime (libcudart.so.12) must see the GPU,
#     allocate on it and copy a buffer there and back; its `smoke` capability must pass in
#     nvidia mode (NVML on every GPU, its kernel through the injected libcuda.so.1).
# Prints a report; exits non-zero on the first check that fails.
set -uo pipefail
LAYERS=${1:-build/images/layers}
OUT=${2:-/tmp/modelforge-gpu-check}
mkdir -p "$OUT"
REPORT="$OUT/report.txt"
: >"$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }
fail() { say "FAIL: $*"; exit 1; }

say "== host"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$REPORT"
[ "$(id -u)" = 0 ] || fail "run as root (chroot and mounts)"
CHROOT=$(command -v chroot) || fail "no chroot program"
for layer in python node-agent worker cuda; do
    [ -f "$LAYERS/$layer.tar" ] || fail "$LAYERS/$layer.tar is missing"
done
library() { ldconfig -p | awk -v name="$1" '$1 == name && /x86-64/ {print $NF; exit}'; }
NVML=${NVML:-$(library libnvidia-ml.so.1)}
CUDA=${CUDA:-$(library libcuda.so.1)}
[ -n "$NVML" ] && [ -n "$CUDA" ] || fail "the host has no libnvidia-ml.so.1 / libcuda.so.1"
say "host NVML: $NVML; host CUDA driver library: $CUDA"

WORK=$(mktemp -d /tmp/modelforge-gpu-rootfs.XXXXXX)
MOUNTS=()
cleanup() {
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount "${MOUNTS[$i]}"; done
    # Never delete through a mount that is still there.
    if grep -q " $WORK/" /proc/self/mounts; then
        echo "mounts remain under $WORK; not deleting it" >&2
        return
    fi
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

# NAME LAYER...: unpack the layers in order into $WORK/NAME and set ROOT to it (not in a
# subshell: the mounts must be recorded here for the cleanup).
rootfs() {
    local root="$WORK/$1"
    shift
    mkdir -p "$root"
    for layer in "$@"; do tar -xpf "$LAYERS/$layer.tar" -C "$root" || fail "unpacking $layer"; done
    # dockerd makes these at run time; the layers have none. No bind mount of the host's
    # /dev: only copies of the nodes a container would get, and the NVIDIA devices.
    mkdir -p "$root/dev" "$root/proc" "$root/sys"
    cp -a /dev/null /dev/zero /dev/random /dev/urandom "$root/dev/" || fail "device nodes"
    cp -a /dev/nvidia* "$root/dev/" 2>/dev/null || say "no /dev/nvidia* on this host"
    mount -t proc proc "$root/proc" && MOUNTS+=("$root/proc")
    mount -t sysfs sysfs "$root/sys" && MOUNTS+=("$root/sys")
    ROOT=$root
}
inject() {  # ROOT LIBRARY: what the toolkit does, a copy in the image's library directory
    cp -L "$2" "$1/usr/lib/x86_64-linux-gnu/$(basename "$2" | sed -E 's/(\.so\.[0-9]+).*/\1/')"
}
# As the image's user, with a clean environment (set here: the images have no env program).
in_root() {
    local root=$1
    shift
    local vars=()
    while [ $# -gt 0 ] && [[ $1 == *=* ]]; do vars+=("$1"); shift; done
    env -i PATH=/usr/bin LANG=C.UTF-8 ${PASS_ENV:-} "${vars[@]}" \
        "$CHROOT" --userspec=65532:65532 "$root" /usr/bin/python3 "$@"
}

say "== node agent: preflight in nvidia mode"
rootfs agent python node-agent
AGENT=$ROOT
[ -e "$AGENT/bin/sh" ] && fail "the agent image has /bin/sh"
in_root "$AGENT" MODELFORGE_AGENT_ACCELERATOR_MODE=nvidia -m modelforge_node_agent.main --preflight >"$OUT/preflight-without.txt" 2>&1
status=$?
cat "$OUT/preflight-without.txt" >>"$REPORT"
[ "$status" = 3 ] && grep -q NVIDIA_NVML_UNAVAILABLE "$OUT/preflight-without.txt" || fail "without NVML: exit $status"
say "without the injected library: exit 3, NVIDIA_NVML_UNAVAILABLE (as expected)"
inject "$AGENT" "$NVML"
in_root "$AGENT" MODELFORGE_AGENT_ACCELERATOR_MODE=nvidia -m modelforge_node_agent.main --preflight >"$OUT/preflight-with.txt" 2>&1
status=$?
cat "$OUT/preflight-with.txt" >>"$REPORT"
[ "$status" = 0 ] || fail "with the host's NVML: exit $status"
say "with the host's libnvidia-ml.so.1: preflight passed"

say "== runtime worker: the pinned CUDA runtime on the GPU"
rootfs worker python worker cuda
WORKER=$ROOT
inject "$WORKER" "$CUDA"
inject "$WORKER" "$NVML"
cat >"$WORKER/tmp/cuda_check.py" <<'EOF'
import ctypes
cudart = ctypes.CDLL("libcudart.so.12")
def check(call, *args):
    code = getattr(cudart, call)(*args)
    if code != 0:
        raise SystemExit(f"{call} failed with CUDA error {code}")
runtime, driver, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
check("cudaRuntimeGetVersion", ctypes.byref(runtime))
check("cudaDriverGetVersion", ctypes.byref(driver))
check("cudaGetDeviceCount", ctypes.byref(count))
size = 64 << 20
host_in = (ctypes.c_ubyte * size).from_buffer_copy(bytes(range(256)) * (size // 256))
host_out = (ctypes.c_ubyte * size)()
device = ctypes.c_void_p()
check("cudaMalloc", ctypes.byref(device), ctypes.c_size_t(size))
check("cudaMemcpy", device, host_in, ctypes.c_size_t(size), 1)   # host to device
check("cudaMemcpy", host_out, device, ctypes.c_size_t(size), 2)  # device to host
check("cudaFree", device)
assert bytes(host_out) == bytes(host_in), "the round trip changed the data"
print(f"CUDA runtime {runtime.value}, driver {driver.value}, {count.value} device(s); 64 MiB round trip ok")
EOF
in_root "$WORKER" /tmp/cuda_check.py >"$OUT/cuda.txt" 2>&1
status=$?
cat "$OUT/cuda.txt" >>"$REPORT"
[ "$status" = 0 ] || fail "CUDA check: exit $status"
in_root "$WORKER" -c "import docker, pynvml, modelforge_worker; pynvml.nvmlInit(); print('worker image: NVML sees', pynvml.nvmlDeviceGetCount(), 'GPU(s)')" 2>&1 | tee -a "$REPORT"
# The worker's own smoke as the node-loss runbook runs it: NVML, then its PTX kernel through
# the injected libcuda.so.1 on every GPU.
in_root "$WORKER" -c "from modelforge_worker.capabilities import RunContext, smoke; o = smoke.run({'matrix_size': 64}, RunContext(work_id=None, timeout_seconds=120, accelerator_mode='nvidia')); print('worker image smoke:', o.outcome); print(chr(10).join(o.result['checked']))" >"$OUT/smoke.txt" 2>&1
status=$?
cat "$OUT/smoke.txt" >>"$REPORT"
[ "$status" = 0 ] || fail "the worker image's nvidia smoke: exit $status"
say "ALL GPU CHECKS PASSED"
