#!/usr/bin/env bash
# Run from the project root on this (CPU) machine. Puts into ./.whlverl (kept out of git via
# .git/info/exclude) all that benchmarks/bench_verl.py needs on the GPU machine beside the
# image's torch, triton, numpy and pytest (23 MB; the device tool's carry limit is 64 MiB):
#   - megatron-core's wheel, copied from .whl/ (downloaded if absent): .whl/ holds other
#     benchmarks' large files, so .whlverl is the one folder this benchmark carries;
#   - verl 0.9.1's sdist, where tests/test_verl_series.py's _sdist() looks for it
#     ($MCORE_HOOKS_CI_CACHE/verl-sdist/), copied from this machine's cache (downloaded if absent);
#   - verl-0.9.1-patched.tar.gz: the sdist with upstream/verl/*.patch applied by git apply, for a
#     machine without git (the benchmark applies the series itself where git is there), and the
#     series' sha256 it was made from (the benchmark refuses a stale one);
#   - the wheels of what verl's Megatron engine imports, at the versions the CPU test runs with, so
#     that the carried set, first on PYTHONPATH, does not depend on the image (whose transformers
#     5.17 is outside verl 0.9.1's <5.11, its tokenizers 0.23.2 outside transformers 5.8.1's
#     <=0.23.0). Not carried: what only the verl modules the benchmark stands in for import
#     (its STAND_INS: datasets with pandas and pyarrow, peft, accelerate, pillow).
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vt .whlverl/*.whl
set -euo pipefail
mkdir -p .whlverl/verl-sdist .git/info
grep -qx '/.whlverl/' .git/info/exclude 2>/dev/null || echo '/.whlverl/' >> .git/info/exclude
PY=${PY:-.venv312/bin/python}  # has the sdist helpers' imports (pytest, torch, megatron-core)
MCORE=${MCORE:-0.19.2}
reqs=(
  "megatron-core==${MCORE}"
  # verl.protocol, verl.utils.tensordict_utils: the micro-batch is a TensorDict
  "tensordict==0.10.0" "cloudpickle==3.1.3" "orjson==3.13.0" "pyvers==0.1.0"
  # verl.utils.config and the engine's configs
  "omegaconf==2.3.1" "PyYAML==6.0.4"
  # verl.utils.profiler.performance
  "codetiming==1.4.0"
  # verl.utils.torch_functional and most of verl import transformers; its import-time needs
  "transformers==5.8.1" "huggingface_hub==1.33.0" "tokenizers==0.22.2" "safetensors==0.8.0"
  "regex==2026.11.19" "tqdm==4.70.1" "httpx==0.28.1" "httpcore==1.0.9" "h11==0.16.0" "anyio==4.16.0"
  "idna==3.20" "certifi==2026.10.19.post1" "typing_extensions==4.16.0" "click==8.5.1"
)
find .whlverl -name "megatron_core-*" ! -name "megatron_core-${MCORE}-*" -delete
cp .whl/megatron_core-"${MCORE}"-*.whl .whlverl/ 2>/dev/null || true
for r in "${reqs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whlverl "$r" 2>&1 | { grep -v -i warn || true; }
done
# omegaconf 2.3 pins antlr4-python3-runtime 4.9.*, published as an sdist only: a pure-Python wheel
ls .whlverl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
  python3 -m pip wheel -q --no-deps -w .whlverl "antlr4-python3-runtime==4.9.3" 2>&1 | { grep -v -i warn || true; }
# the sdist (sha256-checked by the test's helper) and the patched tree
MCORE_HOOKS_CI_CACHE=${MCORE_HOOKS_CI_CACHE:-$HOME/.cache/mcore-hooks-ci} "$PY" - <<'EOF'
import shutil, sys, tarfile, tempfile
from pathlib import Path
sys.path[:0] = ["benchmarks", "tests"]
import bench_verl as b
sdist = b.series._sdist()
shutil.copy(sdist, Path(".whlverl/verl-sdist") / sdist.name)
with tempfile.TemporaryDirectory() as tmp:
    tree = b.patched_tree(Path(tmp), use_git=True)
    with tarfile.open(b.PATCHED_TAR, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    b.PATCHED_STAMP.write_text(b.series_digest() + "\n")
EOF
ls -la .whlverl .whlverl/verl-sdist
du -cb .whlverl/*.whl .whlverl/*.tar.gz .whlverl/verl-sdist/* | tail -1
