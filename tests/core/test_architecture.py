"""The package's structure stays as docs/architecture.md draws it.

docs/architecture.md is the single source of the layers: its layer diagram (the page's first
fenced block) names every module of torchstrategy/ in its layer, and its Tests section names
every folder of tests/. This file parses that page and every module of torchstrategy/ (no
import of the package needed) and fails on:

- a module the diagram does not name, or a name in the diagram that is no module; a test
  folder the Tests section does not name, or one it names that does not exist;
- an import from a higher layer, an import cycle, an import inside a function that is not an
  optional dependency (or a module listed in `DEFERRED`), module-level `global` rebinding
  outside the runtime, exit handlers registered outside the runtime, and private torch /
  torch_xla / Lightning APIs used outside `_compat`.

"Import" includes the dynamic ones: ``importlib.import_module(name)`` and ``__import__(name)``
where `name` is a string, an f-string or sum of resolvable parts, a module-level constant
(a string, or a tuple/list/set/dict of strings, also one imported from another module of the
package), an entry of such a constant (``MODULES[key]``), a loop variable over one, or
``self.<field>`` of records the module builds from strings. A dynamic import whose name
cannot be resolved, and whose resolvable parts fit one of our modules, fails unless
`UNRESOLVED_THIRD_PARTY` lists it with the reason it imports another package's module. The
parser itself is tested on small sources below, so the detection cannot silently stop
working.

Then imports torchstrategy in a fresh interpreter and checks it has no side effects.
"""
import ast
import dataclasses
import itertools
import os
import re
import subprocess
import sys
import textwrap
from typing import Iterable, Iterator, Mapping, Optional

from tests.helpers import ROOT

PACKAGE_NAME = "torchstrategy"
PACKAGE = os.path.join(ROOT, PACKAGE_NAME)
TESTS = os.path.join(ROOT, "tests")
ARCHITECTURE_PAGE = os.path.join(ROOT, "docs", "architecture.md")

# Compiled from csrc/: depends on nothing of ours. The diagram names it as a bare `_C`.
EXTENSIONS = {f"{PACKAGE_NAME}._C"}

# Imports allowed inside a function: optional dependencies only, never to dodge a cycle.
OPTIONAL = ("lightning", "pytorch_lightning", "torch_xla", "ray", "importlib", "cloudpickle",
            "numpy", "torchmetrics", "safetensors")

# Our own modules that may be imported inside a function, with the reason. They still count
# for the layer and cycle checks: deferring an import changes when it runs, not the graph.
DEFERRED = {
    f"{PACKAGE_NAME}.strategies.sharded":
        "FSDP2 and DTensor more than double every replica's import time; only "
        "ShardedStrategy needs them, so it is imported when first used",
    f"{PACKAGE_NAME}.strategies.sharding.pretrained":
        "ts.load_pretrained needs DTensor and torch.distributed.checkpoint (as slow to "
        "import as FSDP2): imported when first used",
}

# Dynamic imports whose name the parser cannot resolve: (module, argument as written) ->
# why it is another package's module. Anything else unresolved fails.
# (An unresolved name that cannot be one of ours, as f"{package}.accelerators", needs no
# entry: no module of the package ends in ".accelerators".)
UNRESOLVED_THIRD_PARTY = {
    (f"{PACKAGE_NAME}.lightning_base.adapter", "name"):
        "the Lightning package itself (lightning.pytorch or pytorch_lightning)",
    (f"{PACKAGE_NAME}.lightning_base.adapter", "f'{package}.strategies'"):
        "the strategies module of a Lightning package",
    (f"{PACKAGE_NAME}.lightning_base.registration", "f'{package}.strategies'"):
        "the strategies module of a Lightning package (its StrategyRegistry)",
}

PRIVATE_APIS = ("_pytree", "_get_default_group", "_get_default_store", "._use_count(",
                "._buffers", "_opt_called", "_XLAC", "_MultiProcessingLauncher",
                "_get_current_rpc_agent", "_non_persistent_buffers_set")


# -- the modules ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    """One module of the package, parsed."""

    module: str        # dotted name: torchstrategy.strategies.base
    is_package: bool   # an __init__.py
    tree: ast.Module


def parse_source(module: str, text: str, is_package: bool = False) -> Source:
    """`text` parsed as the module `module` (a package's __init__ when `is_package`)."""
    return Source(module, is_package, ast.parse(text, module))


def _package_sources() -> Iterator[tuple[Source, str]]:
    for directory, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                is_package = dotted.endswith(".__init__")
                if is_package:
                    dotted = dotted[: -len(".__init__")]
                with open(path) as file:
                    yield parse_source(dotted, file.read(), is_package), path


_PARSED = list(_package_sources())
SOURCES = {source.module: source for source, _ in _PARSED}
PATHS = {source.module: path for source, path in _PARSED}
MODULES = set(SOURCES)
KNOWN = MODULES | EXTENSIONS


def is_own(name: str) -> bool:
    """Whether `name` is a module name inside this package (existing or not)."""
    return name == PACKAGE_NAME or name.startswith(PACKAGE_NAME + ".")


# -- imports, static and dynamic -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Import:
    """One module imported by another, as the parser found it."""

    module: str              # the importing module
    target: Optional[str]    # the imported module; None: a dynamic name it cannot resolve
    inside_function: bool
    line: int
    dynamic: bool = False    # through importlib.import_module or __import__
    expression: str = ""     # a dynamic import's name argument, as written
    maybe_own: bool = False  # unresolved, and some module of the package fits its pattern


def _anchor(source: Source, level: int) -> list[str]:
    """The package a relative import of `level` dots starts from, as name parts."""
    parts = source.module.split(".")
    if not source.is_package:
        parts = parts[:-1]
    return parts[: len(parts) - (level - 1)]


def _from_base(source: Source, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    return ".".join(_anchor(source, node.level) + ([node.module] if node.module else []))


def _is_string_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_string_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_string_literal(k) and _is_string_literal(v)
                   for k, v in zip(node.keys, node.values))
    return False


def module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Names bound once at module level to a literal of strings (a string, or a
    tuple/list/set/dict of strings) -> that literal."""
    bound: dict[str, list[ast.expr]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                bound.setdefault(target.id, []).append(value)
    return {name: values[0] for name, values in bound.items()
            if len(values) == 1 and _is_string_literal(values[0])}


def visible_constants(source: Source,
                      constants_by_module: Mapping[str, Mapping[str, ast.expr]]
                      ) -> dict[str, ast.expr]:
    """The module's own constants and those it imports by name from our other modules."""
    visible = dict(module_constants(source.tree))
    for node in source.tree.body:
        if isinstance(node, ast.ImportFrom):
            theirs = constants_by_module.get(_from_base(source, node), {})
            for alias in node.names:
                if alias.name in theirs:
                    visible[alias.asname or alias.name] = theirs[alias.name]
    return visible


class _DynamicNames:
    """Resolves the name argument of a dynamic import to the module names it can take."""

    def __init__(self, source: Source, constants: Mapping[str, ast.expr],
                 parents: Mapping[ast.AST, ast.AST]) -> None:
        self.source, self.constants, self.parents = source, constants, parents

    def literal(self, node: ast.expr, at: ast.AST) -> Optional[ast.expr]:
        """The string literal `node` stands for, if it is one or names a constant."""
        if _is_string_literal(node):
            return node
        if isinstance(node, ast.Name) and self._binding(node.id, at) == "constant":
            return self.constants[node.id]
        return None

    def _binding(self, name: str, at: ast.AST) -> object:
        """What binds `name` where `at` is: an enclosing loop (its node), "parameter" or
        "local" of an enclosing function, "constant" of the module, or None."""
        node = at
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                    node.target.id == name:
                return node
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                for generator in node.generators:
                    if isinstance(generator.target, ast.Name) and generator.target.id == name:
                        return generator
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args
                every = arguments.posonlyargs + arguments.args + arguments.kwonlyargs + \
                    [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
                if any(a.arg == name for a in every):
                    return "parameter"
                if any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
                       for n in ast.walk(node)):
                    return "local"
        return "constant" if name in self.constants else None

    def names(self, node: ast.expr, at: ast.AST) -> Optional[set[str]]:
        """Every string `node` can evaluate to; None when that cannot be known."""
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else None
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return self._union(node.elts, at)
        if isinstance(node, ast.Dict):  # iterating a table yields its keys
            return self._union([k for k in node.keys if k is not None], at)
        if isinstance(node, ast.Name):
            binding = self._binding(node.id, at)
            if binding == "constant":
                return self.names(self.constants[node.id], at)
            if isinstance(binding, (ast.For, ast.comprehension)):
                return self.names(binding.iter, binding)
            return None
        if isinstance(node, ast.Subscript):  # an entry of a table: any of its values
            table = self.literal(node.value, at)
            if isinstance(table, ast.Dict):
                return self._union(table.values, at)
            if isinstance(table, (ast.Tuple, ast.List)):
                return self._union(table.elts, at)
            return None
        if isinstance(node, ast.JoinedStr):
            pieces = [self.names(v.value if isinstance(v, ast.FormattedValue) else v, at)
                      for v in node.values]
            return self._concatenations(pieces)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self._concatenations([self.names(node.left, at), self.names(node.right, at)])
        if isinstance(node, ast.IfExp):
            return self._union([node.body, node.orelse], at)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "self":
            return self._field(node.attr, at)
        return None

    def pattern(self, node: ast.expr, at: ast.AST) -> str:
        """A regular expression every value of `node` matches: its resolvable parts as
        they are, ``.*`` for the others."""
        names = self.names(node, at)
        if names is not None:
            return "(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")"
        if isinstance(node, ast.JoinedStr):
            return "".join(self.pattern(v.value, at) if isinstance(v, ast.FormattedValue)
                           else self.pattern(v, at) for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.pattern(node.left, at) + self.pattern(node.right, at)
        return ".*"

    def _field(self, field: str, at: ast.AST) -> Optional[set[str]]:
        """``self.<field>`` in a method of a class whose instances this module builds from
        literals (a table of records, as ``KINDS = (TrainerKind("mirrored", "torchstrategy.
        strategies.mirrored", ...), ...)``): the values given to that field. Instances built
        in other modules are not seen."""
        owner = at
        while owner in self.parents and not isinstance(owner, ast.ClassDef):
            owner = self.parents[owner]
        if not isinstance(owner, ast.ClassDef):
            return None
        fields = [n.target.id for n in owner.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        given = []
        for call in ast.walk(self.source.tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and \
                    call.func.id == owner.name:
                position = fields.index(field) if field in fields else len(call.args)
                argument = _argument(call, position, field)
                if argument is None:
                    return None
                given.append(argument)
        return self._union(given, at) if given else None

    def _union(self, nodes: Iterable[ast.expr], at: ast.AST) -> Optional[set[str]]:
        found: set[str] = set()
        for node in nodes:
            names = self.names(node, at)
            if names is None:
                return None
            found |= names
        return found

    @staticmethod
    def _concatenations(pieces: list[Optional[set[str]]]) -> Optional[set[str]]:
        if any(piece is None for piece in pieces):
            return None
        return {"".join(parts) for parts in itertools.product(*pieces)}

    def relative(self, name: str, package: Optional[ast.expr], at: ast.AST) -> Optional[str]:
        """``import_module(".x", package)`` as an absolute name; None if unknowable."""
        level = len(name) - len(name.lstrip("."))
        if package is None:
            return None
        if isinstance(package, ast.Name) and package.id in ("__name__", "__package__"):
            anchor = self.source.module.split(".")
            if package.id == "__package__" and not self.source.is_package:
                anchor = anchor[:-1]
        else:
            anchors = self.names(package, at)
            if anchors is None or len(anchors) != 1:
                return None
            anchor = next(iter(anchors)).split(".")
        anchor = anchor[: len(anchor) - (level - 1)]
        return ".".join(anchor + ([name[level:]] if name[level:] else []))


def _import_functions(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the importlib module, names bound to importlib.import_module)."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "importlib"}
        elif isinstance(node, ast.ImportFrom) and node.module == "importlib" and not node.level:
            functions |= {a.asname or a.name for a in node.names if a.name == "import_module"}
    return modules, functions


def _dynamic_call(node: ast.Call, importlib_names: set[str], import_module_names: set[str]
                  ) -> Optional[str]:
    """"import_module" or "__import__" when `node` calls one of them, else None."""
    function = node.func
    if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
        if function.attr == "import_module" and function.value.id in importlib_names:
            return "import_module"
        if function.attr == "__import__" and function.value.id == "builtins":
            return "__import__"
    if isinstance(function, ast.Name):
        if function.id in import_module_names:
            return "import_module"
        if function.id == "__import__":
            return "__import__"
    return None


def _argument(node: ast.Call, position: int, keyword: str) -> Optional[ast.expr]:
    if len(node.args) > position:
        return node.args[position]
    return next((k.value for k in node.keywords if k.arg == keyword), None)


def parse_imports(source: Source, known: set[str],
                  constants_by_module: Mapping[str, Mapping[str, ast.expr]]) -> list[Import]:
    """Every import of `source`: ``import`` statements and dynamic imports. `known` is the
    set of module names that exist (to tell ``from pkg import submodule`` from a name in
    pkg); `constants_by_module` the module-level constants of the package's modules."""
    tree = source.tree
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def inside_function(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return True
        return False

    resolver = _DynamicNames(source, visible_constants(source, constants_by_module), parents)
    importlib_names, import_module_names = _import_functions(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(source.module, a.name, inside_function(node), node.lineno)
                      for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(source, node)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append(Import(source.module, candidate if candidate in known else base,
                                    inside_function(node), node.lineno))
        elif isinstance(node, ast.Call):
            kind = _dynamic_call(node, importlib_names, import_module_names)
            name_node = _argument(node, 0, "name")
            if kind is None or name_node is None:
                continue
            written = ast.unparse(name_node)
            names = resolver.names(name_node, node)
            targets: list[Optional[str]] = [None]
            maybe_own = False
            if names is None:
                pattern = resolver.pattern(name_node, node)
                maybe_own = any(re.fullmatch(pattern, m) for m in known if is_own(m))
            if names is not None:
                targets = []
                for name in sorted(names):
                    if name.startswith("."):
                        absolute = resolver.relative(
                            name, _argument(node, 1, "package"), node) \
                            if kind == "import_module" else None
                        targets.append(absolute)
                    else:
                        targets.append(name)
                if kind == "__import__":  # __import__(name, g, l, fromlist): submodules too
                    fromlist = _argument(node, 3, "fromlist")
                    items = resolver.names(fromlist, node) if fromlist is not None else set()
                    targets += [f"{t}.{item}" for t in list(targets) if t is not None
                                for item in sorted(items or ()) if f"{t}.{item}" in known]
            found += [Import(source.module, target, inside_function(node), node.lineno,
                             dynamic=True, expression=written, maybe_own=maybe_own)
                      for target in targets]
    return found


def package_imports(sources: Mapping[str, Source], known: set[str]) -> list[Import]:
    """Every import of every module in `sources`."""
    constants = {module: module_constants(source.tree) for module, source in sources.items()}
    return [imp for source in sources.values()
            for imp in parse_imports(source, known, constants)]


IMPORTS = package_imports(SOURCES, KNOWN)


# -- the checks, as functions of the imports (tested on small sources below) ---------------
def upward_imports(imports: Iterable[Import], layers: Mapping[str, int]) -> list[str]:
    """Each import of a module in a higher layer than the importer's, described."""
    return sorted(f"{i.module} (layer {layers[i.module]}) imports {i.target} (layer "
            f"{layers[i.target]}) at line {i.line}"
            for i in imports
            if i.target in layers and i.module in layers and layers[i.target] > layers[i.module])


def hidden_imports(imports: Iterable[Import], deferred: Iterable[str] = ()) -> list[str]:
    """Each import inside a function that is neither an optional dependency nor one of our
    modules listed as deferred, described."""
    allowed = set(deferred)
    hidden = sorted((i.module, i.line, i.target or "", i.expression) for i in imports
                    if i.inside_function and i.target is not None and i.target not in allowed
                    and (is_own(i.target) or not i.target.startswith(OPTIONAL)))
    return [f"{module}:{line} imports {target} inside a function"
            + (f" (through {expression})" if expression else "")
            for module, line, target, expression in hidden]


def unresolved_imports(imports: Iterable[Import],
                       third_party: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Each dynamic import whose name cannot be resolved and is not listed, described."""
    listed = set(third_party)
    return [f"{i.module}:{i.line} imports {i.expression}: name it in a module-level constant "
            f"(or, for another package's module, list it in UNRESOLVED_THIRD_PARTY)"
            for i in imports
            if i.target is None and i.maybe_own and (i.module, i.expression) not in listed]


def import_cycles(imports: Iterable[Import], modules: Iterable[str]) -> list[list[str]]:
    """The import cycles among `modules`: each as the sorted modules of one strongly
    connected component of more than one module."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in imports:
        # A package's __init__ importing its own children is no cycle; a child importing
        # its own package is, so that edge stays.
        if i.target in graph and i.target != i.module and \
                not i.target.startswith(i.module + "."):
            graph[i.module].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


# -- docs/architecture.md ------------------------------------------------------------------
_LAYER_LINE = re.compile(r"^ ?(\d) ")           # " 7  strategies/..." starts layer 7
_MODULE_WORD = re.compile(r"^[A-Za-z_][\w/{},]*(\.py|/)$")
_BRACES = re.compile(r"^(?P<head>[^{}]*)\{(?P<choices>[^{}]*)\}(?P<tail>[^{}]*)$")


def layer_diagram(page: str) -> str:
    """The layer diagram: the page's first fenced block."""
    match = re.search(r"^```[^\n]*\n(.*?)^```", page, re.S | re.M)
    assert match, "docs/architecture.md has no layer diagram (its first fenced block)"
    return match.group(1)


def dotted_name(path: str) -> str:
    """A path of the diagram as a module name: `strategies/base.py` ->
    torchstrategy.strategies.base, `input/` -> torchstrategy.input (the package),
    `__init__.py` or `torchstrategy/__init__.py` -> torchstrategy, `_C` -> torchstrategy._C."""
    parts = [p for p in path.removesuffix(".py").split("/") if p]
    if parts[:1] == [PACKAGE_NAME]:  # written from the repository root
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE_NAME] + parts)


def module_paths(line: str, bare_names: Iterable[str] = ()) -> list[str]:
    """The module paths named in one line of the diagram: words ending in `.py` (a module)
    or `/` (a package), with one `{a,b}` group expanded, and the `bare_names` (compiled
    extensions). Other words are prose."""
    paths = []
    for word in line.split():
        word = word.strip("(),;:")
        if word in bare_names:
            paths.append(word)
        elif _MODULE_WORD.match(word):
            match = _BRACES.match(word)
            paths += [match["head"] + choice + match["tail"]
                      for choice in match["choices"].split(",")] if match else [word]
    return paths


def layers_from_diagram(diagram: str, bare_names: Iterable[str] = ()
                        ) -> tuple[dict[str, int], list[str]]:
    """({module name: layer} as the diagram draws it, the modules it names in two layers).
    A line starting with a digit (after at most one space) starts that layer; the lines
    after it continue it."""
    layers: dict[str, int] = {}
    conflicts = []
    layer = None
    for line in diagram.splitlines():
        start = _LAYER_LINE.match(line)
        if start:
            layer, line = int(start.group(1)), line[start.end():]
        for path in module_paths(line, bare_names):
            if layer is None:
                conflicts.append(f"{path} is named before the first layer's number")
                continue
            name = dotted_name(path)
            if layers.setdefault(name, layer) != layer:
                conflicts.append(f"{path} is in layer {layers[name]} and in layer {layer}")
    return layers, conflicts


def folders_in_tests_section(page: str) -> set[str]:
    """The test folders the page's Tests section names: list items starting with the
    folder, "- `core/`: ..." (or "- `tests/core/`: ...")."""
    match = re.search(r"^## Tests[ \t]*\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert match, "docs/architecture.md has no '## Tests' section"
    return set(re.findall(r"^- `(?:tests/)?(\w+)/`", match.group(1), re.M))


with open(ARCHITECTURE_PAGE) as _page:
    PAGE = _page.read()
LAYERS, LAYER_CONFLICTS = layers_from_diagram(layer_diagram(PAGE),
                                              [e.rsplit(".", 1)[1] for e in EXTENSIONS])


def layer_bounds(module: str, imports: Iterable[Import], layers: Mapping[str, int]
                 ) -> tuple[int, int]:
    """(lowest, highest) layer `module` may take given what it imports and what imports
    it."""
    imports = list(imports)
    below = [layers[i.target] for i in imports if i.module == module and i.target in layers]
    above = [layers[i.module] for i in imports if i.target == module and i.module in layers]
    return max(below, default=0), min(above, default=max(layers.values(), default=0))


def _path_of(module: str) -> str:
    path = PATHS.get(module, module.replace(".", "/") + ".py")
    return os.path.relpath(path, ROOT)


# -- the tests -----------------------------------------------------------------------------
def test_the_diagram_names_every_module_in_a_layer():
    missing = []
    for module in sorted(MODULES - set(LAYERS)):
        lowest, highest = layer_bounds(module, IMPORTS, LAYERS)
        fits = f"layer {lowest}" if lowest == highest else \
            f"a layer from {lowest} to {highest}" if lowest < highest else \
            f"no layer: it imports from layer {lowest} and layer {highest} imports it"
        missing.append(f"{_path_of(module)}: its imports fit {fits}")
    assert not missing, ("modules the layer diagram of docs/architecture.md does not name "
                         "(add each to the diagram, in its layer):\n" + "\n".join(missing))


def test_the_diagram_names_each_module_in_one_layer():
    assert not LAYER_CONFLICTS, "\n".join(LAYER_CONFLICTS)


def test_the_diagram_names_no_module_that_does_not_exist():
    absent = sorted(set(LAYERS) - KNOWN)
    assert not absent, f"docs/architecture.md's layer diagram names no such module: {absent}"


def test_the_tests_section_names_every_test_folder():
    folders = {name for name in os.listdir(TESTS)
               if os.path.isdir(os.path.join(TESTS, name)) and not name.startswith((".", "_"))}
    named = folders_in_tests_section(PAGE)
    assert folders - named == set(), \
        f"test folders the Tests section of docs/architecture.md does not name: " \
        f"{sorted(folders - named)}"
    assert named - folders == set(), \
        f"the Tests section of docs/architecture.md names no such folder: " \
        f"{sorted(named - folders)}"


def test_no_module_imports_from_a_higher_layer():
    upward = upward_imports((i for i in IMPORTS if i.target is not None and is_own(i.target)),
                            LAYERS)
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = import_cycles(IMPORTS, MODULES)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_inside_functions_are_optional_dependencies_only():
    hidden = hidden_imports(IMPORTS, DEFERRED)
    assert not hidden, "\n".join(hidden)


def test_every_dynamic_import_is_resolved_or_listed():
    unresolved = unresolved_imports(IMPORTS, UNRESOLVED_THIRD_PARTY)
    assert not unresolved, "\n".join(unresolved)
    # A listed exception that no longer exists is removed, so the list cannot grow stale.
    present = {(i.module, i.expression) for i in IMPORTS if i.target is None and i.maybe_own}
    stale = sorted(set(UNRESOLVED_THIRD_PARTY) - present)
    assert not stale, f"UNRESOLVED_THIRD_PARTY lists imports that are gone: {stale}"


def test_dynamic_imports_of_our_modules_name_existing_modules():
    wrong = [f"{i.module}:{i.line} imports {i.target} (through {i.expression}): no such module"
             for i in IMPORTS if i.dynamic and i.target is not None and is_own(i.target)
             and i.target not in KNOWN]
    assert not wrong, "\n".join(wrong)


def test_deferred_modules_exist_and_are_imported_inside_a_function():
    for module in DEFERRED:
        assert module in MODULES, module
        assert any(i.target == module and i.inside_function for i in IMPORTS), \
            f"nothing imports {module} inside a function any more: remove it from DEFERRED"


def test_private_apis_only_through_compat():
    offenders = []
    for module, path in sorted(PATHS.items()):
        if module == f"{PACKAGE_NAME}._compat":
            continue
        with open(path) as file:
            for number, line in enumerate(file, 1):
                code = line.split("#")[0]
                if any(api in code for api in PRIVATE_APIS):
                    offenders.append(f"{module}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_global_rebinding_or_exit_handlers_outside_the_runtime():
    offenders = []
    for module, source in sorted(SOURCES.items()):
        for node in ast.walk(source.tree):
            if isinstance(node, ast.Global):
                offenders.append(f"{module}:{node.lineno}: global {', '.join(node.names)}")
            if isinstance(node, ast.Attribute) and node.attr == "register" and \
                    isinstance(node.value, ast.Name) and node.value.id == "atexit" and \
                    module != f"{PACKAGE_NAME}.runtime":
                offenders.append(f"{module}:{node.lineno}: atexit.register")
    assert not offenders, "\n".join(offenders)


def test_import_has_no_side_effects():
    code = textwrap.dedent("""
        import logging, sys, threading
        before_threads = threading.active_count()
        before_finders = list(sys.meta_path)
        import torchstrategy as ts
        log = logging.getLogger("torchstrategy")
        assert threading.active_count() == before_threads, "a thread was started"
        assert sys.meta_path == before_finders, "an import hook was installed"
        assert log.propagate, "the torchstrategy logger must propagate"
        assert all(isinstance(h, logging.NullHandler) for h in log.handlers), log.handlers
        for name in ("lightning", "pytorch_lightning", "torch_xla"):
            assert name not in sys.modules, name + " was imported"
        # FSDP2 / DTensor cost every replica process ~40% more import time: only
        # ShardedStrategy needs them, and ts.ShardedStrategy imports them when first used.
        import torchstrategy.lightning_base.adapter
        for name in ("torch.distributed.fsdp", "torch.distributed.tensor",
                     "torch.distributed.checkpoint"):
            assert name not in sys.modules, name + " was imported"
        assert ts.ShardedStrategy.__name__ == "ShardedStrategy"
        from torchstrategy import runtime
        assert runtime._holder.runtime is None, "the runtime was created at import"
        print("clean")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-2000:]


# -- the parser itself, on small sources ---------------------------------------------------
def _imports_of(sources: Mapping[str, str], packages: Iterable[str] = ()) -> list[Import]:
    """The imports of small modules given as {module name: source}."""
    parsed = {name: parse_source(name, textwrap.dedent(text), name in set(packages))
              for name, text in sources.items()}
    return package_imports(parsed, set(parsed))


def _targets(imports: Iterable[Import], module: str = "torchstrategy.a"
             ) -> set[tuple[Optional[str], bool]]:
    """(target, inside a function?) of each dynamic import of `module`."""
    return {(i.target, i.inside_function) for i in imports if i.module == module and i.dynamic}


def test_parser_sees_import_module_of_a_string_inside_a_function():
    imports = _imports_of({"torchstrategy.a": """
        import importlib
        def load():
            return importlib.import_module("torchstrategy.b")
        """, "torchstrategy.b": ""})
    assert (("torchstrategy.b", True)) in _targets(imports)
    assert hidden_imports(imports) == [
        "torchstrategy.a:4 imports torchstrategy.b inside a function "
        "(through 'torchstrategy.b')"]
    assert hidden_imports(imports, deferred=["torchstrategy.b"]) == []


def test_parser_sees_an_entry_of_a_module_level_table():
    imports = _imports_of({"torchstrategy.a": """
        import importlib as loader
        MODULES = {"lightning.pytorch": "torchstrategy.b", "pytorch_lightning": "torchstrategy.c"}
        for package in pick():
            loader.import_module(MODULES[package])
        """, "torchstrategy.b": "", "torchstrategy.c": ""})
    assert _targets(imports) == {("torchstrategy.b", False), ("torchstrategy.c", False)}


def test_parser_sees_a_table_imported_from_another_module_and_finds_the_cycle():
    imports = _imports_of({
        "torchstrategy.lightning_base.adapter": """
            import importlib
            from torchstrategy.lightning_base.tables import MODULES
            def package_module(package):
                return importlib.import_module(MODULES[package])
            """,
        "torchstrategy.lightning_base.tables": """
            MODULES = {"lightning.pytorch": "torchstrategy.lightning.lightning_pytorch"}
            """,
        "torchstrategy.lightning.lightning_pytorch": """
            from torchstrategy.lightning_base import adapter
            """,
        "torchstrategy.lightning_base": "", "torchstrategy.lightning": ""},
        packages=["torchstrategy.lightning_base", "torchstrategy.lightning"])
    assert ("torchstrategy.lightning.lightning_pytorch", True) in \
        _targets(imports, "torchstrategy.lightning_base.adapter")
    assert import_cycles(imports, {i.module for i in imports}) == [
        ["torchstrategy.lightning.lightning_pytorch", "torchstrategy.lightning_base.adapter"]]


def test_parser_sees_import_module_imported_by_name_and_dunder_import():
    imports = _imports_of({"torchstrategy.a": """
        from importlib import import_module as load
        NAME = "torchstrategy.b"
        load(NAME)
        __import__("torchstrategy.c")
        __import__("torchstrategy", None, None, ["d"])
        """, "torchstrategy.b": "", "torchstrategy.c": "", "torchstrategy.d": "",
        "torchstrategy": ""}, packages=["torchstrategy"])
    assert _targets(imports) == {("torchstrategy.b", False), ("torchstrategy.c", False),
                                 ("torchstrategy", False), ("torchstrategy.d", False)}


def test_parser_resolves_loops_fstrings_and_relative_names():
    imports = _imports_of({"torchstrategy.pkg.a": """
        import importlib
        PACKAGES = ("lightning.pytorch", "pytorch_lightning")
        SUFFIX = "b"
        def probe():
            for package in PACKAGES:
                importlib.import_module(package)
            importlib.import_module(f"torchstrategy.pkg.{SUFFIX}")
            importlib.import_module(".c", __package__)
            importlib.import_module("torchstrategy." + ("pkg.b" if probe else "pkg.c"))
        """, "torchstrategy.pkg.b": "", "torchstrategy.pkg.c": ""})
    assert _targets(imports, "torchstrategy.pkg.a") == {
        ("lightning.pytorch", True), ("pytorch_lightning", True),
        ("torchstrategy.pkg.b", True), ("torchstrategy.pkg.c", True)}
    # Lightning is an optional dependency: allowed inside a function; our modules are not.
    assert [h.split(" inside")[0] for h in hidden_imports(imports)] == [
        "torchstrategy.pkg.a:8 imports torchstrategy.pkg.b",
        "torchstrategy.pkg.a:9 imports torchstrategy.pkg.c",
        "torchstrategy.pkg.a:10 imports torchstrategy.pkg.b",
        "torchstrategy.pkg.a:10 imports torchstrategy.pkg.c"]


def test_parser_sees_a_field_of_records_built_in_the_module():
    imports = _imports_of({"torchstrategy.a": """
        import dataclasses, importlib
        @dataclasses.dataclass(frozen=True)
        class Kind:
            kind: str
            module: str
            def load(self):
                return importlib.import_module(self.module)
        KINDS = (Kind("b", "torchstrategy.b"), Kind(kind="c", module="torchstrategy.c"))
        """, "torchstrategy.b": "", "torchstrategy.c": ""})
    assert _targets(imports) == {("torchstrategy.b", True), ("torchstrategy.c", True)}


def test_parser_reports_names_it_cannot_resolve():
    imports = _imports_of({"torchstrategy.a": """
        import importlib
        MODULES = ("torchstrategy.b",)
        def load(package, MODULES):
            importlib.import_module(f"{package}.strategies")
            importlib.import_module(MODULES[0])
            importlib.import_module(f"{package}.callbacks")
        def other():
            MODULES = pick()
            importlib.import_module(MODULES[0])
        """, "torchstrategy.strategies": ""})
    # A parameter or a local variable hides the module-level MODULES. f"{package}.strategies"
    # could be torchstrategy.strategies; nothing of ours ends in ".callbacks", so that one
    # is another package's module.
    assert sorted((i.line, i.target, i.expression, i.maybe_own)
                  for i in imports if i.dynamic) == [
        (5, None, "f'{package}.strategies'", True), (6, None, "MODULES[0]", True),
        (7, None, "f'{package}.callbacks'", False), (10, None, "MODULES[0]", True)]
    assert len(unresolved_imports(imports)) == 3
    assert unresolved_imports(imports, [("torchstrategy.a", "f'{package}.strategies'"),
                                        ("torchstrategy.a", "MODULES[0]")]) == []


def test_upward_imports_are_found_for_dynamic_imports():
    imports = _imports_of({"torchstrategy.low": """
        import importlib
        importlib.import_module("torchstrategy.high")
        """, "torchstrategy.high": ""})
    assert upward_imports(imports, {"torchstrategy.low": 1, "torchstrategy.high": 2}) == [
        "torchstrategy.low (layer 1) imports torchstrategy.high (layer 2) at line 3"]


def test_the_diagram_parser():
    diagram = textwrap.dedent("""\
         8  __init__.py          re-exports the public surface
         7  strategies/ strategies/{one_device,mirrored}.py, xla/
            server.py            ``python -m torchstrategy.server`` (reads csrc/compat.h)
         1  values.py, input/contexts.py
         0  _compat.py, _C       private APIs
        """)
    assert layers_from_diagram(diagram, ["_C"]) == ({
        "torchstrategy": 8, "torchstrategy.strategies": 7,
        "torchstrategy.strategies.one_device": 7, "torchstrategy.strategies.mirrored": 7,
        "torchstrategy.xla": 7, "torchstrategy.server": 7, "torchstrategy.values": 1,
        "torchstrategy.input.contexts": 1, "torchstrategy._compat": 0, "torchstrategy._C": 0},
        [])
    # A path in the prose counts: naming a module in another layer's line is a conflict.
    assert layers_from_diagram(" 2  values.py\n 1  nest.py (unlike values.py)\n")[1] == [
        "values.py is in layer 2 and in layer 1"]


def test_the_tests_section_parser():
    page = textwrap.dedent("""\
        ## Tests

        - `core/`: the core
        - `tests/helpers/`: shared helpers, not `scripts/` mentioned in passing

        ## Later
        - `other/`: not in the Tests section
        """)
    assert folders_in_tests_section(page) == {"core", "helpers"}


def test_layer_bounds_say_where_a_new_module_fits():
    imports = _imports_of({
        "torchstrategy.new": "from torchstrategy import low\n",
        "torchstrategy.low": "", "torchstrategy.high": "from torchstrategy import new\n",
        "torchstrategy": ""}, packages=["torchstrategy"])
    assert layer_bounds("torchstrategy.new", imports,
                        {"torchstrategy.low": 3, "torchstrategy.high": 6}) == (3, 6)
