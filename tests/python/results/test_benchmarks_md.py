"""benchmarks/results/ holds curated results only, and BENCHMARKS.md and the README's headline table
are generated from them: every curated JSON names its GPU, date, commit and exact command, and
`python benchmarks/make_benchmarks_md.py --check` finds both outputs up to date."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "results"
SUITES = {"ops", "xent", "attn", "lora", "qlora", "data", "e2e", "scaling", "context"}
SEVERAL_PER_GPU = {"e2e", "scaling", "context"}  # <suite>-<workload or case>.json


def test_curated_results_name_gpu_date_commit_and_command():
    files = sorted(RESULTS.glob("*/*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert data["benchmark"] in SUITES, path
        name = path.stem.split("-", 1)[0] if data["benchmark"] in SEVERAL_PER_GPU else path.stem
        assert name == data["benchmark"], f"{path}: a {data['benchmark']} result under another suite's name"
        env = data["environment"]
        for key in ("device", "date", "git_commit", "command"):
            assert env.get(key) and env[key] != "unknown", f"{path}: environment.{key}"


def test_no_dated_run_folders():
    assert not [p.name for p in RESULTS.iterdir() if p.name[:2] == "20"]


def test_generated_tables_are_up_to_date():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_benchmarks_md.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
