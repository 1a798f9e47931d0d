"""The package's shape, read from the source: no import cycles, imports pointing one way, Hydra only
in the launching process, every rule module run by `check`, every strategy complete.

docs/architecture.md draws the same map; when a test here fails, either the change or the map is wrong.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

import launcher
from launcher import rules
from launcher.components.objectives import Objective
from launcher.config.parallel import ALIASES, METHODS
from launcher.parallel.pipeline import PipelineRunner
from launcher.parallel.registry import STRATEGIES, strategy_module
from launcher.parallel.runner import ModelRunner, Runner
from launcher.parallel.strategy import Strategy
from launcher.plan.states import MODEL_STATES

ROOT = Path(launcher.__file__).parent

# Which top-level parts of the package each part may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "exits": set(),
    "config": set(),
    "components": {"config"},
    "spec": {"config"},
    "parallel": {"spec", "config", "components"},
    "plan": {"spec", "config", "components"},
    "rules": {"spec", "config", "components", "parallel", "plan"},
    "rank": {"spec", "config", "components", "parallel", "exits"},
    "launch": {"spec", "config", "components", "rank", "exits"},
    "tools": {"spec", "config", "components", "parallel", "exits"},
    "front": {"spec", "config", "components", "parallel", "plan", "rules", "launch", "exits"},
    "__main__": {"front"},
    "__init__": set(),
}
# Single modules allowed one import beyond their part's row: dry_run=simulate plays one rank of each role in the
# launching process on a fake process group (rank/simulate.py), as the inline backend plays a run's one rank here.
NARROW_ALLOWED: dict[str, set[str]] = {"launcher.front.simulation": {"launcher.rank.simulate"}}
# The only part that may import Hydra: the launching process. Ranks read spec.yaml with OmegaConf.
HYDRA_ALLOWED = {"front"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache  # the source does not change during a session; read-only to every caller
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.cache  # each file parsed once for the whole file's tests
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `path` imports, anywhere in the file (functions and TYPE_CHECKING blocks too)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return found


@functools.cache  # built once for the whole file (read-only to every caller)
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path, modules) if m in modules and m != name}
        for name, path in modules.items()
    }


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_imports_point_one_way() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _part(target) != _part(module)
        and _part(target) not in ALLOWED[_part(module)]
        and target not in NARROW_ALLOWED.get(module, set())
    ]
    assert not wrong, "imports against docs/architecture.md's map:\n" + "\n".join(wrong)


def test_hydra_is_imported_only_where_train_is_typed() -> None:
    modules = _modules()
    offenders = [
        f"{name} imports {imported}"
        for name, path in modules.items()
        for imported in sorted(_imports(path, modules))
        if imported.split(".")[0] in ("hydra", "hydra_plugins") and _part(name) not in HYDRA_ALLOWED
    ]
    assert not offenders, "Hydra outside launcher/front/:\n" + "\n".join(offenders)


def test_the_checker_finds_a_cycle_and_a_wrong_way_import() -> None:
    """The graph tests can fail: a made-up cycle is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _part("launcher.rank.engine") == "rank" and "front" not in ALLOWED["rank"]


def _rule_modules() -> list[str]:
    return sorted(
        p.stem for p in (ROOT / "rules").glob("*.py") if p.stem not in ("__init__", "hardware", "values")
    )


def test_check_runs_every_rules_module() -> None:
    run = {module.__name__.rsplit(".", 1)[-1] for module in rules.AREAS}
    missing = [name for name in _rule_modules() if name not in run]
    assert not missing, f"rules modules that rules.check never runs (add them to rules.AREAS): {missing}"


@pytest.mark.parametrize("area", rules.AREAS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_rule_function_is_in_its_modules_rules(area) -> None:
    def is_rule(fn: object) -> bool:
        return inspect.isfunction(fn) and list(inspect.signature(fn).parameters) == ["spec", "hw"]

    functions = [fn for name, fn in vars(area).items() if is_rule(fn) and fn.__module__ == area.__name__]
    missing = [fn.__name__ for fn in functions if fn not in area.RULES]
    assert not missing, f"{area.__name__}: rule functions not listed in RULES: {missing}"


def test_the_planner_has_formulas_for_every_strategy() -> None:
    assert set(MODEL_STATES) == set(STRATEGIES)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_offers_the_whole_protocol(name: str) -> None:
    module = strategy_module(name)
    assert callable(module.build) and callable(module.consolidate)
    built = typing.get_type_hints(module.build)["return"]
    verbs = [n for n, v in vars(Strategy).items() if callable(v) and not n.startswith("_")]
    attributes = list(typing.get_type_hints(Strategy))
    missing = [v for v in verbs if not callable(getattr(built, v, None))]
    assert not missing, f"{built.__name__} lacks {missing}"
    assert set(verbs) == {
        "no_sync",
        "backward",
        "step",
        "loss_scale",
        "state_bytes",
        "save",
        "load",
        "export_state_dict",
    }, "forward and backward of a micro batch belong to a runner, the loss to an objective"
    assert attributes == ["model", "optimizer"]


@pytest.mark.parametrize("runner", [ModelRunner, PipelineRunner])
def test_runners_ask_the_objective_and_strategies_know_none(runner: type) -> None:
    verbs = [n for n, v in vars(Runner).items() if callable(v) and not n.startswith("_")]
    assert set(verbs) == {"forward_backward", "eval_loss"}
    assert all(callable(getattr(runner, v, None)) for v in verbs)
    assert "objective" in inspect.signature(runner).parameters
    objective_verbs = {n for n, v in vars(Objective).items() if callable(v) and not n.startswith("_")}
    assert objective_verbs == {"loss_sum", "count", "metrics"}
    assert list(inspect.signature(Objective.loss_sum).parameters) == ["self", "outputs", "batch", "train"]
    for name in sorted({entry.module for entry in STRATEGIES.values()}):
        source = inspect.getsource(importlib.import_module(name))
        assert "objective" not in source.lower() and "distill" not in source.lower(), name


def test_strategy_names_are_compared_only_in_the_rules() -> None:
    """Elsewhere code asks a registry entry's capabilities, the config's data-parallel method, or the mesh degrees."""
    pattern = re.compile(r"(strategy|data_parallel) *(==|!=|in|not in) ")
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{number}"
        for path in sorted(ROOT.rglob("*.py"))
        if "rules" not in path.relative_to(ROOT).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "strategy-name comparisons outside launcher/rules/:\n" + "\n".join(offenders)


def test_every_strategy_names_a_data_parallel_method() -> None:
    """The methods' capabilities (what code outside the rules asks) cover every strategy, aliases resolved."""
    assert {ALIASES.get(name, name) for name in STRATEGIES} == set(METHODS)


def test_a_rank_decides_the_training_dtype_once() -> None:
    """launcher.rank.build works out the training dtype once and passes it down; no builder works it out again."""
    calls = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("rank", "parallel", "components")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "train_dtype(" in line
    ]
    outside = [c for c in calls if not c.startswith(("rank/build.py:", "components/precision.py:"))]
    assert not outside, "the training dtype worked out again, outside rank/build.py:\n" + "\n".join(outside)
    assert len([c for c in calls if c.startswith("rank/build.py:")]) == 1, calls


def _folder(module: str) -> str:
    """The package a module sits in (a package's __init__ sits in the package itself)."""
    path = _modules()[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _inner(module: str) -> str:
    """The folder of a module below its top-level part ("" for a module directly in the part)."""
    return ".".join(_folder(module).split(".")[2:])


# Inside a part, which of its sub-folders each sub-folder may import ("" = the part's own modules).
INNER_ALLOWED: dict[str, dict[str, set[str]]] = {
    "components": {
        "": {"data", "model", "loggers", "files", "rewards"},
        "data": {"model", "files"},
        "model": {"files"},
        "objectives": {"model"},
        "loggers": set(),
        "files": set(),
        "rewards": set(),
    },
}


def _back_up(graph: dict[str, set[str]], folder: typing.Callable[[str], str]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in sorted(targets)
        if folder(target) != "launcher" and folder(module).startswith(folder(target) + ".")
    ]


def test_no_import_reaches_back_up() -> None:
    """A module in a sub-folder never imports a module of a folder above it (those build on it)."""
    wrong = _back_up(_graph(), _folder)
    assert not wrong, "imports back up into a parent folder:\n" + "\n".join(wrong)


def test_sub_folders_import_one_way() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _part(module) in INNER_ALLOWED
        and _part(target) == _part(module)
        and _inner(target) != _inner(module)
        and _inner(target) not in INNER_ALLOWED[_part(module)][_inner(module)]
    ]
    assert not wrong, "imports between sub-folders against docs/architecture.md's map:\n" + "\n".join(wrong)


def test_every_sub_folder_is_in_the_map() -> None:
    for part, inner in INNER_ALLOWED.items():
        found = {_inner(m) for m in _modules() if _part(m) == part}
        assert found == set(inner), f"{part}: sub-folders {sorted(found)} vs the map's {sorted(inner)}"


def test_config_modules_define_a_schema_each() -> None:
    """Every module of launcher/config/ defines a config dataclass: schemas only, no runtime parts."""
    missing = [
        p.stem
        for p in (ROOT / "config").glob("*.py")
        if p.stem not in ("__init__", "aliases", "redact") and "Config" not in p.read_text()
    ]
    assert not missing, f"config modules without a schema: {missing}"
    heavy = [p.stem for p in (ROOT / "config").glob("*.py") if "import torch" in p.read_text()]
    assert not heavy, f"config modules importing torch: {heavy}"


def test_the_back_up_checker_finds_an_import_back_up() -> None:
    folders = {
        "launcher.components.data.loader": "launcher.components.data",
        "launcher.components.batching": "launcher.components",
    }
    graph = {
        "launcher.components.data.loader": {"launcher.components.batching"},
        "launcher.components.batching": set(),
    }
    assert _back_up(graph, folders.__getitem__) == [
        "launcher.components.data.loader imports launcher.components.batching"
    ]


def test_each_narrow_allowance_is_still_used() -> None:
    """An allowance beyond a part's row names an import that exists; one no longer needed is removed."""
    graph = _graph()
    unused = [
        f"{m} -> {t}"
        for m, targets in NARROW_ALLOWED.items()
        for t in targets
        if t not in graph.get(m, set())
    ]
    assert not unused, f"NARROW_ALLOWED names imports that no longer exist: {unused}"


def test_sweeps_and_the_closing_lines_name_no_backend() -> None:
    """Sweeps, their table and the closing lines ask the Backend protocols (launch.submitter, launch.job_state):
    no backend's name, no backend module, so a second scheduler forks none of them."""
    from launcher.launch import BACKENDS

    offenders = []
    for name in ("sweep", "sweep_status", "closing"):
        path = ROOT / "front" / f"{name}.py"
        text = path.read_text().lower()
        offenders += [f"{path.name} says {b!r}" for b in ("slurm", "sbatch", "squeue") if b in text]
        offenders += [
            f"{path.name} imports {m}" for m in _imports(path, _modules()) if m in BACKENDS.values()
        ]
        offenders += [
            f"{path.name} compares with {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and node.value in BACKENDS
        ]
    assert not offenders, "\n".join(offenders)


def test_every_backend_that_submits_offers_every_submit_verb() -> None:
    """A backend with any of the Submitter's verbs has them all (a half submitter would be launched, never collected)."""
    from launcher.launch import BACKENDS, SUBMITTER_NAMES, backend

    for name in BACKENDS:
        module = backend(name)
        found = [part for part in SUBMITTER_NAMES if hasattr(module, part)]
        assert found in ([], list(SUBMITTER_NAMES)), f"{name}: has {found} of {SUBMITTER_NAMES}"


def test_every_package_folder_ships_in_a_plain_install() -> None:
    """pyproject.toml lists the packages a plain (non-editable) install copies: a folder missing there imports
    from a checkout and fails from a wheel (tests/integration/test_cli.py installs one; this says which folder)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {".".join(path.parent.relative_to(ROOT.parent).parts) for path in ROOT.rglob("__init__.py")}
    assert folders - listed == set(), (
        f"add {sorted(folders - listed)} to pyproject.toml's [tool.setuptools] packages"
    )
