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
