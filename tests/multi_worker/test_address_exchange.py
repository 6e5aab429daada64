"""The replicas' address exchange (before the process group) never waits on a store that
stopped answering: a chief's machine lost between publishing and reading is an error
naming the cause, raised before the hung read returns (not a wait as long as TCP's own
timeout)."""
import socket
import threading
import time

import pytest
import torch.distributed as dist

from torchstrategy.launch import network

# Far longer than the exchange's own bound on a read (5 s): if the exchange waited for the
# store, the hung read would have returned before the error.
HUNG_SECONDS = 120


class _StoreWhoseReadsHang(dist.Store):
    """Accepts writes and waits, then blocks every read: the chief's link went down."""

    def __init__(self):
        super().__init__()
        self._inner = dist.HashStore()
        self.a_read_returned = threading.Event()

    def set(self, key, value):
        self._inner.set(key, value)

    def wait(self, keys, timeout=None):
        pass

    def check(self, keys):
        time.sleep(HUNG_SECONDS)
        self.a_read_returned.set()
        return False

    def get(self, key):
        time.sleep(HUNG_SECONDS)
        self.a_read_returned.set()
        return b""


def test_a_store_that_stops_answering_is_named_before_its_read_returns():
    store = _StoreWhoseReadsHang()
    with pytest.raises(RuntimeError, match="lost the rendezvous store while the replicas "
                                           "exchanged their addresses"):
        network.exchange_addresses(store, rank=0, node_rank=0, world_size=2, timeout_seconds=1)
    assert not store.a_read_returned.is_set()   # the error came first: nothing waited for it


def test_every_published_address_is_read_back():
    # Replica 1 on this machine too: one machine may advertise loopback.
    store = dist.HashStore()
    store.set(network.ADVERTISED_KEY.format(1), f"0\t{socket.gethostname()}\t127.0.0.1 (lo)")
    listing = network.exchange_addresses(store, rank=0, node_rank=0, world_size=2,
                                         timeout_seconds=5)
    assert sorted(listing) == [0, 1]
    assert (listing[1].machine, listing[1].ip) == (0, "127.0.0.1")
    assert listing[0].hostname == socket.gethostname()


def test_a_replica_that_never_publishes_is_named():
    store = dist.HashStore()
    with pytest.raises(RuntimeError, match=r"replica\(s\) \[1\] did not reach the rendezvous"):
        network.exchange_addresses(store, rank=0, node_rank=0, world_size=2, timeout_seconds=1)
