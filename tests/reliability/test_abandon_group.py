"""`Runtime.abandon_process_group` (live recovery's first move after a failed step) closes
this replica's end of the group's connections even while something still holds the group.

Destroying the group closes its connections only once its last reference goes; a broken
collective's work (or any other holder) may keep it alive for a while. Meanwhile a replica
blocked in a collective with this one would wait for the collective timeout, while this
one is already agreeing on the survivors: under load, CI saw a survivor wait 32 s in an
all-reduce with a replica that had regrouped, which then gave up. Two real gloo processes
(fresh interpreters, a 20 s collective timeout); every wait bounded."""
import time

from tests.reliability.test_group_sockets import _line, start_two_replicas

_REPLICA = r'''
import json, sys, time
import torch, torch.distributed as dist
import torchstrategy as ts
from torchstrategy import _compat, runtime
rank = int(sys.argv[1])
strategy = ts.MultiWorkerMirroredStrategy()
tensor = torch.ones(4)
dist.all_reduce(tensor)
print(json.dumps({"ready": True, "sockets": len(runtime.current().group_sockets())}),
      flush=True)
sys.stdin.readline()
if rank == 1:
    held = _compat.default_process_group()   # a holder outside torch: the group lives on
    runtime.current().abandon_process_group()
    print(json.dumps({"abandoned": True, "still_held": held is not None}), flush=True)
    sys.stdin.readline()                       # alive, as a replica agreeing on survivors
    sys.exit(0)
started = time.monotonic()
try:
    dist.all_reduce(tensor)
    outcome = "completed"
except Exception as error:
    outcome = str(error)[:300]
print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - started}), flush=True)
'''


def test_an_abandoned_group_fails_the_peers_collective_at_once_even_while_held():
    replicas = start_two_replicas(_REPLICA, timeout_seconds=20)
    try:
        deadline = time.monotonic() + 120
        ready = [_line(replica, deadline) for replica in replicas]
        replicas[0].stdin.write("go\n")        # replica 0 enters an all-reduce alone
        replicas[0].stdin.flush()
        time.sleep(1.0)
        replicas[1].stdin.write("go\n")        # replica 1 abandons the group, still alive
        replicas[1].stdin.flush()
        abandoned = _line(replicas[1], deadline)
        result = _line(replicas[0], deadline)
    finally:
        for replica in replicas:
            replica.kill()
            replica.wait(10)
    assert all(r["sockets"] >= 1 for r in ready), ready
    assert abandoned == {"abandoned": True, "still_held": True}
    # The all-reduce failed as after a peer's crash (its connection closed), not at the
    # collective timeout ("Timed out").
    text = result["outcome"].lower()
    assert "timed out" not in text and ("closed" in text or "reset" in text), result
