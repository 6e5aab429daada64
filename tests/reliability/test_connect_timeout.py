"""Issue 19, item 5: a chief port held by some other program (a plain listening socket, not
a rendezvous store). torch's store client connects, then waits for a handshake reply without
a bound; the worker must give up within the strategy's timeout and name the address."""
import json
import socket
import subprocess
import sys

import pytest

from tests.helpers.processes import plain_environment

TIMEOUT = 3

WORKER = f"""
import torchstrategy as ts
ts.MultiWorkerMirroredStrategy(
    communication_options=ts.CommunicationOptions(timeout_seconds={TIMEOUT}))
"""


@pytest.mark.timeout(120)
def test_a_worker_gives_up_on_a_port_held_by_another_program_and_names_it():
    with socket.socket() as squatter:  # accepts connections (the backlog) and never answers
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        env = plain_environment()
        env["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": [f"127.0.0.1:{port}", "127.0.0.1:2222"]},
            "task": {"type": "worker", "index": 1}})
        # 90 s: a hang guard only (without the bound, torch's handshake waits forever).
        result = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True,
                                text=True, timeout=90)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port}" in last, result.stderr[-3000:]
    # It gave up because of the strategy's timeout, and says which.
    assert f"did not answer as a rendezvous store within {TIMEOUT} s" in last, \
        result.stderr[-3000:]
