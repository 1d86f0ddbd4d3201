#!/bin/bash
# Checks async_grpo.sbatch: its syntax, and a short run of it on this host under a stand-in for
# srun that starts the tasks as srun would (SLURM_PROCID, SLURM_NTASKS). The actor is SIGKILLed
# mid-run; its task must start it again from its checkpoint. Every process must exit 0 on its own
# and every check the actor makes must pass.
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
# srun's stand-in: $SLURM_NTASKS copies of the command on this host, each with its SLURM_PROCID
# and in a process group of its own (its pid in $SRUN_OUT.<rank>.pid); with --kill-on-bad-exit,
# the first to fail stops the others, as Slurm does, by signalling every process of each task. It
# stops only the tasks it started.
echo "srun $*" >> "$SRUN_LOG"
kill_on_bad_exit=0
while [[ $# -gt 0 && $1 == -* ]]; do
  [[ $1 == --kill-on-bad-exit=1 ]] && kill_on_bad_exit=1
  shift
done
pids=()
stop_tasks() { for pid in "${pids[@]}"; do kill -- "-$pid" 2> /dev/null; done; }
trap 'stop_tasks; exit 143' TERM INT
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  SLURM_PROCID=$rank setsid "$@" > "$SRUN_OUT.$rank" 2>&1 &
  pids+=($!)
  echo $! > "$SRUN_OUT.$rank.pid"
done
rc=0
for ((left = SLURM_NTASKS; left > 0; left--)); do
  if ! wait -n "${pids[@]}"; then
    rc=1
    if ((kill_on_bad_exit)); then
      stop_tasks
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
# Waits (on the file's changes, at most 5 minutes) for a line of task <rank>'s output to match.
wait_for_line() {
  exec 3< <(exec tail -n +1 -F "$SRUN_OUT.$1" 2> /dev/null)
  local tail_pid=$! found=0
  timeout 300 grep -q -m 1 -- "$2" <&3 || found=$?
  kill "$tail_pid"
  exec 3<&-
  return $found
}
status=0
# Made before srun's stand-in writes it, so that tail follows it from the first line.
: > "$SRUN_OUT.0"
bash "$script" --steps 20 --warmup-steps 20 --groups-per-step 4 --checkpoint-every 3 &
script_pid=$!
# After step 4 the newest checkpoint is version 3's: the restarted actor trains steps 3 and 4 again.
if wait_for_line 0 '^progress 4 '; then
  pkill -KILL -P "$(cat "$SRUN_OUT.0.pid")" || true
fi
wait "$script_pid" || status=$?
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  echo "--- task $rank"
  cat "$work/task.$rank"
done
fail() {
  echo "sbatch_test: $*" >&2
  exit 1
}
((status == 0)) || fail "the script exited $status"
grep -q -- "^srun --kill-on-bad-exit=1 bash -c" "$SRUN_LOG" || fail "srun was not asked to end the job on a failure: $(cat "$SRUN_LOG")"
grep -q -- "async_grpo_task $binary --role auto" "$SRUN_LOG" || fail "srun was not asked for every task's role: $(cat "$SRUN_LOG")"
[[ $(stat -c %a "$work/async_grpo_runs/sbatch-test/token") == 600 ]] || fail "the token file is readable by others"
checks=$(grep -c '^check .* ok ' "$work/task.0" || true)
((checks >= 5)) || fail "the actor reported $checks passing checks"
grep -q "^async_grpo.sbatch: signal 9 ended the actor; restart 1 of 3" "$work/task.0" || fail "the killed actor was not started again"
grep -q '^check resumed ok ' "$work/task.0" || fail "the restarted actor did not go on from its checkpoint"
! grep -q '^check .* FAIL ' "$work/task.0" || fail "a check failed"
for ((rank = 2; rank < SLURM_NTASKS; rank++)); do
  grep -q "^rollout-$((rank - 2)) finished" "$work/task.$rank" || fail "task $rank did not finish as a rollout worker"
done
# A second run into the same directory is refused before any task starts.
if bash "$script" > /dev/null 2>&1; then fail "a used RUN_DIR was accepted"; fi
echo "sbatch_test: ok"
