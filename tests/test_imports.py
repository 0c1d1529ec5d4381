"""The import graph of `studio/`, read with `ast` (imports inside functions included): no module imports itself
through others, and every import runs downhill through the layers docs/README.md draws."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

STUDIO = Path(__file__).resolve().parent.parent / "studio"

# each top-level part of studio/ and its layer: a module imports only from its own layer or lower ones
LAYERS = {
    "errors": 0, "files": 0, "interrupts": 0, "presets": 0, "events": 0,
    "engine": 1,
    "viz": 2, "traces": 3,
    "run": 4,
    "serve": 5, "train": 5, "tui": 5, "web": 5, "evaluation": 5,
    "cli": 6, "commands": 6, "__main__": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in STUDIO.rglob("*.py"):
        parts = list(path.relative_to(STUDIO.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the studio modules it imports (`from package import module` names the module, not the package)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else known(base))
        graph[name] = {t for t in targets if t and t.startswith("studio") and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__main__"


def test_the_walker_finds_a_circle_and_every_module():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "studio.engine.engine" in graph["studio.run.session"]                   # a top-level import
    assert "studio.run.config" in graph["studio.evaluation.lm_eval_model"]          # one inside a function
    assert "studio.engine.strategies.drafting" in graph["studio.engine.strategies.isd"]   # from package import module


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_every_part_of_studio_has_a_layer():
    assert {_part(m) for m in import_graph()} <= set(LAYERS)


@pytest.mark.parametrize("part", sorted(LAYERS))
def test_imports_run_downhill(part):
    uphill = sorted(f"{m} -> {t}" for m, targets in import_graph().items() if _part(m) == part
                    for t in targets if LAYERS[_part(t)] > LAYERS[part])
    assert uphill == []


def test_the_command_line_starts_without_torch():
    """The function-local imports of cli.py and run/config.py are there for this: `--help`, argument errors and
    `trace` commands answer before torch (about 2 s to import) is loaded."""
    probe = "import sys, studio.cli, studio.run.config, studio.run.options; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
