"""The product tree speaks of the product: no work periods, run or call names, or paths to
result logs in the code, the docs or the README (the history of the work lives in git and in
issue notes, the curated results in benchmarks/results/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [REPO / "csrc", REPO / "python" / "barqtrain", REPO / "docs", REPO / "README.md"]
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
