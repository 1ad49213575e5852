#!/usr/bin/env bash
# The GPU measurements of the README, in parts that each fit one device call (600 s).
# On this machine first:  bash ../shared/gpu/prepare.sh
#   python3 -m pip download -q --no-deps -d .gpu/wheels pytest pluggy iniconfig
# Then one device call per part, with carry [".gpu"]:
#   source .gpu/on-device.sh && bash benchmarks/gpu_session.sh PART
# PART: tests (the suite's cuda tests), profile (kernels, host reads, syncs and step
# times of the MLP and 3c3d), memory (critical batch of 3c3d under 11 GiB, step cost
# with peak memory). Results go to $OUT (the device's returned folder).
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
case "${1:-}" in
  tests)
    timeout 560 python3 -m pytest -q -m cuda -p no:cacheprovider tests >"$out/cuda-tests.txt" 2>&1
    tail -5 "$out/cuda-tests.txt" ;;
  profile)
    timeout 560 python3 -m benchmarks.step_profile --models mlp 3c3d --ggn mc1 exact \
      >"$out/profile.md" 2>&1
    cat "$out/profile.md" ;;
  memory)
    timeout 300 python3 -m benchmarks.critical_batch --model 3c3d >"$out/critical.md" 2>&1
    timeout 260 python3 -m benchmarks.step_cost --models mlp 3c3d --ggn mc1 exact \
      --memory --skip-materialized >"$out/step_cost.txt" 2>&1
    cat "$out/critical.md" "$out/step_cost.txt" ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh tests|profile|memory" >&2
    exit 2 ;;
esac
