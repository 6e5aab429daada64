"""State applied to the user's objects (`torchstrategy.module_state`), not tables keyed by
``id()``: an adopted module carries its state in its ``__dict__``; copies of it (deepcopy,
pickle, ``torch.save``) are plain modules; the state goes with its strategy; a new object
that gets a dead one's id is not taken for it. One process, one replica."""
import copy
import gc
import io
import pickle
import weakref

import pytest
import torch

import torchstrategy as ts
from torchstrategy import module_state
from torchstrategy.parameter_server import remote


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


class Padded(torch.nn.Module):
    """A module with a buffer, of an instance size no other object here has: CPython then
    gives a new instance the memory (and so the id) of the last one freed."""
    __slots__ = tuple(f"_pad{i}" for i in range(40))

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(2))


class _WithoutTorchstrategy(pickle.Unpickler):
    def find_class(self, module, name):
        assert module.split(".")[0] != "torchstrategy", f"the pickle needs {module}.{name}"
        return super().find_class(module, name)


def _same_tensors(a, b):
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0.0, atol=0.0)


@pytest.fixture
def strategy():
    return ts.MirroredStrategy()


def test_an_adopted_module_carries_its_state(strategy):
    model = Net()
    keys = list(model.state_dict())
    assert strategy.adopt(model) is model
    for sub in model.modules():
        state = module_state.state_of(sub)
        assert state is not None and state.adopted and state.owner is strategy.extended
        assert module_state.state_of(sub, owner=object()) is None   # another owner's: no
    assert list(model.state_dict()) == keys
    # A Parameter registered after adoption is recorded through the module's state.
    model.head.scale = torch.nn.Parameter(torch.ones(2))
    assert strategy.extended.variable_created_in_scope(model.head.scale)


def test_copies_of_an_adopted_module_are_plain_modules(strategy):
    model = strategy.adopt(Net())
    model(torch.randn(5, 3))      # BatchNorm statistics that the copies must keep
    duplicate = copy.deepcopy(model)
    pickled = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (duplicate, pickled, loaded):
        assert all(module_state.state_of(sub) is None for sub in other.modules())
        _same_tensors(other.state_dict(), model.state_dict())
        # The copy's tensors are its own, not the strategy's; new ones are not recorded.
        assert not strategy.extended.variable_created_in_scope(other.head.weight)
        other.head.scale = torch.nn.Parameter(torch.ones(2))
        assert not strategy.extended.variable_created_in_scope(other.head.scale)
    # Loading the pickle needs no torchstrategy: it names nothing of it.
    _WithoutTorchstrategy(io.BytesIO(pickle.dumps(model))).load()
    assert module_state.state_of(model) is not None      # the original is untouched


def test_a_model_built_in_scope_copies_and_pickles(strategy):
    with strategy.scope():
        model = Net()
    keys = list(Net().state_dict())
    assert list(model.state_dict()) == keys
    duplicate = copy.deepcopy(model)
    _same_tensors(duplicate.state_dict(), model.state_dict())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    _same_tensors(torch.load(buffer, weights_only=False).state_dict(), model.state_dict())
    assert strategy.extended.variable_created_in_scope(model.head.weight)
    assert not strategy.extended.variable_created_in_scope(duplicate.head.weight)


def test_the_state_goes_with_its_strategy():
    strategy = ts.MirroredStrategy()
    model = strategy.adopt(torch.nn.Linear(2, 2))
    assert module_state.state_of(model) is not None
    gone = weakref.ref(strategy)
    del strategy
    gc.collect()
    assert gone() is None, "the adopted module keeps its strategy alive"
    assert module_state.state_of(model) is None
    assert module_state.STATE_KEY not in model.__dict__
    model.extra = torch.nn.Parameter(torch.ones(1))   # nothing left to record it: no error


def test_a_new_module_with_a_dead_modules_id_is_recorded(strategy):
    with strategy.scope():
        first = Padded()
    assert strategy.extended.variable_created_in_scope(first.count)
    dead_id = id(first)
    del first
    gc.collect()
    with strategy.scope():
        second = Padded()
    assert id(second) == dead_id, "the premise: CPython reused the freed module's memory"
    # Its buffer is a new one and recorded as such (an (id(module), name) key was taken as
    # already recorded, and the buffer was neither broadcast nor averaged).
    assert strategy.extended.variable_created_in_scope(second.count)
    assert any(b is second.count for b in strategy.extended.parameters.recorded.buffers())


def test_a_new_tensor_with_a_dead_variables_id_is_not_that_variable(strategy):
    with strategy.scope():
        variables = [ts.Variable(torch.zeros(3), trainable=False) for _ in range(50)]
    assert all(strategy.extended.value_container(v.tensor) is v for v in variables)
    dead = {id(v.tensor) for v in variables}
    del variables
    gc.collect()
    fresh = [torch.zeros(3) for _ in range(100)]
    reused = [t for t in fresh if id(t) in dead]
    assert reused, "the premise: CPython reused some freed tensor's memory"
    for tensor in reused:
        assert not strategy.extended.variable_created_in_scope(tensor)
        assert strategy.extended.value_container(tensor) is tensor


class PaddedLinear(torch.nn.Linear):
    """A Linear of an instance size of its own (see `Padded`)."""
    __slots__ = tuple(f"_pad{i}" for i in range(40))

    def __init__(self):
        super().__init__(2, 1)


def test_parameter_server_hooks_live_on_the_module():
    with ts.parameter_server.local_cluster(num_workers=1, num_ps=1) as resolver:
        strategy = ts.ParameterServerStrategy(resolver)
        with strategy.scope():
            first = PaddedLinear()
        state = module_state.state_of(first)
        assert state.owner is strategy.extended and len(state.hooks) == 3
        dead_id = id(first)
        del first, state
        gc.collect()
        with strategy.scope():
            second = PaddedLinear()
        assert id(second) == dead_id, "the premise: CPython reused the freed module's memory"
        # Hooked although a module of its id was hooked before (an id() set said it was).
        assert len(module_state.state_of(second, strategy.extended).hooks) == 3
        remote.write_full(strategy.extended.layout_of(second.weight), torch.full((1, 2), 5.0))
        second(torch.ones(1, 2))      # the forward pre-hook reads the servers' values
        assert second.weight.tolist() == [[5.0, 5.0]]
        # Sent to a worker inside the module, the state arrives as None.
        assert pickle.loads(pickle.dumps(second)).__dict__[module_state.STATE_KEY] is None


class _Owner:
    """Stands for a strategy's extended (anything weakly referable)."""


def test_attach_replaces_another_owners_state_and_its_hooks():
    module = torch.nn.Linear(2, 2)
    calls = []
    first, second = _Owner(), _Owner()
    state = module_state.attach(module, first)
    assert module_state.attach(module, first) is state          # one state per owner
    state.hooks.append(module.register_forward_pre_hook(lambda m, a: calls.append(1)))
    module(torch.ones(1, 2))
    assert calls == [1]
    replaced = module_state.attach(module, second)
    assert replaced is not state and module_state.state_of(module, first) is None
    module(torch.ones(1, 2))
    assert calls == [1], "the first owner's hook outlived its state"
    replaced.hooks.append(module.register_forward_pre_hook(lambda m, a: calls.append(2)))
    del second
    gc.collect()
    module(torch.ones(1, 2))       # the hook is still there until the state is looked up
    assert module_state.state_of(module) is None
    module(torch.ones(1, 2))
    assert calls == [1, 2], "a dead owner's hooks are removed with its state"


def test_detach_removes_only_its_owners_state():
    module = torch.nn.Linear(2, 2)
    owner, other = _Owner(), _Owner()
    module_state.attach(module, owner)
    module_state.detach(module, other)
    assert module_state.state_of(module) is not None
    module_state.detach(module, owner)
    assert module_state.STATE_KEY not in module.__dict__


def test_identity_map_keys_by_identity_and_keeps_keys_alive():
    table = module_state.IdentityMap()
    a, b = torch.zeros(2), torch.zeros(2)        # equal, not the same
    table[a] = "a"
    assert a in table and b not in table and table.get(b) is None
    with pytest.raises(KeyError):
        table[b]
    table[b] = "b"
    assert table.keys() == [a, b] and [k for k in table] == [a, b]
    assert table.items() == [(a, "a"), (b, "b")] and len(table) == 2
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is not None, "an entry keeps its key alive, so its id stays its own"
    assert table.pop(alive()) == "a" and len(table) == 1 and table.pop(alive(), 0) == 0
