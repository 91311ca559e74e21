"""`bench attn` without a GPU, and its case table."""

import subprocess
import sys

import pytest
import torch

from barqtrain_bench import attention


def test_cases_use_the_standard_flop_count():
    cases = attention._cases()
    spec_target = attention.AttentionCase(4, 4096, 32, 32, 128, causal=True)
    assert spec_target in cases
    assert spec_target.forward_flops == 4.0 * 4 * 32 * 4096 * 4096 * 128 / 2
    full = attention.AttentionCase(4, 4096, 32, 32, 128, causal=False)
    assert full.forward_flops == 2 * spec_target.forward_flops
    assert {c.head_dim for c in cases} == {64, 128} and {c.seq for c in cases} >= {1024, 16384}
    assert any(c.q_heads == 32 and c.kv_heads == 8 for c in cases)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "barqtrain.cli", "bench", "attn", "--out", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert result.returncode == 2  # nothing measured is a failure
    assert "needs a CUDA GPU" in result.stderr
    assert not any(tmp_path.iterdir())
