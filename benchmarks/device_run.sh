#!/usr/bin/env bash
# On the lent GPU machine (see README): install the carried wheels, run the GPU-marked tests, then
# the benchmark. Usage: bash benchmarks/device_run.sh [tests|bench|quick|ce|profile|tma|splits|rollout|tp|all]   (default: all)
# rollout: bench_rollout.py, with Liger's CuTe-DSL SM90 kernel where the nvidia-cutlass-dsl wheels
# were carried in two parts (.cdsl1/ on one call, .cdsl2/ on the next, the machine kept warm:
# the libs wheel is 92 MB, over one call's carry limit).
# tp: bench_tp.py: TP=N against TP=1 with the ranks sharing GPU 0 (gloo), then the timings at every
# TP degree the machine has GPUs for, with Liger's native TP loss where benchmarks/get_liger_tp.sh
# put liger-cute-kernels' Hopper core in .whl/lck_sm90.tar.xz.
# Results land in $OUT; a current one replaces benchmarks/results/<bench>_<gpu>.json (what the
# programs write by default), then `python benchmarks/report.py` regenerates benchmarks/RESULTS.md.
set -uo pipefail
what=${1:-all}
out=${OUT:-benchmarks/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1  # the DSL's .pth is not read under --target
nvidia-smi -L
if [ -f .whl/lck_sm90.tar.xz ]; then  # its libraries (CUDA 12 runtime, NVSHMEM) found by the loader
  tar -C /tmp/site -xJf .whl/lck_sm90.tar.xz || exit 1
  export LD_LIBRARY_PATH=/tmp/site/liger_cute_kernels${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NVSHMEM_REMOTE_TRANSPORT=none  # one node: NVLink only (no InfiniBand transport carried)
fi
rc=0
if [ -d .cdsl1 ]; then mkdir -p /tmp/cdsl && cp .cdsl1/* /tmp/cdsl/; fi
if [ -d .cdsl2 ] && [ -f /tmp/cdsl/cu12part.aa ]; then
  cp .cdsl2/* /tmp/cdsl/ && cat /tmp/cdsl/cu12part.aa /tmp/cdsl/cu12part.ab > /tmp/cdsl/nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
    && rm /tmp/cdsl/cu12part.* && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/cdsl/*.whl \
    && echo "nvidia-cutlass-dsl installed"
fi
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = quick ] || [ "$what" = profile ] || [ "$what" = ce ] || [ "$what" = splits ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider --full -W ignore -rs -s -m gpu tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -25 || rc=1
  timeout 300 python3 -m pytest -q -p no:cacheprovider --full -W ignore tests/test_triton_backend.py 2>&1 | tee "$out/triton_tests.log" | tail -4 || rc=1
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 300 python3 -m mcore_hooks verify --device cuda --tp 1 2>&1 | tee "$out/verify_cuda.log" | tail -3 || rc=1
fi
if [ "$what" = tma ]; then
  timeout 400 python3 benchmarks/profile_kernels.py --tma 2>&1 | tee "$out/profile_tma.log" || rc=1
fi
if [ "$what" = splits ]; then
  timeout 420 python3 benchmarks/profile_kernels.py --splits 2>&1 | tee "$out/splits.log" || rc=1
fi
if [ "$what" = ce ] || [ "$what" = all ]; then
  timeout 300 python3 benchmarks/profile_kernels.py --ce 2>&1 | tee "$out/profile_ce.log" || rc=1
fi
if [ "$what" = profile ]; then
  timeout 400 python3 benchmarks/profile_kernels.py 2>&1 | tee "$out/profile.log" || rc=1
fi
if [ "$what" = rollout ]; then
  timeout 540 python3 benchmarks/bench_rollout.py 2>&1 | tee "$out/bench_rollout.log" | grep -v '^{' | tail -60 || rc=1
fi
if [ "$what" = tp ]; then
  timeout 240 python3 benchmarks/bench_tp.py --emulate --check-only --tp 2 4 --out "$out/tp_check" --json "$out/tp_check/tp.json" 2>&1 | tee "$out/tp_check.log" | grep -v '^{' | tail -50 || rc=1
  timeout 540 python3 benchmarks/bench_tp.py --out "$out/tp" --json "$out/tp/tp.json" 2>&1 | tee "$out/tp.log" | grep -v '^{' | tail -40 || rc=1
fi
if [ "$what" = invariance ]; then
  shapes=("4096 151936 1024 4096 16384 65536" "8192 128256 1024 4096 32768")
  [ -n "${SHAPE:-}" ] && shapes=("$SHAPE")  # one of them: "H V tokens..."
  for shape in "${shapes[@]}"; do
    read -r h v tokens <<< "$shape"
    trees="new"; [ -d .whl/old/mcore_hooks ] && trees="old new"
    for tree in $trees; do
      path=$PWD; [ "$tree" = old ] && path=$PWD/.whl/old
      PYTHONPATH=/tmp/site:$path timeout -k 5 280 python3 benchmarks/profile_invariant.py --hidden "$h" --vocab "$v" \
        --tokens $tokens --sections time,policytime --tag "_${tree}_$h" --out "$out" 2>&1 | tee "$out/invariance_${tree}_$h.log" || rc=1
    done
  done
fi
if [ "$what" = sweep ]; then
  timeout -k 5 560 python3 benchmarks/bench_sweep.py --section entry --vocab ${VOCAB:-151936} \
    --tokens ${TOKENS:-256 512 2048 8192} --json "$out/sweep_${VOCAB:-151936}.json" 2>&1 | grep '|' | tee "$out/sweep.md" || rc=1
fi
if [ "$what" = step ]; then
  timeout -k 5 560 python3 benchmarks/bench_step.py --gpus ${GPUS:-4} --shape ${SHAPE:-0.5b} \
    --json "$out/step_${SHAPE:-0.5b}.json" 2>&1 | grep '^|\|FAILED' | tee "$out/step.md" || rc=1
fi
if [ "$what" = e2e ]; then
  timeout -k 5 580 python3 benchmarks/bench_e2e.py --tokens 8192 16384 --dp 8 --json "$out/e2e.json" 2>&1 | tee "$out/e2e.log" || rc=1
fi
if [ "$what" = quick ]; then
  timeout 400 python3 benchmarks/bench_postprocess.py --quick --tp2 --json "$out/postprocess.json" 2>&1 | tee "$out/bench.log" | grep -v '^{' | tail -40 || rc=1
elif [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 560 python3 benchmarks/bench_postprocess.py --tp2 --rep-ms 400 --json "$out/postprocess.json" 2>&1 | tee "$out/bench.log" | grep -v '^{' | tail -60 || rc=1
fi
exit $rc
