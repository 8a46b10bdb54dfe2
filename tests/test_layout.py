"""The package's layout (docs/architecture.md §1): no module imports its importer, the fork is one package, `local/`
holds only the engine and its command line, and the experiments live in `lab/`."""

import ast
from pathlib import Path

import openrlhf_geo

PACKAGE = Path(openrlhf_geo.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root=PACKAGE) -> dict:
    """{module: modules of the package it imports}, every import statement counted (inside functions too: a lazy
    import still makes a cycle); `from pkg import name` counts pkg.name when that is a module, else pkg."""
    files = {module_name(p, root): p for p in root.rglob("*.py") if "patches" not in p.relative_to(root).parts}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                edges.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def cycles(graph) -> list:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_its_importer():
    graph = import_graph()
    assert len(graph) > 60 and "openrlhf_geo.lab.studies.runner" in graph
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check itself: two modules importing each other (one lazily, inside a function) are one cycle."""
    pkg = tmp_path / "openrlhf_geo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from openrlhf_geo.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("import openrlhf_geo.sub.a\n")
    assert cycles(import_graph(pkg)) == [["openrlhf_geo.sub.a", "openrlhf_geo.sub.b"]]


def test_the_fork_is_one_package_and_local_holds_only_the_engine_and_its_command_line():
    assert not list(PACKAGE.glob("fork*.py")) and not (PACKAGE / "cpu_fork.py").exists()
    assert {p.stem for p in (PACKAGE / "fork").glob("*.py")} == {"__init__", "install", "launch", "hooks", "cpu"}
    local = {p.stem for p in (PACKAGE / "local").glob("*.py")}
    assert local == {"__init__", "engine", "flags", "training", "reward", "rundir", "tracking", "kernels"}
    assert not (PACKAGE / "local" / "studies").exists()
    graph = import_graph()
    # the engine never reaches into the experiments
    assert not [(m, e) for m, edges in graph.items() for e in edges if ".local" in m and ".lab" in e]
    # the core (everything outside fork/, local/, lab/) imports neither engine nor experiments
    core = [
        m
        for m in graph
        if not any(f"openrlhf_geo.{p}" in m for p in ("fork", "local", "lab")) and m != "openrlhf_geo.cli"
    ]
    leaks = [(m, e) for m in core for e in graph[m] if any(f"openrlhf_geo.{p}" in e for p in ("local", "lab"))]
    assert leaks == []
