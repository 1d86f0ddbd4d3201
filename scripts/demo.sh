#!/usr/bin/env bash
# The README's further examples: installs dependencies, builds, and runs the smaller examples one after
# the other. Part 1 (quickstart): the actor prepares a policy version (manifest, DLPack views, f32 ->
# bf16). Part 2 (core_loop): the asynchronous loop in one process, learning a toy policy. Part 3
# (relay_server, real processes over UCX): an actor publishes three versions, a chain of two relays
# forwards them chunk by chunk, and a rollout pulls the newest version, every byte checked against
# the actor's digest. Part 4 (repack, real processes over UCX): rollout workers decode a tiny model,
# and once a newer version is published their long-tail sequences move, KV cache and all, onto
# fewer workers, each token and log-prob checked against a decode without migration.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh >/dev/null
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target quickstart core_loop relay_server repack >/dev/null
bin=build/default/examples

echo "== part 1: quickstart"
"$bin/quickstart"

echo
echo "== part 2: core_loop (actor and rollout in one process)"
"$bin/core_loop"

echo
echo "== part 3: actor -> relay A -> relay B -> rollout (pulls from B, falls back to A)"
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
token="laminar-demo-cluster-token-$$-$RANDOM"

# start NAME ARGS...: runs relay_server in the background, its output in $dir/NAME.
start() {
  local name=$1
  shift
  "$bin/relay_server" --token "$token" "$@" >"$dir/$name" 2>&1 &
  pids+=("$!")
}
# address NAME: waits up to 20 s for the "listening ADDR" line and prints ADDR.
address() {
  for _ in $(seq 200); do
    local a
    a=$(sed -n 's/^listening //p' "$dir/$1" | head -n 1)
    if [ -n "$a" ]; then echo "$a"; return 0; fi
    sleep 0.1
  done
  echo "demo: $1 did not start:" >&2
  cat "$dir/$1" >&2
  return 1
}

start actor --actor --mib 64 --versions 3 --interval-ms 500
actor=$(address actor)
start relay_a --upstream "$actor"
relay_a=$(address relay_a)
start relay_b --upstream "$relay_a" --upstream "$actor"
relay_b=$(address relay_b)
start rollout --pull --mib 64 --upstream "$relay_b" --upstream "$relay_a" --exit-after-version 3
rollout_pid=${pids[-1]}
if ! timeout 60 tail --pid="$rollout_pid" -f /dev/null; then
  echo "demo: the rollout did not get version 3 within 60 s" >&2
fi
for n in actor relay_a relay_b rollout; do
  echo "-- $n"
  grep -E '^(published|committed|pulled|upstream|lost|stats)' "$dir/$n" || true
done
want=$(sed -n 's/^published 3 //p' "$dir/actor")
if grep -q "^pulled 3 ok" "$dir/rollout" && grep -q "^committed 3 $want" "$dir/relay_b"; then
  echo "demo: version 3 reached the rollout through two relays, digest $want matches the actor's"
else
  echo "demo: version 3 did not arrive intact" >&2
  exit 1
fi

echo
echo "== part 4: repack (a coordinator and three rollout workers; long tails move to free workers)"
"$bin/repack"
