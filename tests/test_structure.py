"""The package's import graph: one-way layers, no cycles, the runtime apart from the
converter; every module imports in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each module's layer: a module imports only from its own layer or those below,
# and never in a cycle. The runtime (layers 0-5) never imports the converter.
LAYERS = [
    [
        "__init__",
        "defaults",
        "distributed",
        "errors",
        "fast_blas",
        "files",
        "memory",
        "tables",
        "private",
        "one_row",
        "rows",
        "paths",
        "media",
        "images",
    ],  # the root imports its names lazily
    ["models"],
    ["draft_vocab", "history"],
    ["heads", "assistant", "loading"],
    [
        "sampling",
        "rejection",
        "grammar",
        "processors",
        "cache",
        "kv_cache",
        "draft_length",
        "lookup",
        "options",
        "stats",
    ],
    ["batch_cache", "batch_costs"],
    ["resolve", "round", "speculative"],
    ["batch", "session_files"],
    [
        "generate",
        "bench",
        "replies",
        "server_checks",
        "anthropic_api",
        "responses_api",
        "server",
        "serving",
        "prompts_file",
        "inventory",
    ],
    ["convert", "demo", "testing"],
    ["cli", "_entry", "__main__"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules():
    """``{dotted name: path}`` of every module of mlx_mtp and of the converter
    (installed as ``mlx_mtp.convert``)."""
    found = {}
    for path in sorted((ROOT / "mlx_mtp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__") or "mlx_mtp"] = path
    for path in sorted((ROOT / "convert").rglob("*.py")):
        parts = ("mlx_mtp",) + path.relative_to(ROOT).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__")] = path
    return found


def imports(name: str, path: Path):
    """The mlx_mtp modules that ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.startswith("mlx_mtp")}
    return out


def component(name: str) -> str:
    """The layer component of a module: its first name inside mlx_mtp."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph():
    mods = modules()
    edges = {}
    for name, path in mods.items():
        targets = set()
        for t in imports(name, path):
            while t and t not in mods:  # an attribute: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                targets.add(t)
        edges[name] = targets
    return edges


def test_layers_are_one_way():
    bad = []
    for name, targets in graph().items():
        for t in targets:
            if LAYER[component(t)] > LAYER[component(name)]:
                bad.append(f"{name} -> {t}")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    edges = graph()
    state = {}

    def visit(node, path):
        state[node] = "open"
        for t in sorted(edges[node]):
            if state.get(t) == "open":
                cycle = path[path.index(t) :] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t, path + [t])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_runtime_never_imports_the_converter():
    edges = graph()
    runtime = [n for n in edges if LAYER[component(n)] <= LAYER["bench"]]
    for name in runtime:
        assert not any(t.startswith("mlx_mtp.convert") for t in edges[name]), name


ALONE = """
import importlib, sys
names = sys.argv[1:]
for name in names:  # third-party libraries load once, here
    importlib.import_module(name)
failed = []
for name in names:  # then each project module alone, none of ours loaded before it
    for loaded in [m for m in sys.modules if m.split(".")[0] == "mlx_mtp"]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    """Each module imports with none of the project's loaded before it (an import that
    works only after another's fails), in one interpreter: the project's modules are
    dropped from ``sys.modules`` between imports, third-party libraries are not."""
    names = [n for n in modules() if not n.endswith("__main__")]
    proc = subprocess.run(
        [sys.executable, "-c", ALONE, *names], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_nothing_called_convert_is_importable_from_site_packages(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; print(u.find_spec('convert'))",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository, whose convert/ folder is on the path
    )
    assert proc.stdout.strip() == "None", proc.stdout


def test_every_family_module_has_the_interface():
    """Every registered model type loads its module's ``FAMILY`` (its public names
    checked by `Family.from_module`); a module without one is refused."""
    import types

    from mlx_mtp.models import FAMILIES, get_family
    from mlx_mtp.models.family import Family, Layout

    for name in FAMILIES:
        family = get_family({"model_type": name})
        assert isinstance(family.LAYOUT, Layout) and family.name == name
    broken = types.ModuleType("mlx_mtp.models.broken")
    broken.LAYOUT = get_family({"model_type": "mimo"}).LAYOUT
    with pytest.raises(TypeError, match="defines no FAMILY"):
        Family.from_module(broken)


def test_lines_fit_88_columns():
    """black's line length, for what black does not wrap (docstrings, comments)."""
    paths = [*ROOT.glob("mlx_mtp/**/*.py"), *ROOT.glob("convert/**/*.py")]
    paths += [*ROOT.glob("tests/**/*.py"), *ROOT.glob("scripts/**/*.py")]
    long = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in paths
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > 88
    ]
    assert not long, "lines over 88 columns:\n" + "\n".join(long)


def test_only_families_name_their_cache_types():
    """A family's own cache module (``mlx_mtp.models.*_cache``) is imported by its
    family's modules only: every other module reaches its caches through the cache
    protocol (`mlx_mtp.cache`), so a new cache type touches its family alone."""
    bad = [
        f"{name} -> {t}"
        for name, targets in graph().items()
        if not name.startswith("mlx_mtp.models")
        for t in targets
        if t.startswith("mlx_mtp.models.") and t.endswith("_cache")
    ]
    assert not bad, "\n".join(sorted(bad))
