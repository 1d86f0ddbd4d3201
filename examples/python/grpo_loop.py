"""Asynchronous GRPO from Python: a PyTorch actor pops whole groups from a laminar TrajectoryQueue,
trains, and publishes each version to a relay; rollout processes pull the newest version when idle
(through the relay's local socket), sample groups and push them back over the transport.

The policy is a table of logits over a small vocabulary; a response is RESPONSE_LEN tokens sampled
from it and its reward the fraction of TARGET tokens, so the reward must rise as the actor trains.

    python3 examples/python/grpo_loop.py --steps 30 --rollouts 2
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

import laminar

VOCAB = 16
TARGET = 3
RESPONSE_LEN = 8
GROUP = 4
TOKEN = b"grpo loop example cluster token"


def rollout(args):
    """A rollout worker: pull when idle, sample a group, push it; stop when the actor closes."""
    transport = laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN))
    producer = laminar.RemoteProducer(transport, args.address)
    puller = laminar.WeightPuller.local([args.socket])
    logits = torch.zeros(VOCAB)
    torch.manual_seed(args.worker)
    deadline = time.monotonic() + args.timeout
    group = 0
    while time.monotonic() < deadline:
        action, version = puller.next_action(False)  # between groups nothing is live
        if action == laminar.PullAction.PULL:
            try:
                puller.pull(version, {"logits": logits})
            except laminar.NotFoundError:
                continue  # a newer version replaced it meanwhile: ask again
        if puller.current_version() is None:
            time.sleep(0.01)
            continue
        log_probs = torch.log_softmax(logits, dim=0)
        group_id = args.worker * 1_000_000 + group
        batch = []
        for i in range(GROUP):
            tokens = torch.multinomial(log_probs.exp(), RESPONSE_LEN, replacement=True)
            batch.append(laminar.Trajectory(
                id=group_id * GROUP + i, prompt_id=group_id, group_id=group_id, group_size=GROUP, sample_index=i,
                version=puller.current_version(), prompt_tokens=[0], response_tokens=tokens,
                logprobs=log_probs[tokens], rewards=[float((tokens == TARGET).float().mean())]))
        results = producer.push_many(batch)
        if any(isinstance(r, (laminar.CancelledError, laminar.UnavailableError)) for r in results):
            return 0  # the actor closed its queue or went away: done
        errors = [r for r in results if r is not None]
        if errors:
            print(f"rollout {args.worker}: {errors[0]!r}", file=sys.stderr)
            return 1
        group += 1
    print(f"rollout {args.worker}: the actor did not finish within {args.timeout} s", file=sys.stderr)
    return 1


def grpo_loss(logits, batch):
    """Clipped policy gradient with group-normalised advantages, from the batch's arrays."""
    rewards = torch.from_numpy(batch.rewards).view(-1, GROUP)  # whole groups, in order
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    offsets = torch.from_numpy(batch.response_offsets)
    tokens = torch.from_numpy(batch.response_tokens).long()
    behaviour = torch.from_numpy(batch.logprobs)
    per_token_advantage = torch.repeat_interleave(advantages, offsets.diff())
    ratio = torch.exp(torch.log_softmax(logits, dim=0)[tokens] - behaviour)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    return -torch.min(ratio * per_token_advantage, clipped * per_token_advantage).mean()


def actor(args):
    transport = laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN))
    address = transport.listen("127.0.0.1")
    # Room for two batches: rollouts run at most about a batch ahead of training.
    queue = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(capacity_trajectories=2 * args.batch_groups * GROUP))
    server = laminar.TrajectoryQueueServer(transport, queue)
    relay = laminar.RelayStore(laminar.RelayStoreOptions(shareable=True))
    socket_dir = tempfile.mkdtemp(prefix="laminar-grpo-")
    socket_path = os.path.join(socket_dir, "relay.sock")
    local_relay = laminar.LocalRelayServer(relay, socket_path)

    logits = torch.zeros(VOCAB, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=args.lr)

    def publish(version):
        queue.publish_version(version)  # first, so the queue takes what this version generates
        relay.publish(version, {"logits": logits.detach()})

    publish(1)
    workers = [subprocess.Popen([sys.executable, __file__, "--role", "rollout", "--address", address,
                                 "--socket", socket_path, "--worker", str(w), "--timeout", str(args.timeout)])
               for w in range(args.rollouts)]
    rewards = []
    try:
        for step in range(1, args.steps + 1):
            spec = laminar.BatchSpec(max_trajectories=args.batch_groups * GROUP,
                                     min_trajectories=args.batch_groups * GROUP, wait=args.timeout,
                                     consumer_version=step, staleness_rule=laminar.StalenessRule.DROP,
                                     max_staleness=2)
            batch = queue.pop_batch(spec)
            loss = grpo_loss(logits, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            queue.ack(batch)
            rewards.append(float(batch.rewards.mean()))
            staleness = batch.staleness.tolist()
            print(f"step {step:3d}  reward {rewards[-1]:.3f}  staleness {min(staleness)}-{max(staleness)}  "
                  f"p(target) {float(torch.softmax(logits, 0)[TARGET]):.3f}")
            publish(step + 1)
    finally:
        queue.close()  # held and later pushes end CancelledError: the rollouts stop
        codes = [w.wait(timeout=args.timeout) for w in workers]
        del server, local_relay
        os.rmdir(socket_dir)
    stats = queue.stats()
    print(f"trained {stats['flow']['acked']} samples, dropped {stats['drops']['stale']} stale, "
          f"rollout exit codes {codes}")
    if any(codes):
        return 1
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward: first steps {first:.3f}, last steps {last:.3f}")
    if args.check and not last > first + 0.2:
        print("check failed: the reward did not rise by 0.2", file=sys.stderr)
        return 1
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["actor", "rollout"], default="actor")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rollouts", type=int, default=2, help="rollout processes")
    p.add_argument("--batch-groups", type=int, default=4, help="GRPO groups per training step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=60, help="seconds any one wait may take")
    p.add_argument("--check", action="store_true", help="exit 1 unless the reward rises by 0.2")
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    return rollout(args) if args.role == "rollout" else actor(args)


if __name__ == "__main__":
    sys.exit(main())
