"""GPU tests are marked `gpu`: skipped without CUDA, failed instead when
BARQTRAIN_REQUIRE_GPU is set (scripts/gpu_check.sh), so nothing passes there by not running."""

import os

import pytest
import torch

_REQUIRE_GPU = os.environ.get("BARQTRAIN_REQUIRE_GPU") is not None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _REQUIRE_GPU and report.skipped and "gpu" in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped while BARQTRAIN_REQUIRE_GPU is set: {report.longrepr}"
