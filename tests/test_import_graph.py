"""The import graph of moonep and moontrain, read from the source with ast: no module imports another
that imports it back, directly or through others, moonep imports nothing from moontrain, and moontrain
reaches moonep through its package only (`import moonep`, `from moonep import X` with X in moonep.__all__).
No two folders of moontrain import each other (a top-level module such as cli.py counts as its own folder):
the folders stack in floors, so each can be read knowing only those below it.

Every import counts, wherever it stands (module level, inside a function, under TYPE_CHECKING): a
lazy import still ties the two modules together. `import a.b.c` or `from a.b.c import x` also runs
the packages a and a.b first, so it is an edge to them as well, except to the importer's own parent
packages (they are already running when one of their modules is imported). `from a import x` reads
the package a itself when x is a name defined there, so that edge counts even for a module inside a;
`from a import b` with b a submodule imports a.b and reads nothing of a.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moonep", "moontrain")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that importing `name` runs or reads."""
    is_package = path.name == "__init__.py"
    parts = name.split(".")
    own_parents = {".".join(parts[:i]) for i in range(1, len(parts))} | ({name} if is_package else set())
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [(alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts if is_package else parts[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # the module itself is read for every name that is not one of its submodules
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            reads = any(sub not in modules for sub in submodules)
            targets = [(module, reads)] + [(sub, False) for sub in submodules]
        else:
            continue
        for target, read in targets:
            target_parts = target.split(".")
            for i in range(1, len(target_parts) + 1):
                candidate = ".".join(target_parts[:i])
                if candidate == name or candidate not in modules:
                    continue
                if candidate in own_parents and not (read and i == len(target_parts)):
                    continue
                out.add(candidate)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    components.append(sorted(component))
    return components


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle inside a strongly connected component, for the failure message."""
    members, start = set(component), component[0]
    trail, seen, node = [start], {start}, start
    while True:
        node = min(n for n in graph[node] if n in members)
        trail.append(node)
        if node in seen:
            return " -> ".join(trail[trail.index(node):])
        seen.add(node)


def test_no_import_cycles() -> None:
    graph = _graph()
    assert len(graph) > 50 and "moontrain.trainer.trainer" in graph and "moonep.buffer" in graph
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_path(graph, c) for c in cycles)


def _folder(module: str) -> str | None:
    """The folder of moontrain a module belongs to (moontrain.model.experts.weights -> model, moontrain.cli ->
    cli); None outside moontrain's folders (the package moontrain itself, moonep)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "moontrain" and len(parts) > 1 else None


def mutual_folder_pairs(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(A, B) with A < B -> the module imports behind A -> B and B -> A, for every pair of moontrain's
    folders that import each other."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, targets in graph.items():
        for target in targets:
            a, b = _folder(name), _folder(target)
            if a is not None and b is not None and a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return {(a, b): sorted(found + edges[(b, a)]) for (a, b), found in edges.items() if a < b and (b, a) in edges}


def test_no_two_moontrain_folders_import_each_other() -> None:
    graph = _graph()
    folders = {_folder(name) for name in graph} - {None}
    assert {"model", "parallel", "optim", "trainer", "cli"} <= folders
    pairs = mutual_folder_pairs(graph)
    assert not pairs, "moontrain folders importing each other:\n" + "\n".join(
        f"{a} <-> {b}: " + ", ".join(imports) for (a, b), imports in sorted(pairs.items()))


def test_the_folder_check_finds_a_planted_pair() -> None:
    """Known answer: model and parallel import each other through different modules, cli.py (a folder of its
    own) and checkpoint too; one-way imports, imports inside a folder and the package root are no pair."""
    graph = {"moontrain.model.experts.weights": {"moontrain.parallel.collectives", "moontrain.model"},
             "moontrain.parallel.fsdp": {"moontrain.model.transformer", "moontrain.parallel"},
             "moontrain.checkpoint.export": {"moontrain.cli"}, "moontrain.cli": {"moontrain.checkpoint"},
             "moontrain.trainer.trainer": {"moontrain.model", "moontrain.cli"}, "moontrain": {"moontrain.cli"},
             "moontrain.model": set(), "moontrain.model.transformer": set(), "moontrain.parallel": set(),
             "moontrain.parallel.collectives": set(), "moontrain.checkpoint": set()}
    assert mutual_folder_pairs(graph) == {
        ("checkpoint", "cli"): ["moontrain.checkpoint.export -> moontrain.cli", "moontrain.cli -> moontrain.checkpoint"],
        ("model", "parallel"): ["moontrain.model.experts.weights -> moontrain.parallel.collectives",
                                "moontrain.parallel.fsdp -> moontrain.model.transformer"]}


def test_moonep_imports_nothing_from_moontrain() -> None:
    bad = {name: sorted(t for t in targets if t.split(".")[0] == "moontrain")
           for name, targets in _graph().items() if name.split(".")[0] == "moonep"}
    bad = {name: targets for name, targets in bad.items() if targets}
    assert not bad, f"moonep modules importing moontrain: {bad}"


def moonep_submodule_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """moontrain modules -> the moonep submodules they import (the package `moonep` itself is allowed)."""
    bad = {name: sorted(t for t in targets if t.startswith("moonep."))
           for name, targets in graph.items() if name.split(".")[0] == "moontrain"}
    return {name: targets for name, targets in bad.items() if targets}


def test_moontrain_imports_only_the_moonep_package() -> None:
    graph = _graph()
    assert any("moonep" in targets for name, targets in graph.items() if name.startswith("moontrain."))
    bad = moonep_submodule_imports(graph)
    assert not bad, f"moontrain modules importing moonep's submodules (export the name from moonep/__init__.py): {bad}"


def test_moontrain_uses_only_exported_names(tmp_path: Path) -> None:
    """Every `from moonep import X` in moontrain names something moonep/__init__.py exports, and a planted
    submodule import is caught both ways (`import moonep.x`, `from moonep import x` with x a module)."""
    tree = ast.parse((ROOT / "moonep" / "__init__.py").read_text())
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    used = {alias.name for path in (ROOT / "moontrain").rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
            and node.module == "moonep" and not node.level for alias in node.names}
    assert used and used <= set(exported), sorted(used - set(exported))
    (tmp_path / "a.py").write_text("import moonep.heap\n")
    (tmp_path / "b.py").write_text("def f():\n    from moonep import routing, Buffer\n")
    (tmp_path / "c.py").write_text("import moonep\nfrom moonep import Buffer\n")
    modules = {**_modules(), **{f"moontrain.{n}": tmp_path / f"{n}.py" for n in "abc"}}
    graph = {name: _imports(name, path, modules) for name, path in modules.items() if name.startswith("moontrain.")
             and name[-1] in "abc" and path.parent == tmp_path}
    assert moonep_submodule_imports(graph) == {"moontrain.a": ["moonep.heap"], "moontrain.b": ["moonep.routing"]}


def test_the_checker_finds_a_planted_cycle(tmp_path: Path) -> None:
    """The checker against a known answer: a -> b -> c -> a through a function-level import, a package
    whose __init__ imports its submodule (no cycle), and `from pkg import name` inside pkg (a cycle)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "p": {"p.x"}, "p.x": set(), "q": {"q.y"}, "q.y": {"q"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["q", "q.y"]]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from p.x import f\n")
    (tmp_path / "p" / "x.py").write_text("from p.y import g\nfrom p import y\ndef f():\n    from p import h\n")
    (tmp_path / "p" / "y.py").write_text("import os\n")
    modules = {"p": tmp_path / "p" / "__init__.py", "p.x": tmp_path / "p" / "x.py", "p.y": tmp_path / "p" / "y.py"}
    assert _imports("p", modules["p"], modules) == {"p.x"}
    assert _imports("p.x", modules["p.x"], modules) == {"p.y", "p"}  # p.y's parent p is running: no edge
    assert _imports("p.y", modules["p.y"], modules) == set()
