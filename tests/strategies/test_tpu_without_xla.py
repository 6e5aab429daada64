"""TPUStrategy's surface in the main environment (no torch_xla): importable, lazy, a clear
error naming the install command; TPUClusterResolver reading the environment."""
import importlib.util
import subprocess
import sys

import pytest

import torchstrategy as ts
from torchstrategy.cluster_resolver import TPUClusterResolver

needs_no_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                                  reason="torch_xla is installed here")


def test_import_never_imports_torch_xla():
    code = "import sys, torchstrategy as ts; ts.TPUStrategy; assert 'torch_xla' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@needs_no_xla
def test_tpu_strategy_without_torch_xla_names_the_install_command():
    with pytest.raises(ImportError, match=r"TPUStrategy needs torch_xla.*"
                       r"`pip install torch==2.9.0 torch_xla==2.9.0`"):
        ts.TPUStrategy()


def test_resolver_alone():
    resolver = TPUClusterResolver(environ={})
    assert (resolver.launcher, resolver.task_type, resolver.task_id, resolver.num_hosts) == \
        ("local", "worker", 0, 1)
    assert resolver.master() == "localhost:8470"


def test_resolver_under_torchrun_one_process_per_host():
    env = {"WORLD_SIZE": "3", "RANK": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    resolver = TPUClusterResolver(environ=env)
    assert (resolver.launcher, resolver.task_id, resolver.num_hosts) == ("torchrun", 2, 3)
    assert resolver.master() == "10.0.0.1:29400"
    assert resolver.training_tasks() == [("worker", 0), ("worker", 1), ("worker", 2)]
    with pytest.raises(ValueError, match="--nproc-per-node=1"):
        TPUClusterResolver(environ=dict(env, LOCAL_WORLD_SIZE="4"))


def test_resolver_on_a_tpu_vm_and_explicit_hosts():
    env = {"TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1"}
    resolver = TPUClusterResolver(environ=env)
    assert (resolver.launcher, resolver.task_id, resolver.num_hosts) == ("tpu-vm", 1, 2)
    assert resolver.cluster_spec().as_dict() == {"worker": ["t0:8470", "t1:8470"]}
    explicit = TPUClusterResolver(["a:1", "b:2"], task_id=1, environ={})
    assert explicit.master() == "a:1" and explicit.master("worker", 1) == "b:2"
    with pytest.raises(ValueError, match="outside the 2 host"):
        TPUClusterResolver(["a:1", "b:2"], task_id=2, environ={})


def test_run_options_of_a_strategy_compiling_with_xla():
    # TPUExtended.check_run_options is check_run_options(..., compiles_with_xla=True).
    from torchstrategy.run_options import check_run_options
    static = ts.RunOptions(experimental_enable_dynamic_batch_size=False)
    assert check_run_options(static, "TPUStrategy", compiles_with_xla=True) is static
    with pytest.raises(ValueError, match="no static-shape mode"):
        check_run_options(static, "MirroredStrategy")
    xla = ts.RunOptions(experimental_xla_options={"xla_cpu_fast_math": True})
    with pytest.raises(ValueError, match="XLA_FLAGS environment variable.*before creating "
                                         "the TPUStrategy"):
        check_run_options(xla, "TPUStrategy", compiles_with_xla=True)
    with pytest.raises(ValueError, match="applies to TPUStrategy only; MirroredStrategy"):
        check_run_options(xla, "MirroredStrategy")
    with pytest.raises(ValueError, match="no shape-bucketing pass"):
        check_run_options(ts.RunOptions(experimental_bucketizing_dynamic_shape=True),
                          "TPUStrategy", compiles_with_xla=True)
