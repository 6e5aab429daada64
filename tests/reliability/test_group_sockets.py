"""`launch.sockets`: the sockets a process group opened are found by inode (the rendezvous
store's port left out), and shutting them down makes a collective blocked on a silent peer
fail at once: a peer frozen by SIGSTOP neither answers nor closes its connections, as a
machine whose link went down, and the collective would otherwise wait for its timeout
(60 s here). Two real gloo processes (fresh interpreters); every wait bounded."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

_REPLICA = r'''
import datetime, json, sys, threading, time
import torch, torch.distributed as dist
from torchstrategy.launch import sockets
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
before = sockets.socket_inodes()
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
group = sockets.opened_since(before, except_port=port)
tensor = torch.ones(4)
dist.all_reduce(tensor)
print(json.dumps({"ready": True, "group": len(group),
                  "all_new": len(sockets.opened_since(before))}), flush=True)
if rank == 1:
    time.sleep(120)
    sys.exit(0)
sys.stdin.readline()               # the test froze replica 1
events, closed = [], []
def shut():
    time.sleep(1.0)
    events.append(("shutting", ""))
    closed.append(sockets.shut_down(group))
breaker = threading.Thread(target=shut, daemon=True)
breaker.start()
try:
    dist.all_reduce(tensor)
    events.append(("completed", ""))
except Exception as error:
    events.append(("failed", str(error)[:300]))
breaker.join(30)   # shut_down may still be on its other sockets when the collective fails
print(json.dumps({"events": events, "closed": closed}), flush=True)
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_replicas(program, timeout_seconds):
    """Replicas 0 and 1 of `program` (Python source, given its rank as argv[1]) as fresh
    interpreters with a launcher's variables on loopback, collectives bounded by
    `timeout_seconds`; stdin and stdout are pipes (text)."""
    port = _free_port()
    replicas = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHSTRATEGY_TIMEOUT_SECONDS=str(timeout_seconds))
        replicas.append(subprocess.Popen([sys.executable, "-c", program, str(rank)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, env=env))
    return replicas


def _line(process, deadline):
    """The next JSON line `process` prints, within `deadline` (a monotonic time)."""
    os.set_blocking(process.stdout.fileno(), False)
    buffer = ""
    while time.monotonic() < deadline:
        chunk = process.stdout.readline()
        if chunk:
            buffer += chunk
            if buffer.endswith("\n"):
                return json.loads(buffer)
        elif process.poll() is not None:
            break
        else:
            time.sleep(0.05)
    raise AssertionError(f"no line from replica within the bound (exit {process.poll()})")


def test_breaking_a_groups_sockets_ends_a_collective_blocked_on_a_frozen_peer():
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    replicas = [subprocess.Popen([sys.executable, "-c", _REPLICA, str(rank), str(port)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env)
                for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        first = [_line(replica, deadline) for replica in replicas]
        os.kill(replicas[1].pid, signal.SIGSTOP)
        replicas[0].stdin.write("go\n")
        replicas[0].stdin.flush()
        result = _line(replicas[0], deadline)
    finally:
        for replica in replicas:
            replica.kill()
            replica.wait(10)
    # The gloo pair and listener are the group's; nothing on the store's port opened then.
    assert first[0]["group"] >= 1 and first[0]["group"] == first[0]["all_new"]
    # The sockets were shut, then the all-reduce failed as after a peer's crash (its
    # connection closed), not at its timeout ("Timed out").
    (first, _), (second, text) = result["events"]
    assert (first, second) == ("shutting", "failed") and result["closed"][0] >= 1, result
    assert "closed" in text.lower() or "reset" in text.lower(), result
