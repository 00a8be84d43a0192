"""The product's import structure, read from the source (ast, nothing imported):

- no file-level import circle, benchmarks/ and tools/ included (function-local imports count: a local
  import does not break a circle);
- packages import one way: pallas_kernels < the k3jax model library < sharding < serving < the entry
  points (k3jax.serve, generate, batch, eval, convert, info, plan, api, offline and the `k3jax` package's
  lazy attributes) < benchmarks/, tools/;
- no library file imports tests/, benchmarks/, tools/ or deploy/; benchmarks/ and tools/ import no test,
  tools/ no benchmark;
- no private name (`_x`) imported from another package (benchmarks/ and tools/ included);
- no environment variable read in library code but the multi-host launcher contract, K3JAX_API_KEY and
  XLA's own settings (configuration is typed fields: EngineArgs, CLI flags).
"""
from __future__ import annotations

import ast
import collections
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("pallas_kernels", "k3jax", "sharding", "serving")
ENTRY_POINTS = {"k3jax"} | {f"k3jax.{m}" for m in
                            ("serve", "generate", "batch", "eval", "convert", "info", "plan", "api", "offline")}
SCRIPTS = ("benchmarks", "tools")          # import the product, never the other way
LAYERS = {"pallas_kernels": 0, "k3jax": 1, "sharding": 2, "serving": 3, "benchmarks": 5, "tools": 5}
ENTRY_LAYER = 4

# (module, variable) pairs library code may read from the environment, and why
ALLOWED_ENV = {
    ("sharding.distributed", "K3JAX_COORDINATOR"),        # the multi-host launcher contract
    ("sharding.distributed", "K3JAX_NUM_PROCESSES"),
    ("sharding.distributed", "K3JAX_PROCESS_ID"),
    ("sharding.distributed", "K3JAX_DISTRIBUTED"),
    ("sharding.launch", "K3JAX_LOCAL_DEVICE_IDS"),
    ("k3jax.serve", "K3JAX_API_KEY"),                     # a secret stays out of the command line
    ("serving.step_shapes", "XLA_FLAGS"),                      # XLA's own flags win over the step's compile options
    ("serving.executable_cache", "XLA_FLAGS"),            # a stored program is only valid under the flags it was built with
    ("serving.engine_args", "XLA_PYTHON_CLIENT_MEM_FRACTION"),   # claim_device_memory: the user's value wins
}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _files(packages) -> dict:
    out = {}
    for pkg in packages:
        for d, _, names in os.walk(os.path.join(ROOT, pkg)):
            for n in names:
                if n.endswith(".py"):
                    out[_module_name(os.path.join(d, n))] = os.path.join(d, n)
    return out


FILES = _files(PACKAGES + SCRIPTS)
TREES = {m: ast.parse(open(p).read(), p) for m, p in FILES.items()}


def _outside(folders) -> set:
    """Top-level names an import of these folders' files can take: the folders, and their files' bare
    module names (an import through a sys.path edit)."""
    return {os.path.splitext(n)[0] for d in folders for _, _, names in os.walk(os.path.join(ROOT, d))
            for n in names if n.endswith(".py") and n != "__init__.py"} | set(folders)


# per top-level folder, the folders its files must never import
NEVER = {**{pkg: _outside(("tests",) + SCRIPTS + ("deploy",)) for pkg in PACKAGES},
         "benchmarks": _outside(("tests", "deploy")), "tools": _outside(("tests", "benchmarks", "deploy"))}

Import = collections.namedtuple("Import", "source target name line")


def _resolve(name: str):
    """The product module a dotted name lives in (the longest prefix that is one), else None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FILES:
            return ".".join(parts[:i])
    return None


def _imported_names(module: str, tree) -> list:
    """(dotted name, line) of every import in the file, function-local ones included."""
    out = []
    is_pkg = FILES[module].endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _imports() -> list:
    out = []
    for m, tree in TREES.items():
        for name, line in _imported_names(m, tree):
            target = _resolve(name)
            if target is not None and target != m:
                out.append(Import(m, target, name, line))
    return out


IMPORTS = _imports()


def _layer(module: str) -> int:
    return ENTRY_LAYER if module in ENTRY_POINTS else LAYERS[module.split(".")[0]]


def _cycles(edges) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                comps.append(sorted(comp))

    for v in sorted(set(graph)):
        if v not in index:
            visit(v)
    return comps


def test_the_checks_see_the_product():
    assert len(FILES) > 100 and len(IMPORTS) > 300
    edges = {(i.source, i.target) for i in IMPORTS}
    assert ("serving.engine", "serving.runner") in edges and ("benchmarks.bench_kernels", "benchmarks.harness") in edges
    assert _cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]   # the finder finds one


def test_no_file_level_import_circle():
    assert _cycles({(i.source, i.target) for i in IMPORTS}) == []


def test_packages_import_one_way():
    wrong = [f"{i.source}:{i.line} imports {i.name}" for i in IMPORTS if _layer(i.target) > _layer(i.source)]
    assert wrong == [], "\n".join(wrong)


def test_model_library_imports_neither_serving_nor_sharding():
    wrong = [f"{i.source}:{i.line} imports {i.name}" for i in IMPORTS
             if _layer(i.source) == LAYERS["k3jax"] and i.target.split(".")[0] in ("serving", "sharding")]
    assert wrong == [], "\n".join(wrong)


def test_no_product_file_imports_tests_benchmarks_or_tools():
    wrong = [f"{m}:{line} imports {name}" for m, tree in TREES.items() for name, line in _imported_names(m, tree)
             if name.split(".")[0] in NEVER[m.split(".")[0]]
             and (_resolve(name) is None or _resolve(name).split(".")[0] in SCRIPTS)]
    assert wrong == [], "\n".join(wrong)


def test_no_private_name_imported_from_another_package():
    def package(module):
        return module if FILES[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
    wrong = {(i.source, i.name) for i in IMPORTS
             if i.name.rsplit(".", 1)[-1].startswith("_") and not i.name.rsplit(".", 1)[-1].startswith("__")
             and package(i.source) != package(i.target)}
    assert wrong == set()


def _env_reads(tree) -> list:
    """(variable, line) of every os.environ / os.getenv use in a parsed file; variable None when the use is
    not a read of one literal key (e.g. dict(os.environ))."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    os_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                if a.name == "os"}
    out = [(None, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
           and any(a.name in ("environ", "getenv") for a in n.names)]       # from os import environ: unchecked
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name) and node.value.id in os_names):
            continue
        use, key = parents.get(node), None
        if isinstance(use, ast.Attribute) and isinstance(parents.get(use), ast.Call):        # os.environ.get("X")
            args = parents[use].args
            key = args[0].value if args and isinstance(args[0], ast.Constant) else None
        elif isinstance(use, ast.Subscript) and isinstance(use.slice, ast.Constant):        # os.environ["X"]
            key = use.slice.value
        elif isinstance(use, ast.Call) and use.args and isinstance(use.args[0], ast.Constant):   # os.getenv("X")
            key = use.args[0].value
        out.append((key, node.lineno))
    return out


def test_configuration_is_not_read_from_the_environment():
    wrong = [f"{m}:{line} reads {key or 'the environment'}" for m, tree in TREES.items()
             if m.split(".")[0] in PACKAGES for key, line in _env_reads(tree) if (m, key) not in ALLOWED_ENV]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("source, expected", [
    ("import os\nos.environ.get('K3JAX_KERNELS')", ["K3JAX_KERNELS"]),
    ("import os\nx = os.environ['A']", ["A"]),
    ("import os\nos.getenv('B', '1')", ["B"]),
    ("import os\nos.environ.setdefault('C', '1')", ["C"]),
    ("import os\nenv = dict(os.environ)", [None]),
    ("import os as _os\n_os.environ.setdefault('D', '1')", ["D"]),
    ("from os import environ\nenviron.get('E')", [None]),
])
def test_the_environment_check_sees_reads(source, expected):
    assert [key for key, _ in _env_reads(ast.parse(source))] == expected
