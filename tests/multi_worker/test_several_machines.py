"""Several machines for real: two nodes of a cluster of network namespaces (tests/helpers/
cluster.py), each with its own address, hostname and /etc/hosts, where each hostname
resolves to loopback (127.0.1.1), as Debian's and Ubuntu's default /etc/hosts have it, and
nothing about the network is set (no GLOO_SOCKET_IFNAME): the library picks the interface.

Two machines x two CPU replicas must train exactly like one device (the core equivalence
test's model and data), started as a user would: ``python train.py`` with TF_CONFIG naming
the machines by hostname, and torchrun with ``--rdzv-endpoint=node0:PORT`` and no other
network flag. Where the machines cannot connect, every process ends within the timeout with
one error naming the addresses the machines advertised and the fix.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.core.test_equivalence import single_device_training
from tests.helpers import ROOT
from tests.helpers.cluster import cluster
from tests.helpers.multi_machine import clean_env, free_port, start_tf_config_machines, \
    start_torchrun_machines, wait_all
from tests.helpers.replicas import assert_same_tensors

pytestmark = pytest.mark.multi_worker

TIMEOUT = 30   # the collective timeout of every process here


@pytest.fixture(scope="module")
def nodes():
    with cluster(2, hostname_resolves_to="loopback") as made:
        yield made


@pytest.fixture(scope="module")
def reference():
    return single_device_training("sgd")


def _env(**extra):
    env = {"TORCHSTRATEGY_TIMEOUT_SECONDS": str(TIMEOUT)}
    env.update(extra)
    return env


def _check_equivalence(outdir, machines, reference):
    codes = wait_all(machines, timeout=240)
    logs = [m.log() for m in machines]
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    _check_train_results(outdir, reference)
    return logs


def _check_train_results(outdir, reference):
    for rank in range(4):
        result = torch.load(os.path.join(outdir, f"train-rank{rank}.pt"))
        assert result["facts"]["replicas"] == 4 and result["facts"]["num_workers"] == 2
        for variant in ("default", "hierarchical"):
            got = result[variant]
            torch.testing.assert_close(torch.tensor(got["losses"]),
                                       torch.tensor(reference["losses"]), atol=1e-6, rtol=0)
            assert_same_tensors(got["final"], reference["final"], atol=1e-6, rtol=0,
                                what=f"{variant} rank {rank}")


def test_the_cluster_starts_shapes_and_leaves_nothing_behind():
    started = time.monotonic()
    with cluster(3, rate="2gbit") as made:
        setup_seconds = time.monotonic() - started
        for node in made.nodes:
            qdisc = subprocess.run(["tc", "-n", node.netns, "qdisc", "show", "dev",
                                    node.ifname], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "2Gbit" in qdisc, qdisc
            assert os.path.exists(f"/etc/netns/{node.netns}/hosts")
        sleepers = [subprocess.Popen(node.command(["sleep", "600"])) for node in made.nodes]
        deadline = time.monotonic() + 30
        while not all(node.pids() for node in made.nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(node.pids() for node in made.nodes)
        assert made.leftovers() != []
    closed_after = time.monotonic() - started
    assert made.leftovers() == []
    for sleeper in sleepers:
        assert sleeper.wait(10) == -9   # killed at close
    print(f"3 shaped nodes: set up in {setup_seconds:.2f} s, all gone {closed_after:.2f} s "
          "after the start")


def test_the_cluster_is_what_a_user_meets(nodes):
    node0, node1 = nodes.nodes
    out = node1.python("import socket; print(socket.gethostname(), "
                       "socket.gethostbyname(socket.gethostname()), "
                       "socket.gethostbyname('node0'))").split()
    assert out == ["node1", "127.0.1.1", node0.address]
    # The nodes reach each other's addresses, and only through the bridge.
    server = subprocess.Popen(node0.command([sys.executable, "-c", (
        "import socket; s = socket.socket(); s.bind(('', 5555)); s.listen(); "
        "c, a = s.accept(); c.sendall(a[0].encode()); c.close()")]),
        stdout=subprocess.PIPE, text=True)
    try:
        seen = node1.python("import socket, time\n"
                            "for _ in range(100):\n"
                            "    try:\n"
                            f"        c = socket.create_connection(({node0.address!r}, 5555))\n"
                            "        break\n"
                            "    except OSError:\n"
                            "        time.sleep(0.05)\n"
                            "print(c.recv(100).decode())").strip()
        assert seen == node1.address
    finally:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def tf_config_run(nodes, tmp_path_factory):
    """One TF_CONFIG job (2 machines x 2 replicas) running two scenarios in turn, each in
    its own try/except (tests/scripts/multi_worker_train.py's "train+sharded"): the
    equivalence training, then ShardedStrategy's hybrid mesh. One start instead of two;
    each scenario's test reads its own results and its own error files, so one failing
    does not hide the other. Returns (outdir, exit codes, logs)."""
    outdir = tmp_path_factory.mktemp("tf_config")
    # TF_CONFIG names the machines as users write them: node0:PORT, node1:2222.
    machines = start_tf_config_machines(
        "train+sharded", outdir, replicas=2, hosts=["node0", "node1"], netns=nodes.nodes,
        **_env(TEST_LOG_LEVEL="INFO", ATOL="1e-6"))
    codes = wait_all(machines, timeout=300)
    return outdir, codes, [m.log() for m in machines]


def _scenario_errors(run, part):
    """Fails with the scenario's tracebacks where any replica wrote one, or with the logs
    where a replica left no result (it died, or never got that far); and, where neither
    scenario raised, unless both machines exited 0."""
    outdir, codes, logs = run
    errors = sorted(name for name in os.listdir(outdir) if name.endswith(".error"))
    mine = [name for name in errors if name.startswith(f"{part}-rank")]
    details = "\n\n".join(open(os.path.join(outdir, name)).read() for name in mine)
    assert not mine, f"{part} raised on {mine}:\n{details}"
    missing = [r for r in range(4)
               if not os.path.exists(os.path.join(outdir, f"{part}-rank{r}.pt"))]
    assert not missing, (f"no {part} result from ranks {missing}:\n"
                         + "\n\n".join(log[-3000:] for log in logs))
    assert errors or codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)


def test_tf_config_machines_named_by_hostname_train_exactly(tf_config_run, reference):
    tmp_path, _, logs = tf_config_run
    _scenario_errors(tf_config_run, "train")
    _check_train_results(tmp_path, reference)
    # The choice is logged (once per replica process, at INFO).
    assert "using network interface eth0" in logs[1], logs[1][-3000:]


def test_torchrun_with_only_the_endpoint_trains_exactly(nodes, tmp_path, reference):
    machines = start_torchrun_machines("train", tmp_path, nproc=2,
                                       hosts=["node0", "node1"], netns=nodes.nodes,
                                       user_flags_only=True, **_env())
    _check_equivalence(tmp_path, machines, reference)


def test_torchrun_endpoint_by_address_with_the_is_host_recipe_trains_exactly(
        nodes, tmp_path, reference):
    # node0's IP as the endpoint: with Debian's /etc/hosts torchrun recognises it on no
    # machine, and no agent would host the store (troubleshooting.md). The documented
    # recipe: is_host=true on node0, false elsewhere; nothing else about the network set.
    machines = start_torchrun_machines("train", tmp_path, nproc=2,
                                       hosts=[n.address for n in nodes.nodes],
                                       netns=nodes.nodes, is_host_only=True, **_env())
    _check_equivalence(tmp_path, machines, reference)


def test_the_interface_chosen_on_each_node(nodes):
    # The module alone (not the whole library: a faster start).
    code = ("import importlib.util, json, sys; "
            "spec = importlib.util.spec_from_file_location('network', {path!r}); "
            "network = sys.modules['network'] = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(network); "
            "c = network.choose('node0'); "
            "print(json.dumps([c.interface, c.address] if c else None))"
            ).format(path=os.path.join(ROOT, "torchstrategy", "launch", "network.py"))
    for node in nodes.nodes:
        # node0 reaches the chief (itself) by a name that resolves to loopback there; node1
        # by node0's address: both must advertise their own eth0 address.
        chosen = node.python(code).strip()
        assert chosen == f'["eth0", "{node.address}"]', (node, chosen)


def test_advertised_loopback_is_one_error_naming_addresses_and_fix(nodes, tmp_path):
    # The user pins gloo to loopback on both machines (a wrong GLOO_SOCKET_IFNAME): theirs
    # is left alone, and every replica ends at once, before gloo tries to connect, with one
    # error naming what each machine advertised and the fix.
    started = time.monotonic()
    machines = start_tf_config_machines(
        "train", tmp_path, replicas=2, hosts=["node0", "node1"], netns=nodes.nodes,
        **_env(GLOO_SOCKET_IFNAME="lo"))
    codes = wait_all(machines, timeout=3 * TIMEOUT + 60)
    elapsed = time.monotonic() - started
    logs = [m.log() for m in machines]
    assert all(code != 0 for code in codes), logs
    # A machine's two replicas write to one log, unbuffered, and their tracebacks can
    # interleave character by character (seen in CI): each machine must show the error
    # whole at least once; every line that is whole must be the full error.
    per_machine = [[line for line in log.splitlines()
                    if line.startswith("RuntimeError: torchstrategy:")] for log in logs]
    assert all(per_machine), "\n\n".join(log[-3000:] for log in logs)
    errors = [line for lines in per_machine for line in lines]
    assert len(errors) <= 4, errors
    for error in errors:
        assert "the replicas run on 2 machines, but replica 0 on node0 (machine 0): " \
               "127.0.0.1 (lo, GLOO_SOCKET_IFNAME);" in error
        assert "replica 3 on node1 (machine 1): 127.0.0.1 (lo, GLOO_SOCKET_IFNAME) " \
               "advertise(s) a loopback address" in error
        assert "Fix: set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) on every machine" in error
    assert not any("Gloo connectFullMesh" in log for log in logs)
    # No wait for connections that cannot succeed (start-up and exit only).
    assert elapsed < 2 * TIMEOUT, elapsed
    assert not any(node.pids() for node in nodes.nodes)


def test_sharded_hybrid_mesh_shards_within_a_node_and_replicates_across(tf_config_run):
    # Run after the equivalence training by the same TF_CONFIG job (see tf_config_run);
    # check_equal_to_one_device asserted the losses and weights (1e-6) on every replica.
    tmp_path = tf_config_run[0]
    _scenario_errors(tf_config_run, "sharded")
    for rank in range(4):
        result = torch.load(os.path.join(tmp_path, f"sharded-rank{rank}.pt"))
        assert result["replicas"] == 4
        assert result["placements"] == ["Replicate", "Shard"]
        # Rows: the machines (replicated across); columns: a machine's replicas (sharded).
        assert result["mesh"] == [[0, 1], [2, 3]]


_PS_CHIEF = """
import json, sys
import torch
import torchstrategy as ts
from tests.helpers import ps_cluster as h

x, y = (t.double() for t in h.regression_data(n=32))
torch.set_default_dtype(torch.float64)
strategy = ts.ParameterServerStrategy(ts.SimpleClusterResolver(
    json.loads(sys.argv[1]), task_type="chief", task_id=0), startup_timeout=120)
torch.manual_seed(0)
plain = h.Regression()
with strategy.scope():
    model = h.Regression()
model.load_state_dict(plain.state_dict())
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
reference = torch.optim.Adam(plain.parameters(), lr=0.01)
coordinator = ts.ClusterCoordinator(strategy)
for _ in range(3):  # sequential: each fetch waits, so the steps do not overlap
    coordinator.schedule(h.train_step, args=(model, optimizer, iter([(x, y)]))).fetch()
    h.train_step(plain, reference, iter([(x, y)]))
state = model.state_dict()
for key, value in plain.state_dict().items():
    torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0)
print("equal to one device", flush=True)
"""


def test_parameter_server_on_the_other_node_trains_like_one_device(nodes):
    # The chief and the worker on node0, the parameter server on node1, the spec naming the
    # machines by hostname (which resolve to loopback on their own machine).
    node0, node1 = nodes.nodes
    port = free_port(netns=node0)
    spec = json.dumps({"chief": [f"node0:{port}"], "worker": ["node0:1"], "ps": ["node1:2"]})
    env = clean_env(TORCHSTRATEGY_TIMEOUT_SECONDS=TIMEOUT)
    servers = [subprocess.Popen(node.command([
        sys.executable, "-m", "torchstrategy.server", "--cluster_spec", spec, "--task_type",
        job, "--task_id", "0", "--startup_timeout", "120"]), env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node, job in ((node0, "worker"), (node1, "ps"))]
    chief = subprocess.Popen(node0.command([sys.executable, "-c", _PS_CHIEF, spec]), env=env,
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        out, _ = chief.communicate(timeout=240)
        assert chief.returncode == 0 and "equal to one device" in out, out[-4000:]
        # The servers end with their chief (nothing is left on either node).
        for server in servers:
            server.wait(timeout=60)
    finally:
        for process in servers + [chief]:
            if process.poll() is None:
                process.kill()
                process.communicate()
