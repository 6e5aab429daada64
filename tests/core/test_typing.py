"""Every public function and method of torchstrategy/ is fully annotated, and the package
ships its types (``py.typed``).

Parses every module (no import of the package needed) and fails naming each public function
or method, and each ``__init__`` of a public class, that lacks an annotation on a parameter
(``self`` / ``cls`` excepted) or on its return. Public: a name that does not start with
``_``, at module level or in a public class (nested public classes included). Functions
defined inside functions are implementation details and are not checked. `mypy
torchstrategy` (run by scripts/test.sh) then checks that the annotations are right.
"""
import ast
import configparser
import os

from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "torchstrategy")


def _is_staticmethod(function):
    return any(isinstance(d, ast.Name) and d.id == "staticmethod"
               for d in function.decorator_list)


def missing_annotations(function, in_class):
    """The names of `function`'s unannotated parameters, plus "return" if its return is."""
    args = function.args
    positional = args.posonlyargs + args.args
    if in_class and positional and not _is_staticmethod(function):
        positional = positional[1:]  # self, or cls of a classmethod
    parameters = positional + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    missing = [p.arg for p in parameters if p.annotation is None]
    if function.returns is None:
        missing.append("return")
    return missing


def public_functions(tree):
    """(qualified name, function node, defined in a class?) of every public function and
    method of a module, and the ``__init__`` of its public classes."""
    def visit(body, prefix, in_class):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not node.name.startswith("_") or (in_class and node.name == "__init__"):
                    yield f"{prefix}{node.name}", node, in_class
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from visit(node.body, f"{prefix}{node.name}.", True)
    return visit(tree.body, "", False)


def _modules():
    for directory, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, ROOT), path


def test_every_public_function_is_fully_annotated():
    offenders = []
    for relative, path in _modules():
        tree = ast.parse(open(path).read(), path)
        for name, function, in_class in public_functions(tree):
            missing = missing_annotations(function, in_class)
            if missing:
                offenders.append(f"{relative}:{function.lineno} {name}: no annotation for "
                                 f"{', '.join(missing)}")
    assert not offenders, (f"{len(offenders)} public function(s) lack type hints:\n"
                           + "\n".join(offenders))


def test_the_checker_sees_a_missing_annotation():
    # The checks above are only as good as this parser: a sample of each kind of gap.
    tree = ast.parse(
        "def f(a: int, b) -> int: ...\n"
        "def g(a: int): ...\n"
        "def _private(a): ...\n"
        "class C:\n"
        "    def __init__(self, x): ...\n"
        "    def m(self, *args, key: int, **kwargs: int) -> None: ...\n"
        "    @staticmethod\n"
        "    def s(value) -> None: ...\n"
        "    @classmethod\n"
        "    def k(cls) -> None: ...\n"
        "    def __repr__(self): ...\n"
        "class _Hidden:\n"
        "    def m(self, x): ...\n")
    found = {name: missing_annotations(node, in_class)
             for name, node, in_class in public_functions(tree)}
    assert found == {"f": ["b"], "g": ["return"], "C.__init__": ["x", "return"],
                     "C.m": ["args"], "C.s": ["value"], "C.k": []}


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    package_data = config.get("options.package_data", "torchstrategy", fallback="")
    assert "py.typed" in package_data.split(), "setup.cfg's package_data must ship py.typed"
