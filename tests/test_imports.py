"""The project's imports run one way. Read from the source (every `import`, also those inside
functions), not by importing it: grpo.py and retriever.py import no project file; agent.py imports
neither entry point (only grpo and its cache speedup, tools/kv_cache.py, which imports nothing);
tools/runs.py imports no project file and tools/models.py only runs; the five
files import nothing from toy/ but train.py's recipe; and the whole graph has no cycle."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("", "bench", "data", "tools", "toy")  # every project module (tests aside)


def module_files() -> dict:
    """{dotted name: path} of the project's modules."""
    found = {}
    for folder in FOLDERS:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                stem = name[:-3]
                dotted = folder if stem == "__init__" else ".".join(p for p in (folder, stem) if p)
                found[dotted] = os.path.join(ROOT, folder, name)
    return found


def imported_names(path: str) -> set:
    """Every module name an import statement in `path` could mean: `from a import b` gives a and a.b."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict:
    """{module: sorted project modules it imports}. A script in a folder imports its siblings by bare
    name (its folder is on its path after the root), so a bare name that is no root module is a sibling."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        folder = module.rsplit(".", 1)[0] if "." in module else ""
        deps = set()
        for name in imported_names(path):
            if name not in files and folder and f"{folder}.{name}" in files:
                name = f"{folder}.{name}"
            if name in files and name != module and name != folder:
                deps.add(name)
        # `from tools import runs` names the package too; it counts only when nothing of it is named
        graph[module] = sorted(d for d in deps if not any(e.startswith(d + ".") for e in deps))
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), i.e. the import circles."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_planted_circle_and_nothing_else():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"agent", "grpo", "retriever", "train", "evaluate", "tools.models", "tools.runs"} <= set(graph)
    assert cycles(graph) == []


@pytest.mark.parametrize("module, allowed", [
    ("grpo", set()),
    ("retriever", set()),
    ("agent", {"grpo", "tools.kv_cache"}),
    ("tools.kv_cache", set()),
    ("tools.runs", set()),
    ("tools.models", {"tools.runs"}),
    ("evaluate", {"agent", "retriever", "data.questions", "tools.models", "tools.runs", "tools.report"}),
    ("train", {"agent", "grpo", "retriever", "data.questions", "tools.models", "tools.runs", "toy.recipe"}),
])
def test_each_core_module_imports_only_what_sits_below_it(module, allowed):
    assert set(import_graph()[module]) <= allowed
