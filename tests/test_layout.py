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
    assert {p.stem for p in (PACKAGE / "fork").glob("*.py")} == {
        "__init__",
        "install",
        "flags",
        "launch",
        "hooks",
        "replay",
        "cpu",
    }
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


TESTS = Path(__file__).resolve().parent
# calls that load a file (or a module by name) as code: what a test file must not point at another test file with
LOADERS = {"spec_from_file_location", "SourceFileLoader", "SourcelessFileLoader", "run_path", "run_module"}
LOADERS_BY_NAME = {"import_module", "__import__", "exec", "compile"}  # plain names only (not re.compile)


def _names_a_test_file(node) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "test_" in n.value for n in ast.walk(node))


def loads_of_test_files(root=TESTS) -> list:
    """[(file, line, what)] for each place a .py file under root loads a test file: `import test_x` / `from test_x
    import ...`, or a loader call (spec_from_file_location, SourceFileLoader, runpy.run_path / run_module,
    import_module, exec, ...) whose arguments mention "test_" anywhere (a path, a with_name(), an f-string part)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else []
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                loader = name in LOADERS or (isinstance(func, ast.Name) and name in LOADERS_BY_NAME)
                if loader and any(_names_a_test_file(a) for a in [*node.args, *(k.value for k in node.keywords)]):
                    found.append((where, node.lineno, name))
                continue
            else:
                continue
            found += [(where, node.lineno, f"import {n}") for n in names if n.split(".")[0].startswith("test_")]
    return sorted(found)


def test_no_test_file_loads_another_test_file(tmp_path):
    """Shared helpers live in conftest.py (fixtures) or a helper module (fork_helpers.py, smoke_helpers.py), never
    in a test file another one loads by path: a test module executed twice has two copies of its fixtures and
    state. The check itself first, on scratch files: each way of loading a test file is found, helpers are not."""
    (tmp_path / "test_a.py").write_text(
        "import importlib.util, runpy\nfrom pathlib import Path\n"
        'spec = importlib.util.spec_from_file_location("b", Path(__file__).with_name("test_b.py"))\n'
        'runpy.run_path(str(Path(__file__).parent / "test_b.py"))\n'
        'loader = importlib.machinery.SourceFileLoader("b", f"{Path(__file__).parent}/test_b.py")\n'
        'exec(Path("tests/test_b.py").read_text())\n'
        "import test_b\nfrom test_b import parse\n"
    )
    (tmp_path / "test_ok.py").write_text(
        "import importlib.util, re, runpy\nfrom pathlib import Path\nfrom fork_helpers import parse\n"
        'spec = importlib.util.spec_from_file_location("fork_shims", Path(__file__).with_name("fork_shims.py"))\n'
        'runpy.run_module("openrlhf.cli.train_ppo_ray")\nre.compile("test_")\n'
    )
    assert [(line, what) for _, line, what in loads_of_test_files(tmp_path)] == [
        (3, "spec_from_file_location"),
        (4, "run_path"),
        (5, "SourceFileLoader"),
        (6, "exec"),
        (7, "import test_b"),
        (8, "import test_b"),
    ]
    assert len(list(TESTS.glob("test_*.py"))) > 30
    assert loads_of_test_files() == []


def test_after_parsing_the_geometry_settings_are_read_from_args_geometry_only():
    """The --salt.*, --geoalign.*, --baseline.* and --reward.noise.* flags become one GeometryConfig at parse time
    (`options.validate` -> `args.geometry`); past the two modules that validate them, no code reads the flags'
    namespace, so a setting has one spelling after parsing."""
    import re

    raw = re.compile(r"\bargs\.(salt|geoalign|baseline)\b|\bargs\.reward\.noise\b")
    parsers = {PACKAGE / "options.py", PACKAGE / "local" / "flags.py"}
    readers = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in parsers and path.parent.name != "eval"  # eval's commands have a --baseline of their own
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if raw.search(line)
    ]
    assert readers == []
    assert raw.search("if args.reward.noise.type == 'swap'") and not raw.search("args.geometry.noise.type")
