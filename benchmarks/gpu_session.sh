#!/usr/bin/env bash
# The GPU measurements of the README, in parts that each fit one device call (600 s).
# On this machine first:  bash ../shared/gpu/prepare.sh
#   python3 -m pip download -q --no-deps -d .gpu/wheels pytest pluggy iniconfig
# Then one device call per part, with carry [".gpu"]:
#   source .gpu/on-device.sh && bash benchmarks/gpu_session.sh PART
# PART: tests (the suite's cuda tests), profile (kernels, host reads, syncs and step
# times of the MLP and 3c3d), memory (critical batch of 3c3d under 11 GiB, step cost
# with peak memory), fmnist_2c2d (time to target: DampedNewton's default against Adam at
# its tuned lr 1e-3, 4000 steps, 3 seeds). Results go to $OUT (the device's returned folder).
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
case "${1:-}" in
  tests)
    timeout 560 python3 -m pytest -q -m cuda -p no:cacheprovider tests >"$out/cuda-tests.txt" 2>&1
    tail -5 "$out/cuda-tests.txt" ;;
  profile)
    timeout 560 python3 -m benchmarks.micro.step_profile --models mlp 3c3d --ggn mc1 exact \
      >"$out/profile.md" 2>&1
    cat "$out/profile.md" ;;
  memory)
    timeout 300 python3 -m benchmarks.micro.critical_batch --model 3c3d >"$out/critical.md" 2>&1
    timeout 260 python3 -m benchmarks.micro.step_cost --models mlp 3c3d --ggn mc1 exact \
      --memory --skip-materialized >"$out/step_cost.txt" 2>&1
    cat "$out/critical.md" "$out/step_cost.txt" ;;
  fmnist_2c2d)
    common=(+sweep=gpu_fmnist_2c2d problem.eval_every=100 grid=null grid_point=null seed=0,1,2)
    timeout 150 python3 -m benchmarks.run --multirun "${common[@]}" optimizer=adam \
      optimizer.lr=0.001 hydra.sweep.dir="$out/adam" >"$out/adam.txt" 2>&1
    timeout 400 python3 -m benchmarks.run --multirun "${common[@]}" optimizer=dampednewton \
      hydra.sweep.dir="$out/dampednewton" >"$out/dampednewton.txt" 2>&1
    tail -4 "$out/adam.txt" "$out/dampednewton.txt" ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh tests|profile|memory|fmnist_2c2d" >&2
    exit 2 ;;
esac
