#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the GPU benchmarks need beyond the device image's packages, into
# .whl/ (ignored by git through .git/info/exclude), for a device call that carries them:
#   bash benchmarks/gpu_wheels.sh            # ~17 MB: transformers/trl as CI pins them, datasets, liger-kernel,
#                                            # titans-pytorch and their dependencies missing from the image
#   bash benchmarks/gpu_wheels.sh --bnb      # + bitsandbytes (the adamw_bnb_8bit peer of `run_gpu.sh forge`; ~60 MB,
#                                            # near the 64 MiB a call may carry)
#   bash benchmarks/gpu_wheels.sh --bnb-only # bitsandbytes alone, into .whl_bnb/: a second call on the warm machine
#                                            # (run_gpu.sh bnb), where the first call's /tmp/site is still installed
# The device call then begins with (see benchmarks/run_gpu.sh):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
set -eu
cd "$(dirname "$0")/.."
dest=.whl
[[ "${1:-}" == "--bnb-only" ]] && dest=.whl_bnb
grep -qx "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
mkdir -p "$dest"
pkgs=(transformers==5.24.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5
      titans-pytorch==0.5.5 assoc-scan==0.0.6 accelerated-scan==0.3.1 axial-positional-embedding==0.3.12 einx==0.4.3
      frozendict==2.5.1 hyper-connections==0.4.11 torch-einops-utils==0.2.0 rotary-embedding-torch==0.9.1
      tensordict==0.15.3 pyvers==0.2.3 x-transformers==2.31.10 loguru==0.7.3)
[[ "${1:-}" == "--bnb" ]] && pkgs+=(bitsandbytes==0.50.2)
[[ "${1:-}" == "--bnb-only" ]] && pkgs=(bitsandbytes==0.50.2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dest" "${pkgs[@]}"
du -sh "$dest"
