"""The product tree speaks of the product: no work periods, run or call names, or paths to
result logs in the code, the docs or the README (the history of the work lives in git and in
issue notes, the curated results in benchmarks/results/)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [REPO / "csrc", REPO / "python" / "barqtrain", REPO / "python" / "barqtrain_bench", REPO / "docs", REPO / "README.md"]
TEXT_SUFFIXES = {".py", ".cu", ".cuh", ".h", ".hpp", ".cpp", ".cc", ".md", ".txt", ".cmake", ".toml", ".yaml"}
HISTORY = re.compile(r"session [0-9]|\bcall[0-9]|benchmarks/results/20[0-9][0-9]", re.IGNORECASE)


def product_files() -> list[Path]:
    files = []
    for root in PRODUCT:
        candidates = [root] if root.is_file() else root.rglob("*")
        files += [path for path in candidates if path.is_file() and path.suffix in TEXT_SUFFIXES]
    return sorted(files)


def test_the_product_tree_names_no_sessions_calls_or_result_logs():
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}"
        for path in product_files()
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert product_files(), "no product files found: the test looks in the wrong place"
    assert not found, "history in the product tree (say what and why, not when):\n" + "\n".join(found)


def _imported_modules(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_lora_functions_do_not_import_the_patching_above_them():
    # Layers, lowest first: lora's autograd functions, then patch (which routes PEFT's layers
    # through them, and holds get_peft_model). An import the other way makes a cycle.
    sources = sorted((REPO / "python" / "barqtrain" / "lora").glob("*.py"))
    assert sources
    upward = {str(path.relative_to(REPO)): sorted(m for m in _imported_modules(path) if m.startswith("barqtrain.patch"))
              for path in sources}  # fmt: skip
    assert not any(upward.values()), upward


MEASURING_PACKAGE = "barqtrain_bench"
MODULE_PATH = re.compile(rf"{MEASURING_PACKAGE}(\.\w+)*")


def _names_of_the_measuring_package(path: Path) -> set[str]:
    """What a module imports of the measuring package: import statements, and strings that are
    its module paths (importlib.import_module, __import__, `python -m`)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    imported = {name for name in _imported_modules(path) if name.split(".")[0] == MEASURING_PACKAGE}
    return imported | {text for text in strings if MODULE_PATH.fullmatch(text)}


def test_the_product_never_imports_the_measuring_package():
    # barqtrain_bench imports barqtrain, never the other way: `barqtrain bench` reaches it through the
    # "barqtrain.commands" entry point (pyproject.toml), which barqtrain.cli loads without naming it.
    sources = sorted((REPO / "python" / "barqtrain").rglob("*.py"))
    assert sources
    found = {str(path.relative_to(REPO)): sorted(_names_of_the_measuring_package(path)) for path in sources}
    assert not any(found.values()), {path: names for path, names in found.items() if names}


def test_the_command_line_loads_the_measuring_package_only_through_its_entry_point():
    # Importing barqtrain and its command line loads nothing of barqtrain_bench; building the parser
    # loads the entry points' modules, barqtrain_bench.command and the suites it names.
    import barqtrain

    code = (
        "import json, sys, barqtrain, barqtrain.cli\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.split('.')[0] == 'barqtrain_bench')\n"
        "print(json.dumps(loaded()))\n"
        "barqtrain.cli.build_parser()\n"
        "print(json.dumps(loaded()))\n"
    )
    package_root = str(Path(barqtrain.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path}, check=True
    )
    after_import, after_parser = map(json.loads, completed.stdout.splitlines())
    assert after_import == []
    assert f"{MEASURING_PACKAGE}.command" in after_parser
