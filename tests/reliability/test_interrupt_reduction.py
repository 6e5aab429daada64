"""`Runtime.interrupt_gradient_reductions`: live recovery's escape from a gradient all-reduce
that cannot complete any more.

Under CI's load a survivor sat in a gloo ring's receive for the whole collective timeout
while the other replicas, already recovering, waited for it in the agreement; neither the
peers' closed sockets nor shutting down its own woke that receive. Interrupted, the
reducer's wait gives up by itself and fails as a broken connection, which live recovery
takes for a lost replica. Two real gloo processes (fresh interpreters, a 60 s collective
timeout); every wait bounded."""
import time

from tests.reliability.test_group_sockets import _line, start_two_replicas

_REPLICA = r'''
import json, sys, threading, time
import torch
import torchstrategy as ts
from torchstrategy import runtime
rank = int(sys.argv[1])
strategy = ts.MultiWorkerMirroredStrategy()
with strategy.scope():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

def step(x):
    model(x).sum().backward()

# Interrupted, then resumed before the step: the step runs as usual on both replicas.
runtime.current().interrupt_gradient_reductions(True)
runtime.current().interrupt_gradient_reductions(False)
strategy.run(step, args=(torch.ones(2, 4) * (rank + 1),))
print(json.dumps({"summed": model.weight.grad.tolist()}), flush=True)
if rank == 1:
    sys.stdin.readline()        # alive and silent: it never joins the next all-reduce
    sys.exit(0)
events = []
def interrupt():
    time.sleep(1.0)
    events.append("interrupting")
    runtime.current().interrupt_gradient_reductions(True)
threading.Thread(target=interrupt, daemon=True).start()
model.zero_grad()
started = time.monotonic()
try:
    strategy.run(step, args=(torch.ones(2, 4),))
    outcome, kind = "completed", ""
except Exception as error:
    events.append("failed")
    outcome, kind = str(error), type(error).__name__
print(json.dumps({"outcome": outcome[:600], "kind": kind, "events": events,
                  "seconds": time.monotonic() - started}), flush=True)
'''


def test_an_interrupted_gradient_all_reduce_fails_as_a_broken_connection():
    replicas = start_two_replicas(_REPLICA, timeout_seconds=60)
    try:
        deadline = time.monotonic() + 150
        first = [_line(replica, deadline) for replica in replicas]
        result = _line(replicas[0], deadline)
    finally:
        for replica in replicas:
            replica.kill()
            replica.wait(10)
    # The step before the interruption summed both replicas' gradients (x = 1 and 2, two
    # rows each: 2 + 4 = 6 per weight), on both.
    assert first[0] == first[1] == {"summed": [[6.0, 6.0, 6.0, 6.0]]}, first
    # The lone all-reduce ended because it was interrupted (not at gloo's 60 s timeout,
    # whose text says "Timed out"), as a connection closed: a lost replica to live recovery.
    assert result["events"] == ["interrupting", "failed"], result
    assert result["kind"] == "CollectiveError", result
    text = result["outcome"]
    assert "connections were closed for live recovery" in text, text
    assert "failed because another replica died or ended (its connection closed)" in text, text
    assert "timed out" not in text.lower(), text
