"""ShardedStrategy on a GPU in bf16 (``mixed_precision=torch.bfloat16``: bf16 parameters in
compute, float32 shards and reduction) against the same model sharded by hand with
``fully_shard`` and the same policy: a model built on meta gets exactly the one-device
procedure's values (on the GPU's generator) and trains equal to the hand-written loop; a
model filled by ``ts.load_pretrained`` holds the file's values and trains equal to the
hand-written loop from them. On "cpu" the same comparisons run with one CPU replica."""
import pytest
import torch

from tests.gpu import cases
from tests.gpu.devices import DEVICES
from tests.gpu.test_strategies_cuda import assert_states, environment
from tests.helpers.replicas import launch


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_bf16_equals_a_hand_written_fsdp2_loop(device, tmp_path, monkeypatch):
    for name, value in environment(device).items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(99)
    pretrained = {k: torch.randn_like(v) for k, v in cases.Net().state_dict().items()}
    path = tmp_path / "pretrained.pt"
    torch.save(pretrained, path)
    result = launch(cases.sharded_against_fsdp2, str(path), n=1)
    assert result["device"] == ("cuda:0" if device == "cuda" else "cpu")
    assert result["compute_dtype"] == "torch.bfloat16"
    assert_states(result["initial"], result["one_device_initial"], atol=0,
                  what="meta init vs one device")
    assert_states(result["ours"], result["fsdp2"], atol=1e-6, rtol=1e-6,
                  what="trained from meta init vs FSDP2 by hand")
    assert any(not torch.equal(result["ours"][k], result["initial"][k]) for k in result["ours"])
    assert_states(result["loaded"], {k: v.float() for k, v in pretrained.items()}, atol=0,
                  what="ts.load_pretrained vs the file")
    assert_states(result["pretrained_ours"], result["pretrained_fsdp2"], atol=1e-6, rtol=1e-6,
                  what="trained from pretrained vs FSDP2 by hand")
