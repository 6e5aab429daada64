"""The last tf.distribute gaps of the issue-27 audit, one test each: merge_call's variables,
dataset_fn's InputContext, the Kubernetes and SLURM resolvers' TensorFlow arguments, Server's
signature, experimental_set_strategy, DistributedDataset.element_spec, CommunicationOptions
under CentralStorageStrategy, and task_id / num_accelerators per task."""
import threading
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchstrategy as ts
from tests.helpers.replicas import launch
from torchstrategy.input.distributed_dataset import TensorSpec


@pytest.fixture(scope="module")
def central():
    return ts.CentralStorageStrategy(["cpu:0", "cpu:1"])


def _replica_id():
    return ts.get_replica_context().replica_id_in_sync_group


def _tf_update_example(strategy, v):
    """TensorFlow's own example of merge_call + extended.update (tf.distribute.StrategyExtended
    .update): each replica contributes a value; merge_fn gets the variable itself."""
    seen = []

    def merge_fn(strategy, var, value):
        seen.append(var is v)
        reduced = strategy.extended.reduce_to(ts.ReduceOp.SUM, value, var)
        return strategy.extended.update(var, lambda x, d: x.assign_add(d), args=(reduced,))

    def step():
        value = torch.tensor(_replica_id() + 1.0)
        return ts.get_replica_context().merge_call(merge_fn, args=(v, value))

    strategy.run(step)
    return seen


# -- merge_call: a variable arrives as itself --------------------------------------------------
def test_merge_call_hands_merge_fn_the_variable_itself(central):
    with central.scope():
        v = ts.Variable(1.0)
    assert _tf_update_example(central, v) == [True]     # merge_fn runs once, for both
    assert v.read_value().item() == 1.0 + 1.0 + 2.0
    # Other per-replica values stay PerReplica.
    kinds = central.run(lambda: ts.get_replica_context().merge_call(
        lambda strategy, x: type(x).__name__, args=(torch.tensor(1.0),)))
    assert central.experimental_local_results(kinds) == ("PerReplica", "PerReplica")


def _mirrored_checks():
    strategy = ts.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = ts.Variable(torch.zeros(()))
    res = {"seen": _tf_update_example(strategy, v), "value": v.read_value().item()}

    dataset = TensorDataset(torch.arange(8.0))
    with warnings.catch_warnings(record=True) as ignoring:
        warnings.simplefilter("always")
        strategy.distribute_datasets_from_function(lambda ctx: DataLoader(dataset, 2))
    with warnings.catch_warnings(record=True) as sharding:
        warnings.simplefilter("always")
        strategy.distribute_datasets_from_function(lambda ctx: DataLoader(
            dataset[ctx.input_pipeline_id::ctx.num_input_pipelines][0], 2))
        strategy.distribute_datasets_from_function(lambda ctx: DataLoader(
            dataset, 2, sampler=DistributedSampler(dataset, shuffle=False)))
    res["warnings"] = ([str(w.message) for w in ignoring], [str(w.message) for w in sharding])
    res["n"] = n
    return res


def test_merge_call_and_dataset_fn_under_mirrored():
    res = launch(_mirrored_checks, n=2)
    assert res["seen"] == [True] and res["value"] == 1.0 + 2.0
    ignoring, sharding = res["warnings"]
    assert len(ignoring) == 1 and ignoring[0].startswith(
        "distribute_datasets_from_function: dataset_fn never read its InputContext's "
        "input_pipeline_id, and each of the 2 replica processes builds its own pipeline")
    assert sharding == []


def test_dataset_fn_with_one_pipeline_is_not_warned_about(central):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        central.distribute_datasets_from_function(lambda ctx: [torch.ones(2)] * 2)
        ts.get_strategy().distribute_datasets_from_function(lambda ctx: [torch.ones(2)])
    context = ts.InputContext(2, 1, 2)
    assert not context.pipeline_id_read and "input_pipeline_id=1" in repr(context)
    assert context.input_pipeline_id == 1 and context.pipeline_id_read


# -- KubernetesClusterResolver: TensorFlow's signature --------------------------------------
POD = dict(MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="2", RANK="1",
           PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK="1")


def test_kubernetes_resolver_takes_tensorflows_arguments():
    with pytest.raises(ValueError, match=r"job_to_label_mapping=\{'worker': \['job-name=w'\]\}"
                                         r".*Kubernetes API.*leave job_to_label_mapping None"):
        ts.KubernetesClusterResolver({"worker": ["job-name=w"]})
    with pytest.raises(ValueError, match="looks like environment variables: pass them as "
                                         r"KubernetesClusterResolver\(environ=...\)"):
        ts.KubernetesClusterResolver(POD)                # the old positional use
    with pytest.raises(ValueError, match="tf_server_port=8470.*MASTER_PORT"):
        ts.KubernetesClusterResolver(None, 8470, environ=POD)
    with pytest.raises(ValueError, match="override_client"):
        ts.KubernetesClusterResolver(override_client=object(), environ=POD)
    resolver = ts.KubernetesClusterResolver(rpc_layer="grpc", environ=POD)
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.master("worker", 0) == "grpc://job-master-0:23456"


# -- SlurmClusterResolver: gpus_per_task, auto_set_gpu --------------------------------------
def _srun(**extra):
    """Rank 3 of an srun step of 4 tasks, 2 on each of gpu07 and gpu08, 4 GPUs a node."""
    env = dict(SLURM_JOB_ID="123456", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="1",
               SLURM_NODEID="1", SLURM_NTASKS="4", SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_GPUS="0,1,2,3")
    env.update(extra)
    return env


def test_slurm_resolver_counts_a_tasks_gpus_and_refuses_auto_set_gpu():
    # TensorFlow's positional order: jobs, port_base, gpus_per_node, gpus_per_task, ...
    resolver = ts.SlurmClusterResolver(None, 8888, 8, 3, environ=_srun())
    assert resolver.num_accelerators() == {"GPU": 3} and resolver.gpus_per_node() == 8
    assert ts.SlurmClusterResolver(environ=_srun()).num_accelerators() == {"GPU": 2}
    assert ts.SlurmClusterResolver(gpus_per_task=0, environ=_srun()).num_accelerators() == {}
    with pytest.raises(ValueError, match=r"gpus_per_task=3 x 2 task\(s\) per node needs 6 "
                                         "GPUs, but a node has 4"):
        ts.SlurmClusterResolver(gpus_per_task=3, environ=_srun())
    with pytest.raises(ValueError, match=r"auto_set_gpu=True.*cuda:SLURM_LOCALID.*Leave "
                                         "auto_set_gpu=False"):
        ts.SlurmClusterResolver(auto_set_gpu=True, environ=_srun())
    with pytest.raises(ValueError, match="gpus_per_task must be an integer >= 0"):
        ts.SlurmClusterResolver(gpus_per_task=-1, environ=_srun())


# -- Server: TensorFlow's signature ----------------------------------------------------------
def test_server_takes_a_cluster_spec_job_name_and_task_index():
    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:4"],
            "ps": ["127.0.0.1:3"]}
    assert ts.Server(ts.ClusterSpec(spec), job_name="worker", task_index=1,
                     start=False).target == "worker:1"
    assert ts.Server(spec, "ps", protocol="grpc", start=False).target == "ps:0"  # one task
    with pytest.raises(ValueError, match=r"jobs \['chief', 'ps', 'worker'\]; name this "
                                         "task's job with job_name="):
        ts.Server(spec, start=False)
    with pytest.raises(ValueError, match=r"job 'worker' has the tasks \[0, 1\]; name this "
                                         "task with task_index="):
        ts.Server(spec, "worker", start=False)
    with pytest.raises(ValueError, match=r"protocol='grpc\+verbs'"):
        ts.Server(spec, "ps", protocol="grpc+verbs", start=False)
    with pytest.raises(ValueError, match="ConfigProto"):
        ts.Server(spec, "ps", config=object(), start=False)
    resolver = ts.SimpleClusterResolver(spec, task_type="ps", task_id=0)
    assert ts.Server(resolver, start=False).target == "ps:0"
    assert ts.Server(resolver, "worker", 1, start=False).target == "worker:1"


# -- experimental_set_strategy ---------------------------------------------------------------
def test_experimental_set_strategy_enters_the_scope_until_cleared(central):
    try:
        ts.experimental_set_strategy(central)
        assert ts.get_strategy() is central and ts.has_strategy()
        assert ts.in_cross_replica_context()
        v = ts.Variable(1.0)
        assert isinstance(v, ts.MirroredVariable)       # created in central's scope
        in_thread = []
        thread = threading.Thread(target=lambda: in_thread.append(ts.has_strategy()))
        thread.start()
        thread.join()
        assert in_thread == [False]                     # per thread, as in TensorFlow
        with central.scope():
            with pytest.raises(RuntimeError, match="must not be called inside a strategy's "
                                                   r"scope\(\) or run"):
                ts.experimental_set_strategy(None)
        ts.experimental_set_strategy(central)           # again: the previous scope is left
        assert ts.get_strategy() is central
    finally:
        ts.experimental_set_strategy(None)
    assert not ts.has_strategy() and not ts.in_cross_replica_context()
    ts.experimental_set_strategy(None)                  # nothing set: nothing to do
    with pytest.raises(TypeError, match="needs a ts.Strategy or None"):
        ts.experimental_set_strategy("mirrored")
    assert "experimental_set_strategy" in ts.__all__


# -- DistributedDataset.element_spec --------------------------------------------------------
def test_element_spec_before_iterating_changes_no_batch(central):
    data = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))

    def batches(peek):
        loader = DataLoader(data, batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(3))
        torch.manual_seed(5)
        dist = ts.get_strategy().experimental_distribute_dataset(loader)
        spec = dist.element_spec if peek else None
        return spec, [[t.tolist() for t in step] for step in dist], torch.rand(1).item()

    spec, peeked, draw_after = batches(peek=True)
    assert spec == [TensorSpec((None, 2), torch.float32),
                    TensorSpec((None,), torch.int64)]
    assert batches(peek=False)[1:] == (peeked, draw_after)
    # A one-shot iterator: the batch read ahead is given back first.
    one_shot = central.experimental_distribute_dataset(iter([torch.ones(4, 3), torch.zeros(2, 3)]))
    assert one_shot.element_spec == TensorSpec((None, 3),
                                                                            torch.float32)
    steps = [central.experimental_local_results(step) for step in one_shot]
    assert [[part.sum().item() for part in step] for step in steps] == [[6.0, 6.0], [0.0, 0.0]]
    from_fn = central.distribute_datasets_from_function(lambda ctx: [{"x": torch.ones(2, 5)}])
    assert from_fn.element_spec == {"x": TensorSpec(
        (None, 5), torch.float32)}
    assert central.experimental_distribute_dataset([]).element_spec is None


# -- CommunicationOptions under CentralStorageStrategy: hints -------------------------------
def test_central_storage_takes_communication_options_as_hints(central):
    hints = ts.CommunicationOptions(bytes_per_pack=8, timeout_seconds=60,
                                    implementation="RING")
    summed = central.run(lambda: ts.get_replica_context().all_reduce(
        "SUM", torch.tensor(1.0 + _replica_id()), options=hints))
    assert [t.item() for t in central.experimental_local_results(summed)] == [3.0, 3.0]

    def only_replica_0_reduces():
        if _replica_id() == 0:
            ts.get_replica_context().all_reduce(
                "SUM", torch.ones(1), options=ts.CommunicationOptions(timeout_seconds=0.2))

    with pytest.raises(ts.CollectiveError, match=r"all_reduce on replica 0 timed out after "
                                                 r"0.2 s: replica\(s\) \[1\]"):
        ts.CentralStorageStrategy(["cpu:0", "cpu:1"]).run(only_replica_0_reduces)
    with pytest.raises(ValueError, match="cannot honour compression='bf16'"):
        central.run(lambda: ts.get_replica_context().all_gather(
            torch.ones(1), 0, options=ts.CommunicationOptions(compression="bf16")))


# -- task_id and num_accelerators per task -------------------------------------------------
def test_torchrun_task_id_is_the_process_as_in_tensorflow():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"}
    resolver = ts.TorchElasticClusterResolver(environ=env)
    assert (resolver.task_id, resolver.worker_index, resolver.num_workers) == (3, 1, 2)
    chiefs = [ts.TorchElasticClusterResolver(environ=dict(
        env, RANK=str(rank), LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2))).is_chief
        for rank in range(4)]
    assert chiefs == [True, False, False, False]     # one process, not a machine's
    expected = {"GPU": 1} if torch.cuda.is_available() and torch.cuda.device_count() else {}
    assert resolver.num_accelerators() == expected
