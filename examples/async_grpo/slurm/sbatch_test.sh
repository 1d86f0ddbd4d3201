#!/bin/bash
# Checks async_grpo.sbatch: its syntax, and a short run of it on this host under a stand-in for
# srun that starts the tasks as srun would (SLURM_PROCID, SLURM_NTASKS). Every process must exit 0
# on its own and every check the actor makes must pass.
#   sbatch_test.sh <async_grpo binary> <async_grpo.sbatch>
set -euo pipefail
binary=$(realpath "$1")
script=$(realpath "$2")
bash -n "$script"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/bin"
cat > "$work/bin/srun" <<'SRUN'
#!/bin/bash
# srun's stand-in: $SLURM_NTASKS copies of the command on this host, each with its SLURM_PROCID;
# with --kill-on-bad-exit, the first to fail stops the others. It stops only the tasks it started.
echo "srun $*" >> "$SRUN_LOG"
kill_on_bad_exit=0
while [[ $# -gt 0 && $1 == -* ]]; do
  [[ $1 == --kill-on-bad-exit=1 ]] && kill_on_bad_exit=1
  shift
done
pids=()
trap 'kill "${pids[@]}" 2> /dev/null; exit 143' TERM INT
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  SLURM_PROCID=$rank "$@" > "$SRUN_OUT.$rank" 2>&1 &
  pids+=($!)
done
rc=0
for ((left = SLURM_NTASKS; left > 0; left--)); do
  if ! wait -n "${pids[@]}"; then
    rc=1
    if ((kill_on_bad_exit)); then
      kill "${pids[@]}" 2> /dev/null
      wait
      break
    fi
  fi
done
exit $rc
SRUN
chmod +x "$work/bin/srun"

export PATH="$work/bin:$PATH" SRUN_LOG="$work/srun.log" SRUN_OUT="$work/task"
export SLURM_NTASKS=5 SLURM_JOB_ID=sbatch-test SLURM_SUBMIT_DIR="$work" ASYNC_GRPO="$binary" LISTEN_HOST=127.0.0.1
status=0
bash "$script" --steps 10 --warmup-steps 20 --groups-per-step 4 || status=$?
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  echo "--- task $rank"
  cat "$work/task.$rank"
done
fail() {
  echo "sbatch_test: $*" >&2
  exit 1
}
((status == 0)) || fail "the script exited $status"
grep -q -- "--kill-on-bad-exit=1 $binary --role auto" "$SRUN_LOG" || fail "srun was not asked for every task's role: $(cat "$SRUN_LOG")"
[[ $(stat -c %a "$work/async_grpo_runs/sbatch-test/token") == 600 ]] || fail "the token file is readable by others"
checks=$(grep -c '^check .* ok ' "$work/task.0" || true)
((checks >= 5)) || fail "the actor reported $checks passing checks"
! grep -q '^check .* FAIL ' "$work/task.0" || fail "a check failed"
for ((rank = 2; rank < SLURM_NTASKS; rank++)); do
  grep -q "^rollout-$((rank - 2)) finished" "$work/task.$rank" || fail "task $rank did not finish as a rollout worker"
done
# A second run into the same directory is refused before any task starts.
if bash "$script" > /dev/null 2>&1; then fail "a used RUN_DIR was accepted"; fi
echo "sbatch_test: ok"
