#!/usr/bin/env bash
# The GPU measurements of the README in one device call (a session is lent ~15 minutes
# of device time, a call at most 600 s).
# On this machine first:  bash ../shared/gpu/prepare.sh
#   python3 -m pip download -q --no-deps -d .gpu/wheels pytest pluggy iniconfig \
#     pytorch-optimizer   # the peers SOAP and PSGD-Kron in the profile
# Then one device call with carry [".gpu"]:
#   source .gpu/on-device.sh && bash benchmarks/gpu_session.sh all
# or name the parts to run, in order: bash benchmarks/gpu_session.sh PART [PART ...]
# PART: profile (kernels, host reads, syncs and step times of the MLP and 3c3d),
# fmnist_2c2d (time to target: DampedNewton's default against Adam over 3e-4, 1e-3,
# 3e-3, 4000 steps, 3 seeds; the grid's fastest run per seed), tests (the suite's cuda
# tests), memory (critical batch of 3c3d under 11 GiB, step cost with peak memory).
# `all` runs them in that order (most wanted first). The parts share BUDGET seconds
# (default 540): each part stops at its own cap or when the budget runs out, and
# writes its results to $OUT (the device's returned folder) as it goes, so a part cut
# short still returns what it finished.
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
deadline=$((SECONDS + ${BUDGET:-540}))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__)" >>"$out/gpu.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >>"$out/gpu.txt"

# run CAP LOG COMMAND...: COMMAND under the smaller of CAP and the budget left.
run() {
  local cap=$1 log=$2 left=$((deadline - SECONDS - 5))
  shift 2
  if ((left < 20)); then
    echo "skipped: budget spent" >"$log"
    return 0
  fi
  timeout $((cap < left ? cap : left)) "$@" >"$log" 2>&1
  echo "exit $? after $((SECONDS))s: $*" >>"$out/parts.txt"
}

part() {
  case "$1" in
    profile)
      local peers=()
      python3 -c "import pytorch_optimizer" 2>/dev/null && peers=(--peers soap kron)
      run 150 "$out/profile.md" python3 -m benchmarks.micro.step_profile \
        --models mlp 3c3d --ggn mc1 exact "${peers[@]}"
      cat "$out/profile.md" ;;
    fmnist_2c2d)
      local common=(+sweep=gpu_fmnist_2c2d problem.eval_every=100 grid=null
        grid_point=null seed=0,1,2)
      run 170 "$out/adam.txt" python3 -m benchmarks.run --multirun "${common[@]}" \
        optimizer=adam optimizer.lr=0.0003,0.001,0.003 hydra.sweep.dir="$out/adam"
      run 240 "$out/dampednewton.txt" python3 -m benchmarks.run --multirun \
        "${common[@]}" optimizer=dampednewton hydra.sweep.dir="$out/dampednewton"
      tail -4 "$out/adam.txt" "$out/dampednewton.txt" ;;
    tests)
      run 200 "$out/cuda-tests.txt" python3 -m pytest -q -m cuda -p no:cacheprovider tests
      tail -5 "$out/cuda-tests.txt" ;;
    memory)
      run 150 "$out/critical.md" python3 -m benchmarks.micro.critical_batch --model 3c3d
      run 120 "$out/step_cost.txt" python3 -m benchmarks.micro.step_cost \
        --models mlp 3c3d --ggn mc1 exact --memory --skip-materialized
      cat "$out/critical.md" "$out/step_cost.txt" ;;
    *)
      echo "usage: bash benchmarks/gpu_session.sh all | PART [PART ...]" \
        "(PART: profile fmnist_2c2d tests memory)" >&2
      exit 2 ;;
  esac
}

(($#)) || part usage
parts=("$@")
[[ "$1" == all ]] && parts=(profile fmnist_2c2d tests memory)
for name in "${parts[@]}"; do
  part "$name"
done
