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
    rules                        the table of refused settings (read by config and train)
    config_fields                the run's settings and what follows from them alone (read by rules)
    core | errors | sources | trl_fields | config_values   the maths (nothing of covey), and leaves
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src" / "covey"

# each part of covey, and the parts it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(), "sources": set(), "trl_fields": {"errors"}, "rules": {"errors", "config_fields"},
    "config_fields": {"core", "sources"},  # the fields alone: their choices are the core's names
    "core": set(),  # the maths import nothing of covey
    "config_values": {"errors"},
    "vision": {"errors"},  # pictures in rows and prompts, vision-language models: what data and models stand on
    "config": {"errors", "sources", "trl_fields", "rules", "config_values", "config_fields"},
    "data": {"vision", "errors", "sources"},
    "models": {"vision", "errors", "sources"},
    "rewards": {"vision", "errors", "sources", "data"},  # rewards know no trainer
    "rollout": {"vision", "errors", "core", "models"},  # engines know no rewards and no run config
    "telemetry": {"vision", "errors", "data", "config"},  # telemetry knows no loop
    "agents": {"vision", "errors", "sources", "data", "rewards"},  # tools, environments, episodes: no engine, no trainer
    "train": {"vision", "errors", "sources", "trl_fields", "rules", "plan", "core", "config", "data", "models", "rewards", "rollout", "telemetry", "agents"},
    "verify": {"vision", "errors", "sources", "rules", "plan", "core", "config", "data", "models", "rewards", "rollout", "telemetry", "agents",
               "train"},
    "plan": {"vision", "errors", "sources", "core", "config", "data", "models", "rollout"},  # a model's config and tokenizer, the data's prompts, never the weights
    "cli": {"vision", "errors", "sources", "trl_fields", "rules", "core", "config", "data", "models", "rewards", "rollout", "telemetry",
            "agents", "train", "verify", "plan", "__init__"},  # __init__: the package's __version__ (covey --version, env)
    "__init__": {"config", "errors", "rewards", "train", "verify"},  # the package itself: its public names (verify_trl, probe_rewards)
    "__main__": {"cli"},
}


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


def names_standing_as_any(root: Path = SOURCE) -> list[str]:
    """Module-level names bound to ``typing.Any`` (``GRPOTrainer = Any``): a class stood in for, an import dodged."""
    return sorted(f"{path.relative_to(root)}: {target.id}" for path in root.rglob("*.py")
                  for node in ast.parse(path.read_text()).body
                  if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Name | ast.Attribute)
                  and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "Any"
                  for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(target, ast.Name))


def test_no_name_stands_for_a_class_as_any(tmp_path):
    assert names_standing_as_any() == []
    (tmp_path / "rules.py").write_text("from typing import Any\n\nGRPOConfig = Any  # dodging an import\n")
    assert names_standing_as_any(tmp_path) == ["rules.py: GRPOConfig"]


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


# The modules no test file of the fast tier imports (nor a package it imports re-exports), each with the fast
# test that reaches it through the modules its file imports.
REACHED_THROUGH = {
    "covey.agents.environments": "tests/test_agents.py::test_an_environment_written_for_trl_runs_unchanged",
    "covey.config_values": "tests/test_config.py::test_yaml_values_are_typed_and_command_line_overrides_yaml",
    "covey.plan.report": "tests/test_plan.py::test_plan_reads_the_config_and_no_weights",
    "covey.rewards.sandbox_boot": "tests/test_sandbox.py::test_correct_wrong_and_broken_programs",
    "covey.rollout.weight_transfer": "tests/test_server.py::test_push_policy_makes_the_server_follow_the_trainer",
    "covey.sources": "tests/test_data.py::test_hub_dataset_ids_go_to_datasets_with_the_split",
    "covey.telemetry.environment": "tests/test_output_for_logs.py::test_version_and_env_for_a_bug_report",
    "covey.telemetry.finding": "tests/test_hacking.py::test_reward_rising_while_held_out_accuracy_falls",
    "covey.telemetry.trends": "tests/test_hacking.py::test_reward_rising_while_held_out_accuracy_falls",
    "covey.train.accelerator": "tests/test_trl_scripts.py::test_the_trainer_s_accelerator_answers_from_covey_s_process_group",
    "covey.train.between_steps": "tests/test_trainer.py::test_trains_writes_the_run_folder_and_saves_a_loadable_model",
    "covey.train.evaluation": "tests/test_trainer.py::test_held_out_evaluation_runs_under_the_training_settings",
    "covey.train.hub": "tests/test_lifecycle.py::test_a_failed_final_push_says_how_to_push_the_saved_model",
    "covey.train.run_checkpoints":
        "tests/test_checkpoint.py::test_a_checkpoint_path_alone_continues_its_own_run_despite_a_cut_off_log",
    "covey.train.run_state":
        "tests/test_checkpoint.py::test_a_checkpoint_path_alone_continues_its_own_run_despite_a_cut_off_log",
    "covey.train.sampler": "tests/test_trainer.py::test_trains_writes_the_run_folder_and_saves_a_loadable_model",
    "covey.train.vision_run": "tests/test_vision.py::test_what_cannot_take_pictures_is_refused_before_anything_loads",
    "covey.verify.trl_batch": "tests/test_verify_trl.py::test_a_clean_trl_pipeline_passes_every_stage",
    "covey.verify.trl_training": "tests/test_verify_trl.py::test_a_clean_trl_pipeline_passes_every_stage",
}
NEEDS_VLLM = {"covey.rollout.vllm_plugin", "covey.rollout.vllm_worker"}  # loaded by vLLM itself: tests/vllm


class _Imports(ast.NodeVisitor):
    """The modules a file imports, anywhere but in the functions ``left_out``."""

    def __init__(self, modules: set[str], left_out: set[str]):
        self.modules, self.left_out, self.found = modules, left_out, set()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name not in self.left_out:
            self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            self.found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in self.modules
                              else node.module for alias in node.names)


@functools.lru_cache(maxsize=None)
def exports_of(package: str) -> frozenset[str]:
    """The modules a package's __init__ imports (what it re-exports); none for a module."""
    path = module_names()[package]
    return frozenset(imports_of(path, package, set(module_names()))) if path.name == "__init__.py" else frozenset()


@functools.lru_cache(maxsize=None)
def imports_of_test_file(path: Path, modules: frozenset[str], left_out: frozenset[str] = frozenset(),
                         parents: bool = True) -> frozenset[str]:
    """The covey modules a test file imports, anywhere in it but in the test functions ``left_out``, with what
    the packages it names re-export (their __init__'s imports), covey.__main__ where it runs ``python -m covey``,
    and (``parents``) the packages above them, which run as they are imported."""
    visitor = _Imports(modules, left_out)
    visitor.visit(ast.parse(path.read_text()))
    found = visitor.found & modules
    if '"-m", "covey"' in path.read_text():
        found.add("covey.__main__")
    todo = list(found)
    while todo:
        for exported in exports_of(todo.pop()) - found:
            found.add(exported)
            todo.append(exported)
    if parents:
        found |= {".".join(name.split(".")[:i]) for name in found for i in range(1, name.count(".") + 1)}
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def functions_named_test(path: Path) -> frozenset[str]:
    functions = (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return frozenset(n.name for n in functions if n.name.startswith("test_"))


def slow_names(path: Path, slow: frozenset[str]) -> set[str]:
    """The test functions of a test file that tests/slow_tests.txt names, in any of their forms."""
    return {node_id.partition("::")[2].split("[")[0] for node_id in slow
            if node_id.partition("::")[0] == path.as_posix()}


def modules_the_fast_tier_misses(root: Path, slow: frozenset[str], reached_through: dict[str, str]) -> list[str]:
    """Each module of covey that no test file of the fast tier imports (outside its slow tests), unless
    ``reached_through`` names a fast test whose file's imports lead to it; and each entry of it that is wrong."""
    graph = import_graph()
    modules = frozenset(graph)
    imported: set[str] = set()
    for path in sorted((root / "tests").glob("test_*.py")):
        left_out = frozenset(slow_names(path.relative_to(root), slow))
        if functions_named_test(path) - left_out:
            imported |= imports_of_test_file(path, modules, left_out)
    missing = []
    for module in sorted(modules - imported - NEEDS_VLLM):
        node_id = reached_through.get(module)
        if node_id is None:
            missing.append(f"{module}: no fast test file imports it")
            continue
        path, _, test = node_id.partition("::")
        fast = (root / path).is_file() and test in functions_named_test(root / path) - slow_names(Path(path), slow)
        reached, todo = set(), list(imports_of_test_file(root / path, modules, parents=False)) if fast else []
        while todo:
            name = todo.pop()
            if name not in reached:
                reached.add(name)
                todo.extend(graph[name])
        if module not in reached:
            missing.append(f"{module}: {node_id} is not a fast test whose file's imports reach it")
    return missing


def test_the_fast_tier_reaches_every_module():
    """`make test-fast` leaves out the tests in tests/slow_tests.txt; every module of covey keeps a test file of
    the fast tier that imports it (or a named fast test that reaches it), so the fast tier still covers them all."""
    from tests.conftest import SLOW_TESTS

    root = Path(__file__).parent.parent
    assert modules_the_fast_tier_misses(root, SLOW_TESTS, REACHED_THROUGH) == []
    assert [path.name for path in sorted((root / "tests").glob("test_*.py"))  # and every test file keeps a fast test
            if not functions_named_test(path) - slow_names(path.relative_to(root), SLOW_TESTS)] == []
    # the check finds a module whose only test moved to the slow list, and a wrong entry
    probe_test = "tests/test_plan.py::test_the_probe_says_the_run_time_and_its_measured_peak_against_the_estimate"
    assert modules_the_fast_tier_misses(root, SLOW_TESTS | {probe_test}, REACHED_THROUGH) == [
        "covey.train.probe: no fast test file imports it"]
    unreached = "tests/test_core.py::test_token_logprobs_equal_log_softmax_gather_and_are_nonpositive"
    wrong = {**REACHED_THROUGH, "covey.train.hub": unreached}
    assert modules_the_fast_tier_misses(root, SLOW_TESTS, wrong) == [
        "covey.train.hub: tests/test_core.py::test_token_logprobs_equal_log_softmax_gather_and_are_nonpositive is not "
        "a fast test whose file's imports reach it"]
