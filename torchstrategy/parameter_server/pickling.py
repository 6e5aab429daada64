"""How a scheduled function and its arguments travel from the chief to a worker.

- Functions and classes of importable modules go *by reference* (module and name), as pickle
  does: the worker imports the same module. Functions and classes of the chief's
  ``__main__`` (a script or a notebook, which a worker cannot import) go by value through
  cloudpickle, together with the globals they use.
- Parameters created in the strategy's scope go as references to their parameter-server
  variables: the worker fetches their current values before running the function.
- An optimizer over such parameters goes as a reference too: on the worker it becomes a
  `WorkerOptimizer` whose ``step()`` pushes the gradients to the parameter servers.
- A `PerWorkerValues` (e.g. the iterators of `create_per_worker_dataset`) becomes the value
  that belongs to the worker running the function.

Anything else is pickled normally; what cannot be pickled is reported at schedule time.
"""
from __future__ import annotations

import io
import pickle
import types
from typing import Any, Callable, Mapping

from torchstrategy import runtime

# Returns the reference tuple of an object that travels by reference, or None.
Resolve = Callable[[Any], "tuple[Any, ...] | None"]


def _is_main_object(obj: object) -> bool:
    return isinstance(obj, (types.FunctionType, type)) and \
        getattr(obj, "__module__", None) == "__main__"


class _ReferenceMixin:
    def _init_refs(self, resolve):
        self._resolve = resolve
        self.references = []

    def persistent_id(self, obj):
        ref = self._resolve(obj)
        if ref is not None:
            self.references.append(ref)
        return ref


class _Pickler(_ReferenceMixin, pickle.Pickler):
    def persistent_id(self, obj):
        if _is_main_object(obj):
            data, references = _dumps_by_value(obj, self._resolve)
            self.references.extend(references)
            return ("by_value", data)
        return super().persistent_id(obj)


def _make_by_value_pickler():
    """The cloudpickle-based pickler class, made on first use (cloudpickle is needed only
    for functions of the main script); one per process, in ``runtime.current().state``."""
    import cloudpickle  # optional dependency: only functions of the main script need it

    class ByValuePickler(_ReferenceMixin, cloudpickle.Pickler):
        def persistent_id(self, inner):
            if inner is self._top or _is_main_object(inner):
                return None
            return super().persistent_id(inner)

    return ByValuePickler


def _dumps_by_value(obj: object, resolve: Resolve) -> tuple[bytes, list[tuple[Any, ...]]]:
    """cloudpickle for one object of ``__main__`` (with its globals), keeping references."""
    pickler_class = runtime.current().state("parameter_server.pickling",
                                            _make_by_value_pickler)
    buffer = io.BytesIO()
    pickler = pickler_class(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler._init_refs(resolve)
    pickler._top = obj
    pickler.dump(obj)
    return buffer.getvalue(), pickler.references


def dumps(obj: object, resolve: Resolve) -> tuple[bytes, list[tuple[Any, ...]]]:
    """Pickles `obj`; ``resolve(x)`` returns a reference tuple for objects that travel by
    reference (or None). Returns ``(bytes, references)``.

    Raises:
      TypeError: naming the object that cannot be pickled and how to fix it.
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler._init_refs(resolve)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise TypeError(
            f"The scheduled function or its arguments cannot be sent to a worker: {error}. "
            f"Scheduled functions are sent by reference: define them at module level of an "
            f"importable module (or at the top level of the main script), not as lambdas or "
            f"nested functions, and pass only picklable arguments (tensors, modules, "
            f"optimizers and variables made in the strategy's scope, per-worker "
            f"iterators).") from None
    return buffer.getvalue(), pickler.references


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, load_reference: Callable[[Any], Any],
                 class_map: Mapping[tuple[str, str], type] | None) -> None:
        super().__init__(file)
        self._load_reference = load_reference
        self._class_map = class_map or {}

    def persistent_load(self, ref):
        if ref[0] == "by_value":
            return _Unpickler(io.BytesIO(ref[1]), self._load_reference,
                              self._class_map).load()
        return self._load_reference(ref)

    def find_class(self, module, name):
        replacement = self._class_map.get((module, name))
        return replacement if replacement is not None else super().find_class(module, name)


def loads(data: bytes, load_reference: Callable[[Any], Any],
          class_map: Mapping[tuple[str, str], type] | None = None) -> Any:
    """Unpickles what `dumps` made; ``load_reference(ref)`` turns references into objects;
    `class_map` maps ``(module, name)`` of a class to the class to build instead."""
    return _Unpickler(io.BytesIO(data), load_reference, class_map).load()

