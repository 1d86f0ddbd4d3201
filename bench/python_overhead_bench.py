"""python_overhead_bench: what the Python bindings cost per call, against the same operations from
C++ measured in the same run (python_overhead_baseline, started first).

  queue: push of one realistic trajectory (256 prompt + 1-4k response tokens, as
         bench/realistic_trajectory.h) from Python, pop_batch of one, ack; microseconds per round.
  pull:  WeightPuller.pull of one 256 MiB float32 tensor into a torch tensor; GB/s (goal: within
         0.95 of C++).

    PYTHONPATH=build/default/python python3 bench/python_overhead_bench.py \\
        --baseline build/default/bench/python_overhead_baseline

Prints one JSON line per metric, the pull last (the headline).
"""

import argparse
import json
import statistics
import subprocess
import time

import numpy as np
import torch

import laminar

ALTERNATIONS = 3


def measure(body, warmup=2, repeats=9):
    for _ in range(warmup):
        body()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        body()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(bench, metric, value, baseline, baseline_value, ratio):
    print(json.dumps({"bench": bench, "metric": metric, "value": round(value, 6), "baseline": baseline,
                      "baseline_value": round(baseline_value, 6), "ratio": round(ratio, 4)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="path of the python_overhead_baseline binary")
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--pull-mib", type=int, default=256)
    args = p.parse_args()

    def baseline():
        run = subprocess.run([args.baseline, "--rounds", str(args.rounds), "--pull-mib", str(args.pull_mib)],
                             capture_output=True, text=True, check=True)
        return json.loads(run.stdout.strip().splitlines()[-1])

    # The two sides alternate, ALTERNATIONS times each, and each reports the median of its runs: on
    # a shared machine the load moves between runs of a few seconds.
    cpp_runs = [baseline()]
    rng = np.random.default_rng(7)
    length = cpp_runs[0]["response_tokens"]  # the same size as the C++ side's
    t = laminar.Trajectory(prompt_tokens=rng.integers(0, 151000, 256, dtype=np.int32),
                           response_tokens=rng.integers(0, 151000, length, dtype=np.int32),
                           logprobs=-rng.integers(0, 1000, length).astype(np.float32) / 100, rewards=[1.0],
                           generation_start_ns=1000, generation_end_ns=2000,
                           metadata='{"task": "math", "source": "gsm8k"}')
    queue = laminar.TrajectoryQueue()
    spec = laminar.BatchSpec(max_trajectories=1)
    next_id = [0]

    def rounds():
        for _ in range(args.rounds):
            next_id[0] += 1
            t.id = next_id[0]
            queue.push(t)
            queue.ack(queue.pop_batch(spec))

    n = args.pull_mib * (1 << 20) // 4
    relay = laminar.RelayStore()
    relay.publish(1, {"w": torch.full((n,), 1.5)})
    relay.wait_for_version(1, timeout=60)
    dst = {"w": torch.empty(n)}
    puller = laminar.WeightPuller(relay)

    queue_runs, pull_runs = [], []
    for i in range(ALTERNATIONS):
        if i:
            cpp_runs.append(baseline())
        queue_runs.append(measure(rounds) / args.rounds)
        pull_runs.append(measure(lambda: puller.pull(1, dst)))
    assert bool((dst["w"] == 1.5).all())

    queue_us = statistics.median(queue_runs) * 1e6
    cpp_queue_us = statistics.median(r["queue_round_s"] for r in cpp_runs) * 1e6
    print(f"queue push+pop+ack: Python {queue_us:.2f} us, C++ {cpp_queue_us:.2f} us, "
          f"binding overhead {queue_us - cpp_queue_us:.2f} us per round")
    report("python_queue_round", "us", queue_us, "cpp_queue_round", cpp_queue_us, cpp_queue_us / queue_us)

    pull_bytes = n * 4
    gbps = pull_bytes / statistics.median(pull_runs) / 1e9
    cpp_gbps = pull_bytes / statistics.median(r["pull_s"] for r in cpp_runs) / 1e9
    print(f"pull of {args.pull_mib} MiB into a torch tensor: Python {gbps:.2f} GB/s, C++ {cpp_gbps:.2f} GB/s")
    report("python_pull", "GB/s", gbps, "cpp_pull", cpp_gbps, gbps / cpp_gbps)


if __name__ == "__main__":
    main()
