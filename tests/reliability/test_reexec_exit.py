"""Replica 0 of a re-executed job ends as its program did, whatever its supervisor is doing.

Replica 0's supervisor records in the rendezvous store how each replica ended, from a
daemon thread. torch's store calls release the GIL; a daemon thread that takes it back
while the interpreter finalizes is ended by pthread_exit (Python 3.11), whose unwinding
through the bindings' noexcept frames calls std::terminate: a job whose replicas all
succeeded ended in SIGABRT ("terminate called without an active exception"), at random,
more often on a loaded machine (seen in tests/lightning/test_lightning.py's launches).

The test widens that window to make it certain: the store answers the supervisor's first
question after two seconds (a blocking torch store call, as on a loaded machine),
releasing the process group takes half a second, and the program's finalization four (as
a program's large heap can).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

# Tests of how processes exit: they exit as users' do (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_exit")

PROGRAM = textwrap.dedent("""
    import datetime
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    from torchstrategy.launch import rendezvous, world as world_lib
    from torchstrategy.launch.reexec import Supervisor

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))


    class SlowStore(dist.Store):
        '''The rendezvous store of a loaded machine: `check` answers after two seconds
        spent in a torch store call (the GIL released, as in every such call).'''

        def __init__(self, store):
            super().__init__()
            self._store = store

        def check(self, keys):
            try:
                self._store.wait(["never set"], datetime.timedelta(seconds=2))
            except Exception:   # its timeout: the two seconds have passed
                pass
            return self._store.check(keys)

        def get(self, key):
            return self._store.get(key)

        def set(self, key, value):
            self._store.set(key, value)

        def set_timeout(self, timeout):
            self._store.set_timeout(timeout)


    class SlowFinalization:
        # Run while the interpreter finalizes (module teardown), when the module's globals
        # may be gone already: the sleep is bound here.
        def __del__(self, sleep=time.sleep):
            sleep(4)


    heap = SlowFinalization()
    replica_1 = subprocess.Popen([sys.executable, "-c", "pass"])
    supervisor = Supervisor({1: replica_1}, rendezvous.BoundedStore(SlowStore(store)))
    # Releasing the process group takes a moment, in which the supervisor's watch sees
    # replica 1's end and asks the store about it.
    supervisor.at_exit(lambda: time.sleep(0.5))
    # Asked through a client of its own: the supervisor's client may be busy.
    client = dist.TCPStore("127.0.0.1", store.port, 1, False,
                           timeout=datetime.timedelta(seconds=30))
    recorded = client.check([world_lib.ENDED_KEY.format(1)])
    print(f"replica 1 exited with {replica_1.returncode}, its end recorded: {recorded}",
          flush=True)
""")


@pytest.mark.timeout(120)
def test_replica_zero_exits_cleanly_while_its_supervisor_records_an_end(tmp_path):
    script = tmp_path / "replica_zero.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=90)
    assert "terminate called" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    # The exit waited for the supervisor: how replica 1 ended is in the store.
    assert result.stdout.strip() == "replica 1 exited with 0, its end recorded: True", \
        result.stdout
