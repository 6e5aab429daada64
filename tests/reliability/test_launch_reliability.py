"""Issue 19, items 1, 8, 9: the rendezvous store listens on loopback only; a killed
`ts.launch` parent leaves no replica and no /tmp/pymp-* directory; a re-executed replica
runs one parent watch."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import SCRIPTS
from tests.helpers.processes import alive, plain_environment

SCRIPT = os.path.join(SCRIPTS, "reliability_launch.py")
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("real_exit")]  # exits as users' do


def _wait_for(paths, process, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
        if process.poll() is not None:
            pytest.fail(f"the job ended early (rc {process.returncode}): {_output(paths)}")
        time.sleep(0.1)
    assert all(os.path.exists(p) for p in paths), f"not written in {seconds}s: {paths}"


def _log(tmp_path):
    # A file, not a pipe: replicas that outlive the parent would hold a pipe open.
    return open(tmp_path / "output.log", "w")


def _output(paths):
    path = os.path.join(os.path.dirname(paths[0]), "output.log")
    return open(path).read()[-3000:] if os.path.exists(path) else ""


def listening_addresses(port):
    """The local addresses of the sockets listening on `port` (IPv4 and IPv6)."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


def _assert_loopback_only(port):
    addresses = listening_addresses(port)
    assert addresses, f"nothing listens on port {port}"
    assert all(a in ("127.0.0.1", "::ffff:127.0.0.1") for a in addresses), \
        f"the rendezvous store on port {port} listens on {addresses}, not loopback only"


def _kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killed_launch_parent_leaves_no_replica_and_store_is_loopback_only(tmp_path, sig):
    process = subprocess.Popen([sys.executable, SCRIPT, "launch_sleep", str(tmp_path)],
                               env=plain_environment(), stdout=_log(tmp_path), stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        _wait_for([tmp_path / f"pid{r}" for r in range(2)], process)
        # Item 1: ts.launch's store is reachable from this machine only.
        _assert_loopback_only(int((tmp_path / "port0").read_text()))
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        assert all(alive(p) for p in pids)
        # Item 8: the parent is killed (only it, not its process group).
        os.kill(process.pid, sig)
        process.wait(timeout=30)
        deadline = time.monotonic() + 30   # a hang guard: the replicas poll for their parent
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        survivors = [p for p in pids if alive(p)]
        assert not survivors, f"replicas {survivors} outlived the killed ts.launch parent"
        temp_dir = (tmp_path / "launcher_temp_dir").read_text()
        assert os.path.basename(temp_dir).startswith("pymp-")
        assert not os.path.exists(temp_dir), f"the killed launcher left {temp_dir} behind"
    finally:
        _kill_group(process)


def test_reexec_store_is_loopback_only_and_one_parent_watch_per_replica(tmp_path):
    process = subprocess.Popen([sys.executable, SCRIPT, "reexec_many", str(tmp_path)],
                               env=plain_environment(), stdout=_log(tmp_path), stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        _wait_for([tmp_path / f"pid{r}" for r in range(2)], process)
        # Item 1: re-execution's store (hosted by replica 0) listens on loopback only.
        _assert_loopback_only(int((tmp_path / "port0").read_text()))
        # Item 9: 20 strategies, one watch thread in the re-executed replica, none in 0.
        assert (tmp_path / "watchers1").read_text() == "1"
        assert (tmp_path / "watchers0").read_text() == "0"
        (tmp_path / "done").write_text("")
        process.wait(timeout=120)
        assert process.returncode == 0, (tmp_path / "output.log").read_text()[-3000:]
    finally:
        _kill_group(process)


def test_sigterm_after_launch_returned_leaves_no_multiprocessing_directory(tmp_path):
    # Issue 36, item 13: the fork server outlives ts.launch (the next launch reuses it);
    # its socket, /tmp/pymp-*/listener-*, was left behind by a SIGTERM to the idle process.
    script = os.path.join(SCRIPTS, "failing_replica.py")
    process = subprocess.Popen([sys.executable, script, "launch_then_idle", str(tmp_path)],
                               env=plain_environment(), stdout=_log(tmp_path),
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for([tmp_path / "idle"], process)
        temp_dir = (tmp_path / "launcher_temp_dir").read_text()
        assert os.path.basename(temp_dir).startswith("pymp-") and os.path.isdir(temp_dir)
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        assert process.returncode == -signal.SIGTERM   # ends as SIGTERM ends a process
        assert not os.path.exists(temp_dir), f"{temp_dir} left: {os.listdir(temp_dir)}"
    finally:
        _kill_group(process)


# After a first launch, a process forked from the launcher (as `ts.launch(...,
# start_method="fork")` and Lightning's notebook strategy fork the pytest worker itself)
# inherited the launcher's SIGTERM clean-up: a SIGTERM to it removed the launcher's
# /tmp/pymp-* directory, and every later launch failed ("No such file or directory" at the
# fork server's socket). Seen in CI: 73 tests of one worker failed after one such SIGTERM.
_FORKED_CHILD_TERMINATED = """
import multiprocessing.util, os, signal
import torchstrategy as ts

ts.launch(os.getpid, num_replicas=1, timeout_seconds=60)  # the fork server starts
temp_dir = multiprocessing.util.get_temp_dir()
child = os.fork()
if child == 0:
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(0)   # not reached: SIGTERM ends the child
_, status = os.waitpid(child, 0)
print("child ended by signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
print("directory kept", os.path.isdir(temp_dir))
print("second launch", isinstance(ts.launch(os.getpid, num_replicas=1, timeout_seconds=60), int))
"""


def test_sigterm_to_a_process_forked_from_the_launcher_keeps_its_directory():
    result = subprocess.run([sys.executable, "-c", _FORKED_CHILD_TERMINATED],
                            env=plain_environment(), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"child ended by signal {int(signal.SIGTERM)}", "directory kept True",
        "second launch True"], result.stdout + result.stderr[-3000:]


def test_torch_compile_under_launch_leaks_no_semaphore():
    # Issue 36, item 13: the launcher ended the replicas as soon as they had returned,
    # before their multiprocessing finalizers unlinked the semaphore tqdm made for
    # torch.compile's progress bar: "resource_tracker: There appear to be 2 leaked
    # semaphore objects to clean up at shutdown".
    script = os.path.join(SCRIPTS, "failing_replica.py")
    result = subprocess.run([sys.executable, script, "launch_compile"],
                            env=plain_environment(), capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "1"
    assert "leaked semaphore" not in result.stderr, result.stderr[-3000:]
