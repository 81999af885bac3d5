"""Shared test setup: ``gpu``-marked tests run only where hip-python reaches a GPU; the
others build their decoders without the kernel self-test."""

import functools
import os

# Under pytest-xdist each worker is a process with a BLAS (and torch) thread pool as wide as
# the machine: 14 workers on 16 cores start 14 such pools, whose threads spin against each
# other and the workers' element-wise numpy (on a 2-core host, two processes of the ragged
# tests' float64 products and casts ran 2.1x slower with 2 BLAS threads each than with 1).
# One thread a worker, set before numpy loads and reads it (pytest and xdist do not load
# numpy before this file; a variable already set is kept).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402


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
