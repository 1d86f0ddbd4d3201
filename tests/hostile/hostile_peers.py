#!/usr/bin/env python3
"""The hostile-peer suite: what a stranger on the network (or on the host) can throw at a laminar
process, thrown at every socket the process listens on.

It starts the built examples, a relay (examples/relay_server with a local relay socket) and a queue
server (examples/queue_server), finds every TCP port and Unix socket each listens on from /proc
(laminar's own and whatever UCX opened), and runs each attack. After each one the process must be
alive, serve a good client (a real laminar peer) within its normal latency, and come back to the
file descriptors, memory and idle CPU it had before. Figures go to stdout, one line per attack.

A peer can also hang rather than attack: StoppedRelay stops (SIGSTOP) the middle relay of a chain,
which keeps its connections open, and times how long the relay below it takes to give it up.

Usage: hostile_peers.py RELAY_SERVER QUEUE_SERVER TRANSPORT_PEER [unittest args]
(TRANSPORT_PEER is tests/transport_peer, the authenticated peer of the flood attack.)
"""
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

RELAY_SERVER = QUEUE_SERVER = TRANSPORT_PEER = None
TOKEN = "hostile-suite-token-0123456789"
SEED = int(os.environ.get("LAMINAR_HOSTILE_SEED", str(random.randrange(1 << 30))))
UCX_TCP_MAGIC = struct.pack("<Q", 0xCAFEBABE12345678)
# Longest an attack on one process goes on (a wedged target makes every connect wait).
ATTACK_SECONDS = 30
# The relay's local socket closes connections idle this long (relay_server --shm-idle-timeout-ms).
LOCAL_IDLE_SECONDS = 3
# Clients that send acquire requests to the local relay as fast as it takes them and read nothing.
NON_READERS = 8
LOCAL_ACQUIRE = struct.pack("<IIQQ", 0x31524D4C, 2, 0, 0)  # "LMR1", kAcquire of the newest version


def eventually(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def target_env():
    """The environment of the processes attacked. Under ASan freed memory waits in a quarantine (256 MiB
    by default) before it is reused, which the resting-memory check would count as kept; a small one
    leaves that check measuring what the process holds. Other builds ignore the variable."""
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), "quarantine_size_mb=16"]))
    return env


class Process:
    """A child the suite started, read line by line; stopped by its pid only."""

    def __init__(self, args):
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=target_env())
        self.lines = []
        self.times = []  # time.monotonic() at which each line arrived
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.times.append(time.monotonic())
                self.cond.notify_all()

    def mark(self):
        """Where the next line will go: wait_line(since=mark()) sees only lines printed from now on."""
        with self.cond:
            return len(self.lines)

    def wait_line_timed(self, prefix, timeout=30, since=0):
        """The first line from index `since` on that starts with `prefix`, and when it arrived."""
        def found():
            return next((k for k in range(since, len(self.lines)) if self.lines[k].startswith(prefix)), None)
        with self.cond:
            if not self.cond.wait_for(lambda: found() is not None, timeout):
                raise AssertionError(f"{self.proc.args[0]} printed no '{prefix}' line: {self.lines[since:]}")
            k = found()
            return self.lines[k], self.times[k]

    def wait_line(self, prefix, timeout=30, since=0):
        return self.wait_line_timed(prefix, timeout, since)[0]

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode


def socket_inodes(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_tcp(pid):
    """(host, port) of every TCP socket the process listens on, v4 and v6."""
    inodes = socket_inodes(pid)
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for row in f:
                cols = row.split()
                if cols[3] != "0A" or int(cols[9]) not in inodes:
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if v6:
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    host = socket.inet_ntop(socket.AF_INET6, words)
                else:
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                if host in ("0.0.0.0", "::"):
                    host = "127.0.0.1" if not v6 else "::1"
                found.append((host, int(hexport, 16)))
    return sorted(set(found))


def listening_unix(pid):
    inodes = socket_inodes(pid)
    paths = []
    with open(f"/proc/{pid}/net/unix") as f:
        next(f)
        for row in f:
            cols = row.split()
            # Flags 00010000: __SO_ACCEPTCON, a listening socket.
            if len(cols) >= 8 and int(cols[6]) in inodes and int(cols[3], 16) & 0x10000:
                paths.append(cols[7])
    return sorted(set(paths))


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_share(pid, seconds=1.0):
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def tcp_send(host, port, data, linger=0.05):
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(data)
            time.sleep(linger)
    except OSError:
        pass  # refused or reset: the target chose to drop us, which is allowed


def accepts_connections(host, port):
    """False for a port whose socket filter drops the connection (UCX's, until a peer from our
    address has authenticated): the connect times out instead of completing or being refused."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


def timed(args, timeout=60):
    start = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


class Target:
    """One served process, its good client and its resting figures."""

    def __init__(self, name, process, good_client):
        self.name, self.process, self.good_client = name, process, good_client
        self.baseline_s = None
        self.rest = None

    def serve_good_client(self):
        done, seconds = self.good_client()
        if done.returncode != 0:
            raise AssertionError(f"{self.name}: good client failed ({done.returncode}): {done.stdout} {done.stderr}")
        return seconds

    def measure_rest(self):
        pid = self.process.pid
        return {"fds": fd_count(pid), "rss_kib": rss_kib(pid), "cpu": idle_cpu_share(pid)}


class HostilePeers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        print(f"hostile_peers: seed {SEED}", flush=True)
        cls.tmp = tempfile.TemporaryDirectory(prefix="laminar-hostile-")
        shm = os.path.join(cls.tmp.name, "relay.sock")
        relay = Process([RELAY_SERVER, "--token", TOKEN, "--actor", "--mib", "1", "--shm", shm,
                         "--shm-idle-timeout-ms", str(LOCAL_IDLE_SECONDS * 1000)])
        queue = Process([QUEUE_SERVER, "--token", TOKEN])
        cls.children = [relay, queue]
        relay_addr = relay.wait_line("listening").split()[1]
        relay.wait_line("published 1")
        queue_addr = queue.wait_line("listening").split()[1]
        ids = iter(range(0, 1 << 40, 64))
        cls.relay = Target("relay", relay, lambda: timed(
            [RELAY_SERVER, "--token", TOKEN, "--pull", "--mib", "1", "--upstream", relay_addr,
             "--exit-after-version", "1"]))
        cls.local = Target("local relay", relay, lambda: timed(
            [RELAY_SERVER, "--pull", "--mib", "1", "--local", shm, "--exit-after-version", "1"]))
        cls.queue = Target("queue server", queue, lambda: timed(
            [QUEUE_SERVER, "--token", TOKEN, "--produce", queue_addr, "--count", "64", "--first-id", str(next(ids))]))
        for t in (cls.relay, cls.local, cls.queue):
            t.serve_good_client()  # warm: the first client pays for first-touch costs
            t.baseline_s = min(t.serve_good_client() for _ in range(3))
        for p in cls.children:
            eventually(lambda: idle_cpu_share(p.pid, 0.5) < 0.2, 20, f"{p.proc.args[0]} idle before the attacks")
        cls.rest = {p.pid: {"fds": fd_count(p.pid), "rss_kib": rss_kib(p.pid)} for p in cls.children}
        print(f"hostile_peers: listening tcp relay {listening_tcp(relay.pid)} queue {listening_tcp(queue.pid)}"
              f" unix {listening_unix(relay.pid)}", flush=True)

    def setUp(self):
        # One attack that killed a process must not fail every later one too.
        if not all(p.alive() for p in self.children):
            type(self).tearDownClass()
            type(self).setUpClass()

    @classmethod
    def tearDownClass(cls):
        for p in cls.children:
            p.stop()
        cls.tmp.cleanup()

    def recovered(self, target, attack, started):
        """Alive, serving within its normal latency, and back to its resting figures."""
        p = target.process
        if not p.alive():
            self.fail(f"{target.name} died after {attack}: exit {p.proc.returncode}; stderr: {p.proc.stderr.read()}")
        seconds = target.serve_good_client()
        limit = max(3 * target.baseline_s, target.baseline_s + 2.0)
        self.assertLess(seconds, limit, f"{target.name} served a good client in {seconds:.2f} s after {attack} "
                                        f"(normal {target.baseline_s:.2f} s)")
        rest = self.rest[p.pid]
        eventually(lambda: fd_count(p.pid) <= rest["fds"] + 2, 30,
                   f"{target.name} back to {rest['fds']} fds after {attack} (has {fd_count(p.pid)})")
        eventually(lambda: idle_cpu_share(p.pid, 0.5) < 0.2, 20, f"{target.name} idle after {attack}")
        grown = rss_kib(p.pid) - rest["rss_kib"]
        self.assertLess(grown, 64 << 10, f"{target.name} kept {grown} KiB after {attack}")
        print(f"hostile_peers: {target.name}: {attack}: survived; good client {seconds:.2f} s "
              f"(normal {target.baseline_s:.2f} s); fds {fd_count(p.pid)} (rest {rest['fds']}); "
              f"rss +{grown} KiB; {time.monotonic() - started:.1f} s", flush=True)

    def tcp_targets(self):
        return [(t, listening_tcp(t.process.pid)) for t in (self.relay, self.queue)]

    def each_tcp_port(self, attack, send):
        """send(host, port, live) on each port; live() is false once the target died or the attack ran
        past its time, so an attack against a dead or wedged process ends."""
        for target, ports in self.tcp_targets():
            started = time.monotonic()

            def live():
                return target.process.alive() and time.monotonic() - started < ATTACK_SECONDS
            filtered = 0
            for host, port in ports:
                if not accepts_connections(host, port):
                    filtered += 1  # its packets never reach the process: nothing more to send
                elif live():
                    send(host, port, live)
            self.recovered(target, f"{attack} on {len(ports)} ports ({filtered} drop connections)", started)

    def test_wrapped_length(self):
        self.each_tcp_port("wrapped 64-bit length", lambda h, p, live: tcp_send(
            h, p, struct.pack("<Q", 0xFFFFFFFFFFFFFFF0) + bytes(8)))

    def test_huge_lengths(self):
        def send(h, p, live):
            for n in (0xFFFFFFFF, 0x7FFFFFFF, 1 << 31, 1 << 24):
                tcp_send(h, p, struct.pack("<I", n) + os.urandom(64))
                tcp_send(h, p, struct.pack("<Q", n) + os.urandom(64))
        self.each_tcp_port("huge length fields", send)

    def test_ucx_magic_then_garbage(self):
        rng = random.Random(SEED)

        def send(h, p, live):
            tcp_send(h, p, UCX_TCP_MAGIC + bytes([32]) + struct.pack("<I", 0))
            tcp_send(h, p, UCX_TCP_MAGIC + bytes([32]) + struct.pack("<I", 4) + struct.pack("<I", 1))
            tcp_send(h, p, UCX_TCP_MAGIC + bytes([0]) + struct.pack("<I", 0xFFFFFFF0) + os.urandom(64))
            for _ in range(20):
                if live():
                    tcp_send(h, p, UCX_TCP_MAGIC + rng.randbytes(rng.randrange(1, 300)), linger=0.01)
        self.each_tcp_port("UCX magic then bad packets", send)

    def test_random_bytes(self):
        rng = random.Random(SEED + 1)

        def send(h, p, live):
            for _ in range(20):
                if live():
                    tcp_send(h, p, rng.randbytes(rng.randrange(1, 8192)), linger=0.01)
        self.each_tcp_port("random bytes", send)

    def test_connect_and_close_flood(self):
        def send(h, p, live):
            for i in range(500):
                if i % 50 == 0 and not live():
                    return
                tcp_send(h, p, struct.pack("<Q", 1 << 40) + bytes(2048) if i % 2 else b"", linger=0)
        self.each_tcp_port("500 connect-and-close (half with a large length and 2 KiB)", send)

    def test_idle_and_slowloris_connections_do_not_lock_out_a_good_client(self):
        for target, ports in self.tcp_targets():
            started = time.monotonic()
            held = []
            try:
                for host, port in ports:
                    if not accepts_connections(host, port):
                        continue
                    for _ in range(100):
                        try:
                            held.append(socket.create_connection((host, port), timeout=1))
                        except OSError:
                            break
                # Slowloris: a byte at a time from half of them while a good client comes.
                stop = threading.Event()

                def drip():
                    while not stop.is_set():
                        for s in held[::2]:
                            try:
                                s.send(b"\x01")
                            except OSError:
                                pass
                        stop.wait(0.2)
                dripper = threading.Thread(target=drip, daemon=True)
                dripper.start()
                seconds = target.serve_good_client()
                limit = max(3 * target.baseline_s, target.baseline_s + 2.0)
                stop.set()
                dripper.join()
                self.assertLess(seconds, limit, f"{target.name}: good client took {seconds:.2f} s beside "
                                                f"{len(held)} idle and dripping connections")
            finally:
                for s in held:
                    s.close()
            self.recovered(target, f"{len(held)} idle/slowloris connections", started)

    def test_local_relay_garbage_and_idle_flood(self):
        path = listening_unix(self.local.process.pid)
        self.assertTrue(path, "the relay serves no local socket")
        started = time.monotonic()
        rng = random.Random(SEED + 2)
        for _ in range(50):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(path[0])
                    s.sendall(rng.randbytes(rng.randrange(1, 4096)))
                except OSError:
                    pass
        held = []
        try:
            for _ in range(100):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(path[0])
                except OSError:
                    s.close()
                    break
                held.append(s)
            seconds = self.local.serve_good_client()
            limit = max(3 * self.local.baseline_s, self.local.baseline_s + 2.0)
            self.assertLess(seconds, limit, f"local relay: good client took {seconds:.2f} s beside {len(held)} "
                                            f"idle connections")
            # The relay closes them itself: evicted for newer ones, the rest after its idle timeout.
            rest = self.rest[self.local.process.pid]["fds"]
            eventually(lambda: fd_count(self.local.process.pid) <= rest + 2, LOCAL_IDLE_SECONDS + 10,
                       f"local relay closed {len(held)} idle connections (has {fd_count(self.local.process.pid)} "
                       f"fds, {rest} at rest)")
        finally:
            for s in held:
                s.close()
        self.recovered(self.local, f"garbage and {len(held)} idle local connections", started)

    def test_local_relay_non_reading_clients(self):
        path = listening_unix(self.local.process.pid)
        self.assertTrue(path, "the relay serves no local socket")
        pid = self.local.process.pid
        started = time.monotonic()
        stop = threading.Event()
        sent = [0] * NON_READERS
        connects = [0] * NON_READERS

        def flood(i):
            """Pipelines acquires as fast as the relay takes them, never reading; reconnects when dropped."""
            batch = memoryview(LOCAL_ACQUIRE * 1024)
            while not stop.is_set():
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(path[0])
                        s.setblocking(False)
                        connects[i] += 1
                        at = 0
                        while not stop.is_set():
                            try:
                                n = s.send(batch[at:])
                                at = (at + n) % len(batch)
                                sent[i] += n
                            except BlockingIOError:
                                select.select([], [s], [], 0.05)
                except OSError:
                    stop.wait(0.05)

        flooders = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(NON_READERS)]
        for t in flooders:
            t.start()
        try:
            # Until every one has filled what the relay will queue for it: no byte taken for 0.5 s.
            progress = {"sent": -1, "at": time.monotonic()}

            def all_stuck():
                if sum(sent) != progress["sent"]:
                    progress.update(sent=sum(sent), at=time.monotonic())
                return all(connects) and time.monotonic() - progress["at"] > 0.5
            eventually(all_stuck, ATTACK_SECONDS, f"{NON_READERS} non-reading clients filled their buffers")
            fds_during, rss_during = fd_count(pid), rss_kib(pid)
            seconds = self.local.serve_good_client()
            limit = max(3 * self.local.baseline_s, self.local.baseline_s + 2.0)
            self.assertLess(seconds, limit, f"local relay: good client took {seconds:.2f} s beside {NON_READERS} "
                                            f"clients that send requests and read no answer")
        finally:
            stop.set()
            for t in flooders:
                t.join()
        rest = self.rest[pid]
        print(f"hostile_peers: local relay: {NON_READERS} non-reading clients sent {sum(sent) // 24} acquires "
              f"({sum(connects)} connections); good client {seconds:.2f} s (normal {self.local.baseline_s:.2f} s); "
              f"fds {rest['fds']} at rest, {fds_during} during; rss {rest['rss_kib']} KiB at rest, "
              f"{rss_during} KiB during", flush=True)
        self.recovered(self.local, f"{NON_READERS} clients pipelining acquires and reading nothing", started)

    def test_unknown_type_flood_from_an_authenticated_peer(self):
        """A peer holding the token sends what nothing here handles: 100 MiB of one-way messages of an
        application type, then requests. Nothing is kept for it, and every request is answered at once."""
        messages = 1600
        for target, address in ((self.relay, self.relay.process.wait_line("listening").split()[1]),
                                (self.queue, self.queue.process.wait_line("listening").split()[1])):
            started = time.monotonic()
            env = dict(os.environ, LAMINAR_TEST_TOKEN=TOKEN)
            done = subprocess.run([TRANSPORT_PEER, "client", address, "flood", str(messages)], env=env,
                                  capture_output=True, text=True, timeout=ATTACK_SECONDS * 4)
            self.assertEqual(done.returncode, 0, f"{target.name}: flood client failed: {done.stderr}")
            answers = dict(a.split("=") for a in done.stdout.split("FLOOD", 1)[1].split())
            # Refused at once: an application type nobody receives, a laminar type nobody serves.
            self.assertEqual(answers, {"RESOURCE_EXHAUSTED": "32", "UNIMPLEMENTED": "32"},
                             f"{target.name}: answers to the flood's requests")
            grown = rss_kib(target.process.pid) - self.rest[target.process.pid]["rss_kib"]
            # A third of what was sent: room for the allocator's caches and ASan's 16 MiB quarantine.
            self.assertLess(grown, 32 << 10, f"{target.name} holds {grown} KiB after {messages} x 64 KiB")
            self.recovered(target, f"{messages} x 64 KiB of unhandled messages and 64 requests from an "
                                   f"authenticated peer", started)


class StoppedRelay(unittest.TestCase):
    """actor -> middle -> tail, each with a short stall timeout. The middle is stopped (SIGSTOP): it
    keeps its connections, so only its silence gives it away. The tail must give it up within the
    stall timeout (plus scheduling), fail over to the actor and take the next version from it; the
    middle, continued, must catch up."""

    STALL_MS = 1000

    def test_stopped_relay_in_chain_is_failed_over(self):
        started = []

        def start(*args):
            p = Process([RELAY_SERVER, "--token", TOKEN, "--mib", "1", "--stall-timeout-ms", str(self.STALL_MS),
                         *args])
            started.append(p)
            return p
        mid = None
        try:
            actor = start("--actor", "--publish-on-usr1")
            a = actor.wait_line("listening").split()[1]
            actor.wait_line("published 1")
            mid = start("--upstream", a)
            m = mid.wait_line("listening").split()[1]
            tail = start("--upstream", m, "--upstream", a)
            self.assertEqual(tail.wait_line("upstream").split()[1], m)
            tail.wait_line("committed 1")

            # Stopped at a random point between two of its idle messages, not right after the version.
            pause = random.Random(SEED + 3).uniform(0.3, 0.8)
            print(f"hostile_peers: seed {SEED}: the middle relay is stopped {pause:.2f} s after the version",
                  flush=True)
            time.sleep(pause)
            since = tail.mark()
            os.kill(mid.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            line, at = tail.wait_line_timed("stalled", since=since)
            self.assertEqual(line.split()[1], m)
            gave_up = at - stopped
            self.assertEqual(tail.wait_line("upstream", since=since).split()[1], a)
            self.assertGreater(gave_up, 0.5 * self.STALL_MS / 1000)
            self.assertLess(gave_up, self.STALL_MS / 1000 + 2.0)

            # The chain re-formed around the stopped relay carries the next version.
            os.kill(actor.pid, signal.SIGUSR1)
            published, published_at = actor.wait_line_timed("published 2")
            committed, committed_at = tail.wait_line_timed("committed 2", since=since)
            self.assertEqual(committed.split()[2], published.split()[2])
            os.kill(mid.pid, signal.SIGCONT)
            self.assertEqual(mid.wait_line("committed 2").split()[2], published.split()[2])
            self.assertTrue(all(p.alive() for p in started))
            print(f"hostile_peers: stopped relay: stall_timeout {self.STALL_MS} ms; the relay below gave it up "
                  f"after {gave_up:.2f} s and committed the next version {committed_at - published_at:.2f} s after "
                  f"it was published; continued, the stopped relay caught up", flush=True)
        finally:
            if mid is not None and mid.alive():
                os.kill(mid.pid, signal.SIGCONT)
            for p in started:
                p.stop()


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    RELAY_SERVER, QUEUE_SERVER, TRANSPORT_PEER = sys.argv[1:4]
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
