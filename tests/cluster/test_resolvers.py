"""SLURM and Kubernetes resolvers and the detection order, on hand-made environments (in
process; the real-process checks are in test_launch.py)."""
import json
import logging

import pytest

import torchstrategy as ts
from torchstrategy.cluster_resolver import detect
from torchstrategy.cluster_resolver.slurm import expand_hostlist, expand_tasks_per_node


def srun(**extra):
    """Rank 3 of an srun step of 4 tasks, 2 on each of gpu07 and gpu08."""
    env = dict(SLURM_JOB_ID="123456", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="1",
               SLURM_NODEID="1", SLURM_NTASKS="4", SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_TASKS_PER_NODE="2(x2)")
    env.update({k: str(v) for k, v in extra.items()})
    return {k: v for k, v in env.items() if v != "None"}


def pod(**extra):
    """Worker pod 1 of a PyTorchJob of 3 pods (a master and 2 workers), nprocPerNode 1."""
    env = dict(MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="3", RANK="2",
               PET_NNODES="3", PET_NPROC_PER_NODE="1", PET_NODE_RANK="2",
               KUBERNETES_SERVICE_HOST="10.96.0.1")
    env.update({k: str(v) for k, v in extra.items()})
    return {k: v for k, v in env.items() if v != "None"}


TORCHRUN = dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", GROUP_RANK="0",
                GROUP_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="job")


def tf_config(workers):
    return json.dumps({"cluster": {"worker": [f"h{i}:2222" for i in range(workers)]},
                       "task": {"type": "worker", "index": 0}})


@pytest.mark.parametrize("hostlist,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("r[1-2]n[8,10]", ["r1n8", "r1n10", "r2n8", "r2n10"]),
    ("login-1,node[5]", ["login-1", "node5"]),
])
def test_hostlists_expand_in_order_keeping_zero_padding(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist,why", [
    ("", "empty"), ("node[1-3", "not closed"), ("node1]", "no '\\['"), ("n[]", "empty brackets"),
    ("n[5-2]", "reversed"), ("n[a-c]", "neither a number"), ("a,,b", "empty name"),
    ("n[[1]]", "nested"),
])
def test_a_malformed_node_list_names_the_variable(hostlist, why):
    with pytest.raises(ValueError, match=f"SLURM_JOB_NODELIST=.*{why}"):
        expand_hostlist(hostlist)
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        ts.SlurmClusterResolver(environ=srun(SLURM_JOB_NODELIST=hostlist or "[")).world()


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='2\(3\)' is malformed"):
        expand_tasks_per_node("2(3)")


def test_srun_step_gives_ranks_master_and_the_job_id_port():
    resolver = ts.SlurmClusterResolver(environ=srun())
    world = resolver.world()
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (3, 4, 1, 2)
    assert (world.node_rank, world.num_nodes, world.launcher) == (1, 2, "slurm")
    assert resolver.rendezvous_address() == ("gpu07", 8888 + 123456 % 10000) == ("gpu07", 12344)
    assert resolver.task_type == "worker" and resolver.task_id == 3
    assert resolver.cluster_spec().task_address("worker", 3) == "gpu08:12345"
    assert resolver.master() == "gpu08:12345"
    assert ts.SlurmClusterResolver(port_base=20000, environ=srun()).master_port == 23456
    assert ts.SlurmClusterResolver(environ=srun(MASTER_PORT=29400)).master_port == 29400
    # The step's variables win over the job's.
    step = ts.SlurmClusterResolver(environ=srun(SLURM_STEP_NODELIST="gpu[10-11]",
                                                SLURM_JOB_NODELIST="gpu[07-09]"))
    assert step.hosts == ["gpu10", "gpu11"]


def test_gpus_from_the_step_then_cuda_visible_devices():
    # A node's GPUs come from the step, then CUDA_VISIBLE_DEVICES; num_accelerators()
    # counts one task's (two tasks per node here), as TensorFlow's does.
    step_gpus = ts.SlurmClusterResolver(environ=srun(SLURM_STEP_GPUS="0,1,2,3",
                                                     CUDA_VISIBLE_DEVICES="0"))
    assert step_gpus.gpus_per_node() == 4 and step_gpus.num_accelerators() == {"GPU": 2}
    visible = ts.SlurmClusterResolver(environ=srun(CUDA_VISIBLE_DEVICES="2,3"))
    assert visible.gpus_per_node() == 2 and visible.num_accelerators() == {"GPU": 1}
    assert ts.SlurmClusterResolver(gpus_per_node=8, environ=srun()).num_accelerators() == \
        {"GPU": 4}


@pytest.mark.parametrize("env,message", [
    (srun(SLURM_PROCID=None), r"\['SLURM_PROCID'\] is not set.*srun"),
    (srun(SLURM_NTASKS=None), r"\['SLURM_NTASKS'\] is not set"),
    (srun(SLURM_JOB_NODELIST=None), r"\['SLURM_JOB_NODELIST'\] is not set"),
    (srun(SLURM_NTASKS="four"), "SLURM_NTASKS='four' is not an integer"),
    (srun(SLURM_TASKS_PER_NODE="3,1"), r"SLURM_TASKS_PER_NODE gives \[3, 1\].*same number"),
    (srun(SLURM_PROCID=2), "SLURM_PROCID=2 with SLURM_NODEID=1.*--distribution=block"),
    (srun(MASTER_PORT=70000), "MASTER_PORT=70000 is not a port"),
])
def test_srun_variables_missing_or_wrong_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        ts.SlurmClusterResolver(environ=env)


def test_slurm_arguments_are_checked():
    with pytest.raises(ValueError, match=r"jobs=\{'ps': 1\}.*\{'worker': 4\}"):
        ts.SlurmClusterResolver(jobs={"ps": 1}, environ=srun())
    assert ts.SlurmClusterResolver(jobs={"worker": 4}, environ=srun()).world_size == 4
    with pytest.raises(ValueError, match="port_base=80"):
        ts.SlurmClusterResolver(port_base=80, environ=srun())


def test_kubeflow_pod():
    resolver = ts.KubernetesClusterResolver(environ=pod())
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert resolver.num_workers == 3 and resolver.worker_index == 2
    assert resolver.rendezvous_address() == ("job-master-0", 23456)
    assert resolver.cluster_spec().task_address("worker", 0) == "job-master-0:23456"
    # An older operator: no PET_* variables, WORLD_SIZE counts the pods, RANK is the pod.
    old = ts.KubernetesClusterResolver(environ=pod(PET_NNODES=None, PET_NODE_RANK=None,
                                                   PET_NPROC_PER_NODE=None))
    assert old.num_workers == 3 and old.worker_index == 2


@pytest.mark.parametrize("env,message", [
    (pod(MASTER_PORT=None), r"\['MASTER_PORT'\] is not set"),
    (pod(WORLD_SIZE=4), "WORLD_SIZE=4 disagrees with PET_NNODES=3 x PET_NPROC_PER_NODE=1"),
    (pod(PET_NNODES="1:4"), "PET_NNODES='1:4' is an elastic range.*torchrun"),
    (pod(PET_NODE_RANK=3), r"PET_NODE_RANK=3 is outside the job's 3 pod\(s\)"),
    (pod(MASTER_PORT="http"), "MASTER_PORT='http' is not an integer"),
    (pod(PET_NPROC_PER_NODE="many"), "PET_NPROC_PER_NODE='many'"),
])
def test_kubeflow_variables_missing_or_wrong_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        ts.KubernetesClusterResolver(environ=env)


@pytest.mark.parametrize("env,found", [
    ({}, None),
    (dict(TORCHRUN, **srun(SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_NODEID=1, SLURM_LOCALID=0,
                           SLURM_TASKS_PER_NODE="1(x2)")), "torchrun"),   # srun torchrun
    (dict(srun(), **pod(PET_NNODES=2, PET_NODE_RANK=1, WORLD_SIZE=2)), "slurm"),
    (dict(pod(), TF_CONFIG=tf_config(3)), "kubernetes"),
    ({"TF_CONFIG": tf_config(2)}, "tf_config"),
    (dict(TORCHRUN, **pod(PET_NNODES="1:4", PET_NODE_RANK=None)), "torchrun"),  # elastic
    (srun(SLURM_STEP_ID=None), None),                   # the batch script itself
    (srun(SLURM_NTASKS=1, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NODEID=0), None),
    (dict(TORCHRUN, TORCHSTRATEGY_LAUNCHER="reexec", TF_CONFIG=tf_config(2)), "tf_config"),
])
def test_detection_order(env, found):
    assert detect.detect(env) == found


@pytest.mark.parametrize("env,names", [
    (dict(TORCHRUN, TF_CONFIG=tf_config(3)), ("GROUP_WORLD_SIZE", "TF_CONFIG")),
    (dict(pod(), TF_CONFIG=tf_config(2)), ("PET_NNODES", "TF_CONFIG")),
    (dict(TORCHRUN, **pod()), ("GROUP_WORLD_SIZE", "PET_NNODES")),
    (dict(srun(), TF_CONFIG=tf_config(3)), ("SLURM_JOB_NODELIST", "TF_CONFIG")),
])
def test_conflicting_environments_name_both_variables(env, names):
    with pytest.raises(ts.cluster_resolver.ConflictingEnvironmentError) as error:
        detect.detect(env)
    assert all(name in str(error.value) for name in names)


def test_agreeing_environments_and_the_log_line(caplog):
    env = dict(TORCHRUN, TF_CONFIG=tf_config(2))
    with caplog.at_level(logging.INFO, logger="torchstrategy"):
        resolver = detect.default_resolver(env)
    assert type(resolver).__name__ == "TorchElasticClusterResolver"
    assert "cluster from the torchrun environment (TorchElasticClusterResolver)" in caplog.text
    # TF_CONFIG naming one task per SLURM task agrees with srun too.
    assert detect.detect(dict(srun(), TF_CONFIG=tf_config(4))) == "slurm"
