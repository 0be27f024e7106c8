#!/usr/bin/env bash
# Run from the project root on this (CPU) machine, after ../shared/gpu/get-wheels.sh. Puts what
# Liger's native tensor-parallel loss (LigerFusedLinearScaledCrossEntropyTPFunction) needs on a
# Hopper GPU machine into ./.whl, under the device tool's 64 MiB carry limit:
#   - apache-tvm-ffi (a cp312 wheel);
#   - lck_sm90.tar.xz: liger-cute-kernels 0.8.5's Python files and its sm90a core only (the wheel is
#     81 MB: the MoE cubin and the Blackwell core are dropped), with NVSHMEM 3.6.5's host and
#     unique-id bootstrap libraries beside it, where the package looks first (the NVSHMEM wheel
#     is 72 MB; its device bitcode and transports are not needed on one node), and the CUDA 12
#     runtime its release build links (libcudart.so.12; torch on the GPU machine is CUDA 13).
# benchmarks/device_run.sh unpacks it into the install target and puts it on LD_LIBRARY_PATH.
set -euo pipefail
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "$2" 2>&1 | { grep -v -i warn || true; }
}
dl .whl "apache-tvm-ffi==0.1.15.post2"  # the version liger-cute-kernels 0.8.5 ran with here
dl "$tmp" "liger-cute-kernels==0.8.5"
dl "$tmp" "nvidia-nvshmem-cu12==3.6.5"
dl "$tmp" "nvidia-cuda-runtime-cu12==12.9.*"
mkdir -p "$tmp/pack/liger_cute_kernels"
unzip -q -o -j "$tmp"/liger_cute_kernels-*.whl 'liger_cute_kernels/*.py' \
  'liger_cute_kernels/libliger_cute_kernels_sm90a.so' -d "$tmp/pack/liger_cute_kernels"
unzip -q -o -j "$tmp"/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' \
  -d "$tmp/pack/liger_cute_kernels"
unzip -q -o -j "$tmp"/nvidia_nvshmem_cu12-*.whl 'nvidia/nvshmem/lib/libnvshmem_host.so.3' \
  'nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3' -d "$tmp/pack/liger_cute_kernels"
tar -C "$tmp/pack" -cJf .whl/lck_sm90.tar.xz liger_cute_kernels
ls -la .whl
