"""Shared test setup: ``gpu``-marked tests run only where hip-python reaches a GPU; the
others build their decoders without the kernel self-test."""

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


@pytest.fixture(autouse=True)
def _no_kernel_selftest_on_fakes(request, monkeypatch):
    """CPU tests fake or stub the runtime under their decoders, where a known-answer check
    would judge the fake (tests/test_selftest.py turns it on where it tests it). GPU
    tests build decoders as a user does: checked."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("HIPMLA_SELFTEST", "0")
