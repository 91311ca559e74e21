"""`bench xent` without a GPU, and its case table."""

import subprocess
import sys

import pytest
import torch

from barqtrain_bench import xent


def test_cases_count_their_gemms():
    for case in xent.CASES:
        gemms = 3 if case.trainable_head else 2
        assert case.flops == gemms * 2.0 * case.tokens * case.hidden * case.vocab
    assert any(c.tokens == 8192 and c.hidden == 4096 and c.vocab == 128256 and c.trainable_head for c in xent.CASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "barqtrain.cli", "bench", "xent", "--out", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert result.returncode == 2  # nothing measured is a failure
    assert "needs a CUDA GPU" in result.stderr
    assert not any(tmp_path.iterdir())
