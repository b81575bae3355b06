"""The import graph of covey's own modules: no cycles, and every import runs down the layers.

Every import statement counts, those inside functions and under ``TYPE_CHECKING`` too (an import
inside a function hides a cycle rather than removing it). The layers, from the top:

    cli                          the command line (only ``python -m covey`` imports it)
    verify                       the pipeline doctor
    train                        the step, the trainer, checkpoints, several processes
    agents | plan                tools, environments and episodes (the code sandbox of rewards); the memory
                                 estimate, from a model's config alone
    rewards | rollout | telemetry  independent of one another
    data | models | config       what those stand on
    vision                       pictures in rows and prompts, vision-language models (below data and models)
    core | errors | sources | trl_fields | rules | config_values   the maths (nothing of covey), and leaves
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src" / "covey"

# each part of covey, and the parts it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(), "sources": set(), "trl_fields": set(), "rules": {"errors"},
    "core": set(),  # the maths import nothing of covey
    "config_values": {"errors"},
    "vision": {"errors"},  # pictures in rows and prompts, vision-language models: what data and models stand on
    "config": {"errors", "sources", "trl_fields", "rules", "config_values"},
    "data": {"vision", "errors", "sources"},
    "models": {"vision", "errors", "sources"},
    "rewards": {"vision", "errors", "sources", "data"},  # rewards know no trainer
    "rollout": {"vision", "errors", "core", "models"},  # engines know no rewards and no run config
    "telemetry": {"vision", "errors", "data", "config"},  # telemetry knows no loop
    "agents": {"vision", "errors", "sources", "data", "rewards"},  # tools, environments, episodes: no engine, no trainer
    "train": {"vision", "errors", "sources", "rules", "plan", "core", "config", "data", "models", "rewards", "rollout", "telemetry", "agents"},
    "verify": {"vision", "errors", "sources", "rules", "plan", "core", "config", "data", "models", "rewards", "rollout", "telemetry", "agents",
               "train"},
    "plan": {"vision", "errors", "sources", "core", "config", "models", "rollout"},  # a model's config, never its weights
    "cli": {"vision", "errors", "sources", "trl_fields", "rules", "core", "config", "data", "models", "rewards", "rollout", "telemetry",
            "agents", "train", "verify", "plan", "__init__"},  # __init__: the package's __version__ (covey --version, env)
    "__init__": {"config", "errors", "train", "verify"},  # the package itself: its public names (verify_trl)
    "__main__": {"cli"},
}


def module_names(root: Path = SOURCE) -> dict[str, Path]:
    """covey's modules by dotted name (a package by its own name)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = ("covey", *path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The covey modules that the module ``name`` at ``path`` imports, wherever the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # a name that is a module of its own is an import of that module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = SOURCE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def part(module: str) -> str:
    """The part of covey a module belongs to: ``covey.train.step`` -> ``train``, ``covey`` -> ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a part that its importer's part may not import, as 'importer -> imported'."""
    return sorted(f"{importer} -> {imported}" for importer, targets in graph.items() for imported in targets
                  if part(imported) != part(importer) and part(imported) not in MAY_IMPORT[part(importer)])


def test_every_part_of_covey_has_a_layer():
    assert {part(m) for m in import_graph()} == set(MAY_IMPORT)


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_import_runs_down_the_layers():
    assert against_the_layers(import_graph()) == []


def test_the_checks_catch_a_cycle_an_upward_import_and_a_hidden_one(tmp_path):
    """On a small package written here: a cycle through an import inside a function, and an engine
    that imports the run's config, are both found."""
    root = tmp_path / "covey"
    (root / "rollout").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "config.py").write_text("from covey.rollout import engine\n")
    (root / "rollout" / "__init__.py").write_text("from covey.rollout.engine import Engine\n")
    (root / "rollout" / "engine.py").write_text("class Engine:\n    def settings(self):\n"
                                                "        from covey.config import GRPOConfig\n")
    graph = import_graph(root)
    assert graph["covey.rollout.engine"] == {"covey.config"} and graph["covey.config"] == {"covey.rollout.engine"}
    assert cycles(graph) == [["covey.config", "covey.rollout.engine"]]
    assert against_the_layers(graph) == ["covey.config -> covey.rollout.engine", "covey.rollout.engine -> covey.config"]


def test_the_slow_list_names_tests_that_exist():
    """tests/slow_tests.txt (the tests left out of `make test-fast`) names only tests the suite has, so the fast
    tier cannot silently grow back into the full one."""
    from tests.conftest import SLOW_TESTS

    root = Path(__file__).parent.parent
    for node_id in SLOW_TESTS:
        path, _, name = node_id.partition("::")
        function = name.split("[")[0]
        tree = ast.parse((root / path).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in ast.walk(tree)), node_id


def test_the_package_data_names_files_that_exist():
    """pyproject's package data (files read next to a module at run time) matches files in the package, so a
    wheel carries them (a pattern that matches nothing is silently left out of it)."""
    import tomllib

    root = Path(__file__).parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["covey"]
    for pattern in patterns:
        assert list((root / "src" / "covey").glob(pattern)), pattern
    assert "rollout/fast/decode_kernel.c" in patterns  # the CPU decode kernel's source
