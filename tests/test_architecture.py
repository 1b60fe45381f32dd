"""The package's import graph points one way (docs/architecture.md): each module imports only its own
layer and the layers below it, and no set of modules imports itself in a circle. Imports inside
functions count: a lazy import is still a dependency, only a later one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "toolkit"

# Lowest first; a module imports only modules of its own layer or of the layers before it.
LAYERS = [
    ("leaves", ["errors", "hardware", "console", "cache"]),
    ("layout", ["layout"]),
    ("config", ["config"]),
    ("model", ["model"]),
    ("data", ["data"]),
    ("planner", ["planner"]),
    ("objectives", ["objectives"]),
    ("parallel", ["parallel"]),
    ("train", ["train"]),
    ("command line", ["cli", "__main__"]),
]


def modules() -> dict[str, Path]:
    """'toolkit.parallel.tp.plan' -> its file, for every module of the package."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = ["toolkit", *f.relative_to(PACKAGE).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The toolkit modules `path` imports, anywhere in the file. `from a.b import c` is a.b.c when c
    is a module, else a.b; a package's own __init__ run on the way is not counted."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("toolkit"))
    return found


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to docs/architecture.md")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {d for d in imports(f, known) if d != m} for m, f in known.items()}


def test_every_module_has_a_layer_and_imports_only_downward():
    upward = [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
              for m, deps in sorted(graph().items()) for d in sorted(deps) if layer(d) > layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    g = graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, circles


@pytest.mark.parametrize("lower, upper", [("parallel", "train"), ("layout", "torch")])
def test_named_boundaries(lower, upper):
    """The two the issue names: parallel/ never imports train/; the layout rules never import torch."""
    for f in (PACKAGE / lower).rglob("*.py"):
        tree = ast.parse(f.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        bad = [n for n in names if n == upper or n.startswith((f"toolkit.{upper}", f"{upper}."))]
        assert not bad, f"{f.relative_to(PACKAGE)} imports {bad}"


# What wraps or reshapes a model (docs/architecture.md, "The one parallelize path"): DDP, accelerate's `prepare`,
# FSDP2's `fully_shard`, torch.compile on a module or a block, the activation-checkpoint wrapper
WRAPPING = {"DistributedDataParallel", "DDP", "fully_shard", "checkpoint_wrapper", "apply_activation_checkpointing",
            "gradient_checkpointing_enable", "activation_checkpointing_enable"}
# torch.compile of a function, not of a model or a block: kernels, and sampling's one-token decode step (a
# function of the model as parallelize left it and a static cache, as generate compiles it; nothing is wrapped)
KERNELS = {("attention.py", "_compiled_on"), ("loss.py", "compiled_softmax_grad"), ("sampling.py", "__init__")}


def wrapping_calls(path: Path) -> list[tuple[str, int, str]]:
    """(the enclosing function, line, what) of every call in `path` that wraps or compiles a model."""
    source = path.read_text()
    found, stack = [], []

    class Visit(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            stack.append(node.name)
            self.generic_visit(node)
            stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            receiver = ast.get_source_segment(source, f.value) if isinstance(f, ast.Attribute) else ""
            what = (name if name in WRAPPING else
                    f"{receiver}.{name}" if name in ("prepare", "prepare_model") and receiver.endswith("accelerator")
                    else f"{receiver}.compile" if name == "compile" and receiver != "re" else None)
            if what:
                found.append((stack[-1] if stack else "<module>", node.lineno, what))
            self.generic_visit(node)

    Visit().visit(ast.parse(source))
    return found


def test_only_parallelize_wraps_the_model():
    """DDP, accelerate's prepare, fully_shard, compile on a block and the checkpoint wrapper are called from
    parallel/parallelize.py and the apply_* helpers of parallel/ only: one place shapes the model."""
    elsewhere, seen = [], set()
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE)
        for function, line, what in wrapping_calls(f):
            seen.add(what.rsplit(".", 1)[-1])
            allowed = (str(rel) == "parallel/parallelize.py"
                       or (rel.parts[0] == "parallel" and function.startswith("apply_")))
            if not allowed and (rel.name, function) not in KERNELS:
                elsewhere.append(f"{rel}:{line} {function}: {what}")
    assert not elsewhere, "\n".join(elsewhere)
    # the search sees them (a rename would empty it): each is called where it belongs
    assert {"DistributedDataParallel", "fully_shard", "compile", "prepare", "activation_checkpointing_enable"} <= seen


# Where the command line becomes settings (`cli/plan.py`, and what builds from them: the model, the layout, the plan)
# and the one loop that runs them: the only modules that take the whole `Config`. The rest are passed the sections
# or values they read (issue 67: "Settings, not the config"), so a function's signature says what it depends on.
CONFIG_READERS = {"cli/plan.py", "model/load.py", "parallel/build.py", "planner/auto.py", "train/loop.py"}


def imports_config(path: Path) -> bool:
    """Whether `path` imports `toolkit.config.Config`, anywhere in the file: by name (aliased, relative or `*`) from
    the package or one of its modules (`toolkit.config.schema`, where it is defined), or the package itself
    (`import toolkit.config`, `from toolkit import config`) and then its `.Config`."""
    package = ["toolkit", *path.relative_to(PACKAGE).parts[:-1]]
    tree, as_module = ast.parse(path.read_text()), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = {a.name for a in node.names}
            if (module == "toolkit.config" or module.startswith("toolkit.config.")) and names & {"Config", "*"}:
                return True
            as_module |= module == "toolkit" and "config" in names
        elif isinstance(node, ast.Import):
            as_module |= any(a.name == "toolkit.config" or a.name.startswith("toolkit.config.") for a in node.names)
    return as_module and any(isinstance(n, ast.Attribute) and n.attr == "Config" for n in ast.walk(tree))


def test_only_the_command_line_and_the_loop_take_the_whole_config():
    # the config package defines `Config` and builds it: exempt
    found = {str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
             if f.relative_to(PACKAGE).parts[0] != "config" and imports_config(f)}
    extra = sorted(found - CONFIG_READERS)
    assert not extra, (f"{', '.join(extra)} import(s) toolkit.config.Config; pass the sections (DataConfig, "
                       "TrainConfig, ...), DataSettings or the values its functions read instead")
    assert found, "the search finds no import of Config at all (a rename would empty it)"


# --- the house as folders (docs/architecture.md): a handful of modules at the root, each objective's code under
# objectives/, no module too long to read, and a loop that asks the objective instead of naming one

OBJECTIVE_NAMES = {"sft", "dpo", "orpo", "simpo", "kto", "grpo"}
# where naming an objective is the point: the objectives themselves, and the config's table and checks of them
NAMES_OBJECTIVES = ("objectives/", "config/objectives.py", "config/checks.py")


def objective_comparisons(path: Path) -> list[str]:
    """`x == "dpo"`, `x in ("dpo", "orpo")` and the like in `path`: comparisons against an objective's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = [s for s in sides if isinstance(s, ast.Constant) and s.value in OBJECTIVE_NAMES]
        named += [s for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                  and any(isinstance(e, ast.Constant) and e.value in OBJECTIVE_NAMES for e in s.elts)]
        if named:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_root_holds_a_handful_of_modules():
    root = sorted(f.name for f in PACKAGE.glob("*.py"))
    assert len(root) <= 6, root


def test_every_objective_lives_under_objectives():
    words = ("grpo", "preference", "rewards", "rollout", "sampling")
    outside = [str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
               if f.relative_to(PACKAGE).parts[0] != "objectives" and any(w in f.stem for w in words)]
    assert not outside, outside


def test_no_module_is_over_700_lines():
    long = {str(f.relative_to(PACKAGE)): n for f in PACKAGE.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 700}
    assert not long, long


def test_the_loop_names_no_objective():
    """train/loop.py asks `strategy.objective` (`toolkit.objectives.base.Objective`): no objective's name, no
    probing what the batches or the objective can do, no flag for the objectives that sample."""
    loop = PACKAGE / "train" / "loop.py"
    tree = ast.parse(loop.read_text())
    names = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in OBJECTIVE_NAMES]
    probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id == "hasattr"]
    words = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))
             and (n.id if isinstance(n, ast.Name) else n.attr) in ("generates", "GENERATES", "PAIRED")]
    assert not names and not probes and not words, (names, probes, words)


def test_objective_names_are_compared_only_where_objectives_are_the_subject():
    found = [c for f in sorted(PACKAGE.rglob("*.py")) if not str(f.relative_to(PACKAGE)).startswith(NAMES_OBJECTIVES)
             for c in objective_comparisons(f)]
    assert len(found) <= 5, "\n".join(found)
    # the search sees them (a rename would empty it)
    assert objective_comparisons(PACKAGE / "objectives" / "build.py")


def test_no_line_of_the_package_names_an_issue_or_a_date():
    """History goes to git and measurements to benchmarks/*.md: "issue 57" or "2026-11-25" in a comment goes
    stale. A datasheet table may cite its source's date (`DATED`)."""
    # an upstream project's bug cited by its repository (pytorch/pytorch#124480) is a source, not our history
    pattern = re.compile(r"\bissues? \d+|\b20\d\d-\d\d(-\d\d)?\b|(?<![\w/-])#\d{2,}\b")
    found = [f"{f.relative_to(PACKAGE)}:{i}: {line.strip()[:80]}" for f in sorted(PACKAGE.rglob("*.py"))
             if f.relative_to(PACKAGE).as_posix() not in DATED
             for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


# data tables that cite a datasheet or a published config by its date; a task whose data are dates
DATED = {"data/builtin.py"}
