"""Shared test setup: ``gpu``-marked tests run only where hip-python reaches a GPU."""

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    from hipmla import runtime

    return runtime.available()


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items) or gpu_available():
        return
    skip = pytest.mark.skip(reason="no GPU reachable through hip-python (ROCm, or NVIDIA via the HIP-on-CUDA library)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
