"""The package layering, read from the source: kernels <- ls_jax <- configs / entry scripts.

An AST walk over ``ls_jax/`` and ``kernels/`` (installed as ``ls_jax.kernels``) collects every
import statement, at module level or inside a function, and fails on

* an import cycle between modules of the package, and
* an upward import: ``ls_jax.kernels`` importing ``ls_jax`` outside ``ls_jax.kernels``, or the
  library importing ``ls_jax.configs`` or the repository's experiments/bench/tests scripts, and
* inside the library, an import against the order of its parts (``PARTS``: run_hint <- config <- sharding
  <- layers, inputs <- training <- inference <- interop; parts of one rank do not import each
  other), or a module that belongs to no part.

The same checks run on small synthetic module graphs first, so the test is known to fail when
it should.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# folder in the repository -> the package name it installs as (pyproject package-dir)
PACKAGE_DIRS = {"ls_jax": "ls_jax", "kernels": "ls_jax.kernels"}
KERNELS = "ls_jax.kernels"
# what the library must never import: the layer above it and the repository's scripts
ABOVE_LIBRARY = ("ls_jax.configs", "configs", "experiments", "bench", "tests", "train", "eval")
# the library's parts, lowest first: a module imports its own part and lower ranks only
PARTS = (
    ("ls_jax.run_hint",),                # the entry points' one line without JAX (stdlib only)
    ("ls_jax.config",),                  # the typed settings
    ("ls_jax.sharding",),                # the mesh and how arrays lie on it
    ("ls_jax.layers", "ls_jax.inputs"),  # the model; documents -> tokens -> batches
    ("ls_jax.training",),                # state, step, loop, evaluation, run directory
    ("ls_jax.inference",),               # decoding and sampling from a run
    ("ls_jax.interop",),                 # other stacks (Linen, attention_fn), export, weights
)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def read_package_sources() -> tuple[dict[str, str], set[str]]:
    """{module name: source} of every .py file in the package folders, and the package names."""
    sources, packages = {}, set()
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
                packages.add(".".join([package, *parts]))
            sources[".".join([package, *parts])] = path.read_text()
    return sources, packages


def imported_names(module: str, source: str, modules: set[str], packages: set[str]) -> set[str]:
    """Every module ``module`` imports, anywhere in its source (functions included).

    ``from X import y`` counts as an import of ``X.y`` when that is a module, else of ``X``;
    relative imports are resolved against ``module``.
    """
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if module not in packages:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                full = f"{target}.{alias.name}"
                names.add(full if full in modules else target)
    return names


def import_graph(sources: dict[str, str], packages: set[str] = frozenset()) -> dict[str, set[str]]:
    """{module: every name it imports} (internal and external)."""
    modules = set(sources)
    return {m: imported_names(m, src, modules, set(packages)) for m, src in sources.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among the graph's own modules, as strongly connected components of
    more than one module (or a module importing itself)."""
    internal = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in sorted(internal[m]):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                on_stack.discard(t)
                component.append(t)
                if t == m:
                    break
            if len(component) > 1 or m in internal[m]:
                components.append(sorted(component))

    for m in sorted(internal):
        if m not in index:
            visit(m)
    return components


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported' for every import against the layering."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if _within(module, KERNELS):
                if _within(target, "ls_jax") and not _within(target, KERNELS):
                    bad.append(f"{module} -> {target}")
            elif any(_within(target, above) for above in ABOVE_LIBRARY):
                bad.append(f"{module} -> {target}")
    return bad


def part_of(module: str, parts=PARTS) -> tuple[int, str] | None:
    """(rank, part) of the library part holding ``module``, or None."""
    for rank, same_rank in enumerate(parts):
        for part in same_rank:
            if _within(module, part):
                return rank, part
    return None


def part_order_violations(graph: dict[str, set[str]], parts=PARTS) -> list[str]:
    """'importer -> imported' for every import inside the library against the parts' order, and
    'module: in no part' for a library module outside every part (the package root excepted)."""
    bad = []
    for module, targets in sorted(graph.items()):
        if module == "ls_jax" or _within(module, KERNELS) or not _within(module, "ls_jax"):
            continue
        own = part_of(module, parts)
        if own is None:
            bad.append(f"{module}: in no part")
            continue
        for target in sorted(targets):
            other = part_of(target, parts)
            if other is not None and other[1] != own[1] and other[0] >= own[0]:
                bad.append(f"{module} -> {target}")
    return bad


# -- the checks on synthetic graphs: they must fail where they should -------------------------

def test_checks_catch_a_cycle_hidden_in_a_function():
    sources = {
        "ls_jax": "",
        "ls_jax.data": "from ls_jax.tokenizer import make_tokenizer\n",
        "ls_jax.tokenizer": "def train():\n    from ls_jax.data import load_documents\n",
        "ls_jax.model": "from . import data\n",
    }
    graph = import_graph(sources, {"ls_jax"})
    assert graph["ls_jax.model"] == {"ls_jax.data"}
    assert find_cycles(graph) == [["ls_jax.data", "ls_jax.tokenizer"]]
    del sources["ls_jax.tokenizer"]
    assert find_cycles(import_graph(sources, {"ls_jax"})) == []


def test_checks_catch_a_module_importing_itself_and_a_three_cycle():
    graph = import_graph({"p.a": "import p.b\n", "p.b": "from p import c\n",
                          "p.c": "import p.a, os\n", "p.d": "import p.d\n"})
    assert find_cycles(graph) == [["p.a", "p.b", "p.c"], ["p.d"]]


def test_checks_catch_upward_imports():
    sources = {
        "ls_jax.kernels.api": "import jax\nfrom ls_jax.kernels import band\n",
        "ls_jax.kernels.band": "def f():\n    from ls_jax.config import ModelConfig\n",
        "ls_jax.cli": "from ls_jax.configs import get_config\n",
        "ls_jax.train": "import experiments.stability\nfrom bench import attention\n",
        "ls_jax.model": "from ls_jax.kernels import api\nimport numpy\n",
    }
    assert upward_imports(import_graph(sources)) == [
        "ls_jax.cli -> ls_jax.configs",
        "ls_jax.kernels.band -> ls_jax.config",
        "ls_jax.train -> bench",
        "ls_jax.train -> experiments.stability",
    ]


def test_relative_imports_resolve_against_the_package():
    sources = {"ls_jax.kernels": "from .api import ls_attention\n",
               "ls_jax.kernels.api": "from . import band\nfrom .. import config\n",
               "ls_jax.kernels.band": ""}
    graph = import_graph(sources, {"ls_jax.kernels"})
    assert graph["ls_jax.kernels"] == {"ls_jax.kernels.api"}
    assert graph["ls_jax.kernels.api"] == {"ls_jax.kernels.band", "ls_jax"}
    assert upward_imports(graph) == ["ls_jax.kernels.api -> ls_jax"]


def test_checks_catch_imports_against_the_parts_order():
    sources = {
        "ls_jax": "",
        "ls_jax.config": "",
        "ls_jax.layers.model": "from ls_jax.config import C\nfrom ls_jax.inputs import data\n",
        "ls_jax.inputs.data": "from ls_jax.config import C\n",
        "ls_jax.training.train": "from ls_jax.layers import model\nfrom ls_jax.inputs import data\n",
        "ls_jax.config_extra": "import ls_jax.training.train\n",
        "ls_jax.inference.sample": "from ls_jax.interop import weights\nimport ls_jax.kernels\n",
        "ls_jax.interop.weights": "from ls_jax.inference import sample\n",
    }
    assert part_order_violations(import_graph(sources, {"ls_jax"})) == [
        "ls_jax.config_extra: in no part",
        "ls_jax.inference.sample -> ls_jax.interop.weights",
        "ls_jax.layers.model -> ls_jax.inputs.data",
    ]


# -- the real package ---------------------------------------------------------------------------

def test_the_package_is_read():
    sources, packages = read_package_sources()
    assert {"ls_jax", "ls_jax.training.train", "ls_jax.kernels", "ls_jax.kernels.api"} <= set(sources)
    assert {"ls_jax", "ls_jax.kernels"} <= packages
    graph = import_graph(sources, packages)
    assert "ls_jax.config" in graph["ls_jax.layers.transformer"]


def test_no_import_cycles_in_the_package():
    sources, packages = read_package_sources()
    assert find_cycles(import_graph(sources, packages)) == []


def test_no_upward_imports_in_the_package():
    sources, packages = read_package_sources()
    assert upward_imports(import_graph(sources, packages)) == []


def test_library_imports_follow_the_parts_order():
    sources, packages = read_package_sources()
    assert {part for same_rank in PARTS for part in same_rank} <= set(sources)
    assert part_order_violations(import_graph(sources, packages)) == []


@pytest.mark.parametrize("old, new", [("ls_jax.linen", "ls_jax.interop.linen"),
                                      ("ls_jax.model", "ls_jax.layers.transformer"),
                                      ("ls_jax.generate", "ls_jax.inference.generate")])
def test_an_old_module_path_says_where_the_module_went(old, new):
    import importlib
    import ls_jax
    assert ls_jax.MOVED[old] == new and importlib.import_module(new)
    for statement in (f"import {old}", f"from ls_jax import {old.split('.')[1]}"):
        with pytest.raises(ModuleNotFoundError, match=f"^{old} moved to {new} "):
            exec(statement, {})
