"""No import cycles inside the ``ipuft`` package, imports inside functions included.

An import inside a function breaks a cycle only at run time, and only for as long as nobody moves the call; the
modules still depend on each other. So the graph here is built from the source (AST) of every module of
``ipuft`` (``core/`` is ``ipuft``, ``cli/`` is ``ipuft.cli``), counting:

- every ``import a.b`` and ``from a.b import c``, at module level and inside functions, classes, ``try`` blocks
  and ``if`` branches, relative ones resolved against the importing module;
- ``from ipuft.x import y`` where ``y`` is a submodule as an edge to ``ipuft.x.y``;
- the package ``__init__`` of a module imported from elsewhere: importing ``ipuft.config.rules`` from
  ``ipuft.io`` runs ``ipuft/config/__init__.py`` first, and whatever that imports. A module's own enclosing
  packages are not counted again: Python starts importing them before the module itself, so they are already
  in ``sys.modules`` by the time it imports anything (a submodule that imports names from its own package's
  ``__init__`` still names it, and that is counted);
- ``importlib.import_module`` with a literal name.

Imports under ``if TYPE_CHECKING:`` are left out: they never run, and annotations need them only as strings.

Package ``__init__`` re-exports count like any other import: ``ipuft/config/__init__.py`` imports
``ipuft.config.load``, so a module outside ``ipuft.config`` that imports any of its submodules depends on all
that ``load`` imports, and nothing ``load`` reaches may import from ``ipuft.config``. ``ipuft/__init__.py``
re-exports ``hookimpl`` and ``__version__`` lazily (in its ``__getattr__``): ``ipuft`` -> ``ipuft.hookspecs`` is
an edge, as is a core module's explicit ``from ipuft import hookimpl``; the implicit import of ``ipuft`` that
every module makes is not (it encloses them all).
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# pyproject.toml's [tool.setuptools] package-dir: the import package is spread over two source folders.
PACKAGE_DIRS = {"ipuft": ROOT / "core", "ipuft.cli": ROOT / "cli"}


@dataclass(frozen=True)
class Module:
    """One module of the package: its dotted name, its file and whether it is a package ``__init__``."""

    name: str
    path: Path
    is_package: bool


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` of its file."""

    source: str
    target: str
    line: int


def package_modules(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, Module]:
    """Every module under the package folders, by dotted name (a folder's ``__init__.py`` is the folder's name)."""
    modules: dict[str, Module] = {}
    for package, folder in package_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([package, *parts])
            if name in modules:
                raise AssertionError(f"{name} is both {modules[name].path} and {path}")
            modules[name] = Module(name, path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_literal_import_module(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def _imports(tree: ast.AST):
    """Every import statement (and literal ``importlib.import_module`` call) below ``tree``, with those inside an
    ``if TYPE_CHECKING:`` body left out (its ``else`` runs, so it is kept)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom) or _is_literal_import_module(node):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    # ``from . import x`` in a package __init__ is relative to the package itself, in a module to its package.
    base = module.name.split(".")
    drop = node.level - 1 if module.is_package else node.level
    if drop >= len(base):
        raise AssertionError(f"{module.path}:{node.lineno}: relative import beyond the top-level package")
    anchor = base[:len(base) - drop]
    return ".".join(anchor + ([node.module] if node.module else []))


def _named(node, module: Module, known: set[str]) -> list[str]:
    """The modules an import statement names: ``import a.b`` names ``a.b``; ``from a import b`` names ``a.b``
    where that is a module, else ``a`` (``b`` is then a name of ``a``'s ``__init__``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.Call):
        return [node.args[0].value]
    base = _resolve(module, node)
    return sorted({f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names})


def _targets(named: str, importer: str) -> list[str]:
    """What importing ``named`` from ``importer`` runs: ``named`` itself, and each package above it that does not
    enclose ``importer`` (Python imports those before ``importer``, so they are under way already)."""
    parts = named.split(".")
    enclosing = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    above = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [m for m in above if m not in enclosing] + [named]


def import_edges(modules: dict[str, Module]) -> list[Edge]:
    """Every import of one module of the package by another, as counted in the module docstring."""
    known = set(modules)
    edges: set[Edge] = set()
    for module in modules.values():
        tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
        for node in _imports(tree):
            for named in _named(node, module, known):
                for target in _targets(named, module.name):
                    if target in known and target != module.name:
                        edges.add(Edge(module.name, target, node.lineno))
    return sorted(edges, key=lambda e: (e.source, e.target, e.line))


def knots(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (or of a module importing itself), in the
    order of their first module. Tarjan's algorithm, iterative so that a deep graph cannot overflow the stack."""
    nodes = sorted(set(edges) | {t for targets in edges.values() for t in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(sorted(edges.get(node, ())))))

    for root in nodes:
        if root in index:
            continue
        work: list = []
        visit(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    visit(child)
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] != index[node]:
                continue
            component, member = set(), None
            while member != node:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(component)
    return sorted(found, key=min)


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each of :func:`knots`: ``[a, b, ..., a]``, the shortest through its first module."""
    return [_cycle_in(component, edges) for component in knots(edges)]


def _cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest cycle through the component's first module, by breadth-first search inside the component."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in component and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")  # cannot happen: strongly connected


def _graph(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    return graph


def describe(cycle: list[str], edges: list[Edge], modules: dict[str, Module], root: Path = ROOT) -> str:
    """A cycle as one line per import, with the file (relative to ``root``) and line that make it."""
    lines = [" -> ".join(cycle)]
    for source, target in itertools.pairwise(cycle):
        at = min(e.line for e in edges if e.source == source and e.target == target)
        lines.append(f"  {modules[source].path.relative_to(root)}:{at}: {source} imports {target}")
    return "\n".join(lines)


def test_the_package_has_no_import_cycles():
    modules = package_modules()
    edges = import_edges(modules)
    graph = _graph(edges)
    report = []
    for component in knots(graph):
        report.append(describe(_cycle_in(component, graph), edges, modules))
        if len(component) > 2:
            report.append(f"  (the modules that import each other, directly or not: {', '.join(sorted(component))})")
    assert not report, "import cycles inside ipuft:\n" + "\n".join(report)


def test_the_graph_sees_the_whole_package():
    # A walk that silently found nothing would pass the test above: the modules and edges it must see.
    modules = package_modules()
    files = [*PACKAGE_DIRS["ipuft"].rglob("*.py"), *PACKAGE_DIRS["ipuft.cli"].rglob("*.py")]
    assert len(modules) == len(files) > 50
    assert {"ipuft", "ipuft.cli", "ipuft.cli.main", "ipuft.cli.commands", "ipuft.config.load", "ipuft.io.checkpoint",
            "ipuft.engine.phased", "ipuft.run.train"} <= set(modules)
    edges = {(e.source, e.target) for e in import_edges(modules)}
    assert ("ipuft.run.train", "ipuft.engine.phased") in edges  # at module level
    assert ("ipuft", "ipuft.hookspecs") in edges  # inside the package's __getattr__
    assert ("ipuft.config", "ipuft.config.load") in edges  # a package __init__'s re-export
    # resume imports ipuft.config.load and .migrate only, and so runs the package __init__ first.
    assert ("ipuft.run.resume", "ipuft.config") in edges
    assert ("ipuft.config.load", "ipuft.config") not in edges  # its own package: under way before it
    assert not any(source == target for source, target in edges)


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"a"}}, [["a", "a"]]),
    # Two knots; the cycle given is the shortest through the first module of each.
    ({"a": {"b", "x"}, "b": {"c"}, "c": {"a", "b"}, "x": {"y"}, "y": {"x"}, "z": {"a"}},
     [["a", "b", "c", "a"], ["x", "y", "x"]]),
    ({"a": {"d", "b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"f"}, "f": {"a"}}, [["a", "b", "c", "a"]]),
    # A diamond is no cycle.
    ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}}, []),
])
def test_find_cycles_on_synthetic_graphs(graph, expected):
    assert find_cycles(graph) == expected


def test_knots_gather_every_module_of_a_component():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"a"}}
    assert knots(graph) == [{"a", "b", "c"}]


def _package(root: Path, files: dict[str, str]) -> dict[str, Module]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return package_modules({"pkg": root / "pkg"})


def test_a_cycle_through_a_function_level_import_and_a_package_init_fails(tmp_path):
    # The shape the real package had: a package __init__ re-exporting a submodule that imports, inside a
    # function, a module that imports another submodule of the package (so runs its __init__).
    modules = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/conf/__init__.py": "from .load import load\n",
        "pkg/conf/load.py": "def load():\n    from pkg.io import ckpt\n",
        "pkg/conf/rules.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.io.ckpt import X\n",
        "pkg/io/__init__.py": "",
        "pkg/io/ckpt.py": "from ..conf.rules import check\n",
    })
    edges = import_edges(modules)
    assert {(e.source, e.target, e.line) for e in edges} == {
        ("pkg.conf", "pkg.conf.load", 1),
        ("pkg.conf.load", "pkg.io", 2), ("pkg.conf.load", "pkg.io.ckpt", 2),
        ("pkg.io.ckpt", "pkg.conf", 1), ("pkg.io.ckpt", "pkg.conf.rules", 1),
    }
    cycles = find_cycles(_graph(edges))
    assert cycles == [["pkg.conf", "pkg.conf.load", "pkg.io.ckpt", "pkg.conf"]]
    assert describe(cycles[0], edges, modules, tmp_path).splitlines() == [
        "pkg.conf -> pkg.conf.load -> pkg.io.ckpt -> pkg.conf",
        "  pkg/conf/__init__.py:1: pkg.conf imports pkg.conf.load",
        "  pkg/conf/load.py:2: pkg.conf.load imports pkg.io.ckpt",
        "  pkg/io/ckpt.py:1: pkg.io.ckpt imports pkg.conf",
    ]


def test_a_submodule_importing_a_name_of_its_own_package_init_is_a_cycle(tmp_path):
    # A sibling import is none (the package's __init__ is already under way); a name from the __init__ is.
    modules = _package(tmp_path, {
        "pkg/__init__.py": "from pkg import a, b\nimport importlib\n",
        "pkg/a.py": "from pkg import b\nfrom . import c\n",
        "pkg/b.py": "def f():\n    from pkg import VERSION\n",
        "pkg/c.py": "import importlib\nimportlib.import_module('pkg.a')\n",
    })
    edges = import_edges(modules)
    assert {(e.source, e.target) for e in edges} == {
        ("pkg", "pkg.a"), ("pkg", "pkg.b"), ("pkg.a", "pkg.b"), ("pkg.a", "pkg.c"), ("pkg.b", "pkg"), ("pkg.c", "pkg.a")}
    assert [sorted(k) for k in knots(_graph(edges))] == [["pkg", "pkg.a", "pkg.b", "pkg.c"]]
    assert find_cycles(_graph(edges)) == [["pkg", "pkg.b", "pkg"]]


def test_the_scheduler_holds_the_schedule_only():
    """The engine by concern: ``phased.py`` runs the program's phases and leaves the device bookkeeping (the
    ledger), the rounding and the checkpoints' full views to their modules; no engine module is over 350
    lines."""
    engine = ROOT / "core" / "engine"
    tree = ast.parse((engine / "phased.py").read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"ledger", "acquire", "round_stochastically", "full_tensors", "full_weights", "load_full"}
    sizes = {p.name: len(p.read_text().splitlines()) for p in engine.glob("*.py")}
    assert max(sizes.values()) <= 350, sizes


def test_the_store_alone_moves_and_counts_bytes():
    """The variable store is the one place that counts device bytes and traffic and copies between host and
    device: outside core/engine/store.py (and the counters it keeps, core/engine/counters.py) no module reaches a
    ledger or the traffic counts, adds to them, or makes an asynchronous copy of its own."""
    allowed = {ROOT / "core" / "engine" / "store.py", ROOT / "core" / "engine" / "counters.py"}
    counting = {"ledger", "_ledger", "_traffic", "acquire", "h2d", "d2h", "host_copy", "DeviceLedger", "copy_stream"}
    found = []
    for path in sorted((ROOT / "core").rglob("*.py")) + sorted((ROOT / "plugins").rglob("*.py")):
        if path in allowed or path.is_relative_to(ROOT / "core" / "plan"):  # the plan declares; it moves nothing
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                node.arg if isinstance(node, ast.keyword) else None
            if name in counting or name == "non_blocking":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, found


# What the engine and the exports may call on a component beyond forward, each declared in ipuft.components.
COMPONENT_METHODS = {"variable_specs", "hf_mapping", "projections", "hf_fused", "hf_config", "hf_exportable",
                     "uses_dropout", "adapter_shard_specs", "hf_merge", "peft_mapping", "peft_stacked", "peft_stack",
                     "peft_config"}


def test_no_component_method_is_looked_up_by_name(make_config, hooks):
    """Every method the engine and the exports call on a component is declared in ``ipuft.components``
    (:class:`~ipuft.components.Component` or one of its optional protocols, tested with ``isinstance``):
    nothing in core or the plugins finds one with ``getattr`` or ``hasattr``; the protocols tell the shipped
    modules apart as they are."""
    from ipuft import components
    from ipuft.engine.model import build_model

    protocols = (components.Component, components.HasProjections, components.HasFusedTensors,
                 components.HasHFConfig, components.Exportability, components.DrawsMasks, components.Adapted,
                 components.Merges, components.PeftExportable)
    assert all(any(hasattr(p, n) or n in p.__annotations__ for p in protocols) for n in COMPONENT_METHODS)
    found = []
    for path in sorted((ROOT / "core").rglob("*.py")) + sorted((ROOT / "plugins").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in COMPONENT_METHODS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not found, found

    gptj = build_model(make_config(), hooks).modules  # GPT-J: projections and a config part, no fused rows
    assert isinstance(gptj["decoder"], components.HasProjections) and isinstance(gptj["decoder"], components.HasHFConfig)
    assert not isinstance(gptj["decoder"], components.HasFusedTensors)
    assert not isinstance(gptj["embeddings"], components.HasProjections)
    lora = build_model(make_config("model.adapter=lora"), hooks).modules["decoder"]
    assert all(isinstance(lora, p) for p in (components.Adapted, components.Merges, components.PeftExportable))
    assert not isinstance(gptj["decoder"], components.Adapted) and all(map(components.exportable, gptj.values()))


def test_lora_names_no_other_plugins_modules(make_config, hooks):
    """plugins/lora finds the projections it adapts through each decoder's declared ``projections``: no string
    in its code (docstrings aside) is a module path of a shipped decoder, nor does it import one."""
    from ipuft.engine.model import build_model

    paths = set()
    for overrides in ((), ("model.decoder=llama", "model.embeddings=llama", "model.head=llama")):
        paths |= set(build_model(make_config(*overrides), hooks).modules["decoder"].projections.values())
    assert {"attn.q_proj", "self_attn.q_proj", "mlp.gate_proj"} <= paths
    for path in sorted((ROOT / "plugins" / "lora").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and id(n) not in docs}
        assert not {s for s in strings for p in paths if p in s}, path
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.startswith(("ipuft_decoder", "ipuft_llama", "ipuft_embeddings"))}, path


def test_the_engine_reads_settings_not_the_config():
    """At most 10 functions in core/engine take the whole config (``cfg``): building the model and the stored
    model, the scheduler, and :func:`~ipuft.engine.cuts.step_shape`, which types what the cutting rules read
    once; the rules themselves take a :class:`~ipuft.engine.cuts.StepShape`."""
    taking = []
    for path in sorted((ROOT / "core" / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    {"cfg", "config"} & {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}:
                taking.append(f"{path.name}:{node.name}")
    assert len(taking) <= 10, taking
    assert not [t for t in taking if t.startswith("cuts.") and t != "cuts.py:step_shape"], taking


# The layers, lowest first (docs/architecture.md draws them): a module is in the layer of the longest name here that
# is it or a package above it, and imports only from its own layer or lower ones.
LAYERS = {
    "ipuft": 0,  # the modules at the top of core/: the plugin API, and the helpers every layer may use
    "ipuft.config.sections": 0,  # the registry plugins register their config sections with (plugin API)
    "ipuft.io.files": 0,  # the one bounded reader of untrusted files, which every layer reads through
    "ipuft.config": 1, "ipuft.data": 1, "ipuft.io": 1, "ipuft.presets": 1, "ipuft.sample_data": 1,
    "ipuft.engine": 2, "ipuft.plan": 2,
    "ipuft.run": 3,
    "ipuft.cli": 4, "ipuft.testing": 4,  # the console script, and the pytest plugin that drives whole runs
}


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> int:
    parts = module.split(".")
    return next(layers[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in layers)


def named_edges(modules: dict[str, Module]) -> list[Edge]:
    """Every import of one module by another as the statement names it (not the package ``__init__``s above it
    that Python runs first: a layer is about what a module uses, and each ``__init__`` is checked on its own)."""
    known = set(modules)
    edges = set()
    for module in modules.values():
        for node in _imports(ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))):
            edges.update(Edge(module.name, t, node.lineno) for t in _named(node, module, known)
                         if t in known and t != module.name)
    return sorted(edges, key=lambda e: (e.source, e.target, e.line))


def climbing(edges: list[Edge], modules: dict[str, Module], root: Path = ROOT) -> list[str]:
    """The imports that climb a layer, and the engine's imports of the cost model, one line each."""
    def bad(e: Edge) -> bool:
        return layer_of(e.target) > layer_of(e.source) or (
            e.source.startswith("ipuft.engine") and e.target.startswith("ipuft.plan"))

    return [f"{modules[e.source].path.relative_to(root)}:{e.line}: {e.source} (layer {layer_of(e.source)}) imports "
            f"{e.target} (layer {layer_of(e.target)})" for e in edges if bad(e)]


def test_imports_only_point_down_the_layers():
    """plugin API < config, data, io < engine and plan < run < cli: no import climbs a layer, functions' included,
    and the engine never imports the cost model (the plan reads the engine's rules, :mod:`ipuft.engine.cuts`)."""
    modules = package_modules()
    edges = named_edges(modules)
    assert len(edges) > 300 and {m for m in modules if layer_of(m) == 2} >= {"ipuft.engine.phased", "ipuft.plan.memory"}
    report = climbing(edges, modules)
    assert not report, "imports that climb a layer:\n" + "\n".join(report)


def test_a_climbing_import_is_reported(tmp_path):
    _package(tmp_path, {"ipuft/__init__.py": "", "ipuft/api.py": "def f():\n    from ipuft.run import x\n",
                        "ipuft/run/__init__.py": "", "ipuft/run/x.py": "from ipuft import api\n",
                        "ipuft/engine/__init__.py": "", "ipuft/engine/a.py": "import ipuft.plan.b\n",
                        "ipuft/plan/__init__.py": "", "ipuft/plan/b.py": "from ipuft.engine import a\n"})
    modules = package_modules({"ipuft": tmp_path / "ipuft"})
    report = climbing(named_edges(modules), modules, tmp_path)
    assert report == ["ipuft/api.py:2: ipuft.api (layer 0) imports ipuft.run.x (layer 3)",
                      "ipuft/engine/a.py:1: ipuft.engine.a (layer 2) imports ipuft.plan.b (layer 2)"]
