#!/usr/bin/env bash
# The README's first command: installs dependencies, builds the asynchronous GRPO example and runs it
# (by default the synchronous schedule, then laminar's, on one seed). Arguments go to async_grpo
# (`--help` lists them); the report lands in async_grpo_out/ unless --out says otherwise. Each phase
# prints a line, and the build its progress; a phase that fails prints the end of its log.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
started=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)); }
failed() {
  echo "async_grpo.sh: $1 failed; the end of its output:" >&2
  tail -n 40 "$log" >&2
  exit 1
}

echo "[1/4] Debian packages (scripts/install_deps.sh)"
bash scripts/install_deps.sh >"$log" 2>&1 || failed "installing packages"
sed 's/^/      /' "$log" | tail -n 3

echo "[2/4] configuring (cmake --preset default)"
cmake --preset default >"$log" 2>&1 || failed "configuring"

jobs=${LAMINAR_JOBS:-$(nproc)}
echo "[3/4] building async_grpo on $jobs cores"
next=10
while IFS= read -r line; do
  echo "$line" >>"$log"
  if [[ $line =~ ^\[([0-9]+)/([0-9]+)\] ]]; then
    done_steps=${BASH_REMATCH[1]}
    total=${BASH_REMATCH[2]}
    if ((done_steps * 100 >= next * total)); then
      echo "      $((done_steps * 100 / total))% of $total build steps, $(elapsed)"
      next=$((done_steps * 100 / total / 10 * 10 + 10))
    fi
  fi
done < <(: >"$log"; cmake --build --preset default -j "$jobs" --target async_grpo 2>&1; echo "build-exit $?")
grep -q '^build-exit 0$' "$log" || failed "building"
echo "      built in $(elapsed)"

echo "[4/4] running build/default/examples/async_grpo/async_grpo $*"
exec build/default/examples/async_grpo/async_grpo "$@"
