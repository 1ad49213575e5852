#!/usr/bin/env bash
# The GPU measurements of the README in device calls (a session is lent ~15 minutes
# of device time, a call at most 600 s).
# On this machine first:  bash ../shared/gpu/prepare.sh
#   python3 -m pip download -q --no-deps -d .gpu/wheels pytorch-optimizer
#   (the peers SOAP and PSGD-Kron; the device's own pytest runs the tests)
# Then a device call with carry [".gpu"]:
#   source .gpu/on-device.sh && bash benchmarks/gpu_session.sh all
# or name the parts to run, in order: bash benchmarks/gpu_session.sh PART [PART ...]
# PART:
#   checks: the suite's cuda tests beside the critical batches of 3c3d under 11 GiB
#     of the defaults and SGD (neither is timed); tests: the cuda tests alone;
#   profile: kernels, host reads, syncs and step times of the MLP and 3c3d (on the
#     H100 150 s with the peers);
#   phases: the defaults' step between refreshes, refresh and rotating refresh apart
#     (time, kernels, syncs, busy time of each);
#   step_parts: where the kernels of a step between refreshes and of a rotating
#     refresh go, part by part of the pipeline (the MLP and 3c3d; 25 s on the H200);
#   refresh_pass: the refreshes through torch.autograd.grad against BackPACK's pass;
#   graph_memory: the memory the CUDA default's graphs hold, early and late in a run,
#     and its peak, against the packed and the per-layer step;
#   solvers: eigh and QR of the refreshes' shapes on the device and on the host;
#   refresh_schedule: the profile's counts and times of the defaults against fewer
#     refreshes (every 30 steps) and fewer rotations (every third refresh), 90 steps;
#   compile: the in-between step's math eager, compiled and as CUDA graphs;
#   step_cost: step cost with peak memory;
#   fmnist_2c2d: time to target, DampedNewton's default against Adam over 3e-4,
#     1e-3, 3e-3, 3 seeds, the grid's fastest run per seed (measured on an H200 and
#     an H100, so late; the two alone: fmnist_2c2d_default, fmnist_2c2d_adam);
#   fmnist_2c2d_peers: SOAP at 1e-3 and 3e-3, PSGD-Kron at 1e-3, 3 seeds (the two
#     alone: fmnist_2c2d_soap, fmnist_2c2d_kron);
#   fmnist_2c2d_sgd: SGD-momentum at 0.01, 0.03, 0.1 and SGD at 0.1, 0.3, 1, 3 seeds
#     (the CPU tables' other baselines; not part of `all`);
#   fmnist_2c2d_packed: the defaults packed without CUDA graphs
#     (KroneckerBasis(packed=True, graphed=False)), 3 seeds (not part of `all`;
#     `profile` counts its step as default:packed);
#   fmnist_2c2d_per_layer: the defaults by shape, neither packed nor graphed
#     (KroneckerBasis(packed=False), the CPU's default), 3 seeds (not part of `all`;
#     `profile` counts its step as default:per_layer);
#   fmnist_2c2d_interval30: the defaults refreshed every 30 steps past the ramp
#     (the defaults' averaging with interval=30), 3 seeds (not part of `all`);
#   fmnist_2c2d_schedule_free: the opt-in Schedule-Free averaging
#     (optimizer=dampednewton_schedule_free), 3 seeds (not part of `all`).
# `all` runs checks to fmnist_2c2d_peers as listed (most wanted first).
# The parts share BUDGET seconds (default 540): each part stops at its own cap or when
# the budget runs out, and writes its results to $OUT as it goes, so a part cut short
# still returns what it finished; the Hydra runs of fmnist_2c2d go to $OUT/sweeps (a
# sweep cut short, in its grid extension say, gets the report of its finished jobs).
# STEPS (default 4000, the preset's) sets the fmnist_2c2d runs' budget of steps.
# $OUT of the device tool returns at most 8 files, 2 folders down: point OUT at a
# scratch folder and tar it into the real one.
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

# sweep NAME LOG OVERRIDES...: a Hydra multirun into $out/sweeps/NAME under a 200 s
# cap (or the budget left). A multirun cut by either (its grid extension, say) writes
# no report: the report of the jobs that finished is then written from their results.
sweep() {
  local name=$1 log=$2 dir="$out/sweeps/$1"
  shift 2
  run 200 "$log" python3 -m benchmarks.run --multirun "${common[@]}" "$@" \
    hydra.sweep.dir="$dir"
  if [[ -d "$dir" && ! -f "$dir/report/summary.md" ]]; then
    echo "cut short: the report of the finished jobs" >>"$log"
    python3 -m benchmarks.report "$dir" >>"$log" 2>&1
  fi
  tail -n 4 "$log"
}

# The fmnist_2c2d runs: the GPU preset, 3 seeds, one job per grid point.
common=(+sweep=gpu_fmnist_2c2d problem.eval_every=100 grid=null grid_point=null
  seed=0,1,2 checkpoint_every=null problem.steps="${STEPS:-4000}")

part() {
  case "$1" in
    checks)
      # One process: under pytest-xdist (-n 8) the run hung after its last test.
      run 240 "$out/cuda-tests.txt" python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests &
      # The ViViT step's (exact 800, MC-1 4,000 on an H200, 2026-11-26) with
      # --variants fast:exact fast:mc1 --resolution 32. The defaults and SGD fit far
      # larger batches: coarser, from 1024 (~12 trials of ~11 s each).
      run 240 "$out/critical.md" python3 -m benchmarks.micro.critical_batch \
        --model 3c3d --variants default sgd --start 1024 --resolution 512
      wait
      tail -n 5 "$out/cuda-tests.txt"
      cat "$out/critical.md" ;;
    tests)
      run 240 "$out/cuda-tests.txt" python3 -m pytest -q -m cuda -p no:cacheprovider tests
      tail -n 5 "$out/cuda-tests.txt" ;;
    profile)
      local peers=()
      python3 -c "import pytorch_optimizer" 2>/dev/null && peers=(--peers soap kron)
      # Past the refresh ramp, counts averaged over 45 steps: the defaults' pattern of
      # refreshes, one of which rotates (an eigh per factor shape, a sync each).
      run 150 "$out/profile.md" python3 -m benchmarks.micro.step_profile \
        --models mlp 3c3d --ggn mc1 exact --warmup 60 --steps 45 "${peers[@]}"
      cat "$out/profile.md" ;;
    fmnist_2c2d)
      part fmnist_2c2d_default
      part fmnist_2c2d_adam ;;
    fmnist_2c2d_default)
      sweep dampednewton "$out/dampednewton.txt" optimizer=dampednewton ;;
    fmnist_2c2d_adam)
      sweep adam "$out/adam.txt" optimizer=adam optimizer.lr=0.0003,0.001,0.003 ;;
    fmnist_2c2d_peers)
      # SOAP and PSGD-Kron at the learning rates that were fastest on the CPU
      # (fmnist_2c2d: SOAP 3e-3, Kron 1e-3) and SOAP's neighbour 1e-3.
      part fmnist_2c2d_soap
      part fmnist_2c2d_kron ;;
    fmnist_2c2d_soap)
      sweep soap "$out/soap.txt" optimizer=soap optimizer.lr=0.001,0.003 ;;
    fmnist_2c2d_kron)
      sweep kron "$out/kron.txt" optimizer=kron optimizer.lr=0.001 ;;
    fmnist_2c2d_sgd)
      sweep momentum "$out/momentum.txt" optimizer=momentum optimizer.lr=0.01,0.03,0.1
      sweep sgd "$out/sgd.txt" optimizer=sgd optimizer.lr=0.1,0.3,1.0 ;;
    fmnist_2c2d_packed)
      sweep packed "$out/packed.txt" optimizer=dampednewton_packed ;;
    fmnist_2c2d_per_layer)
      sweep per_layer "$out/per_layer.txt" optimizer=dampednewton_per_layer ;;
    fmnist_2c2d_interval30)
      sweep interval30 "$out/interval30.txt" optimizer=dampednewton \
        optimizer.averaging.interval=30 ;;
    fmnist_2c2d_schedule_free)
      sweep schedule_free "$out/schedule_free.txt" optimizer=dampednewton_schedule_free ;;
    refresh_schedule)
      # 90 steps: a whole period of refreshes every 30 steps (and of rotations on
      # every third of the defaults' refreshes).
      run 120 "$out/refresh_schedule.md" python3 -m benchmarks.micro.step_profile \
        --models mlp 3c3d --warmup 60 --steps 90 \
        --variants sgd adam default default:interval30 default:rotation3
      cat "$out/refresh_schedule.md" ;;
    phases)
      run 120 "$out/phases.md" python3 -m benchmarks.micro.step_phases --models mlp 3c3d \
        --variants default default:per_layer default:packed default:backpack \
        default:exact --periods 2
      cat "$out/phases.md" ;;
    step_parts)
      run 90 "$out/step_parts.md" python3 -m benchmarks.micro.step_parts --models mlp 3c3d
      cat "$out/step_parts.md" ;;
    refresh_pass)
      run 90 "$out/refresh_pass.md" python3 -m benchmarks.micro.refresh_pass \
        --models mlp-tiny mlp 3c3d --steps 150
      cat "$out/refresh_pass.md" ;;
    graph_memory)
      run 120 "$out/graph_memory.md" python3 -m benchmarks.micro.graph_memory \
        --models mlp 3c3d --steps 300
      cat "$out/graph_memory.md" ;;
    solvers)
      run 60 "$out/solvers.md" python3 -m benchmarks.micro.eigensolvers
      cat "$out/solvers.md" ;;
    compile)
      run 120 "$out/compile.md" python3 -m benchmarks.micro.between_compile
      run 120 "$out/compile-3c3d.md" python3 -m benchmarks.micro.between_compile \
        --model 3c3d
      cat "$out/compile.md" "$out/compile-3c3d.md" ;;
    step_cost)
      run 120 "$out/step_cost.txt" python3 -m benchmarks.micro.step_cost \
        --models mlp 3c3d --ggn mc1 exact --memory --skip-materialized
      cat "$out/step_cost.txt" ;;
    *)
      echo "usage: bash benchmarks/gpu_session.sh all | PART [PART ...]" \
        "(PART: checks tests profile refresh_schedule phases step_parts refresh_pass" \
        "graph_memory solvers compile step_cost fmnist_2c2d fmnist_2c2d_default" \
        "fmnist_2c2d_adam fmnist_2c2d_peers fmnist_2c2d_soap fmnist_2c2d_kron" \
        "fmnist_2c2d_sgd fmnist_2c2d_packed fmnist_2c2d_per_layer" \
        "fmnist_2c2d_interval30 fmnist_2c2d_schedule_free)" >&2
      exit 2 ;;
  esac
}

(($#)) || part usage
parts=("$@")
[[ "$1" == all ]] &&
  parts=(checks profile phases step_parts refresh_pass solvers compile step_cost
    fmnist_2c2d fmnist_2c2d_peers)
for name in "${parts[@]}"; do
  part "$name"
done
