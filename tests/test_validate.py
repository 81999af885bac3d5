"""hipmla.validate: every check names the argument, what was expected and what came,
and lets good input through unchanged."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hipmla.validate import check_array, check_choice, check_finite, check_indptr, check_positive_finite


def test_check_array_accepts_and_returns_the_array():
    a = np.zeros((2, 3), np.float32)
    assert check_array(a, "a", dtype=np.float32, ndim=2, shape=(2, None)) is a
    assert check_array(a, "a", dtype=(np.float16, np.float32)) is a
    assert check_array(a[:, ::2], "a", contiguous=False).shape == (2, 2)
    assert check_array(a.astype(ml_dtypes.bfloat16), "a", dtype=ml_dtypes.bfloat16) is not None


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: check_array([1, 2], "kv"), TypeError, r"^kv: expected a numpy.ndarray, got list$"),
        (lambda: check_array(np.zeros(3, np.int64), "q", dtype=np.float32), TypeError,
         r"^q: expected dtype float32, got int64$"),
        (lambda: check_array(np.zeros(3, np.int8), "idx", dtype=(np.int32, np.int64)), TypeError,
         r"^idx: expected dtype int32 or int64, got int8$"),
        (lambda: check_array(np.zeros((2, 3)), "out", ndim=3), ValueError,
         r"^out: expected 3 dimensions, got shape \(2, 3\)$"),
        (lambda: check_array(np.zeros((2, 3)), "out", shape=(2, 4)), ValueError,
         r"^out: expected shape \(2, 4\), got \(2, 3\) \(axis 1\)$"),
        (lambda: check_array(np.zeros((2, 3)), "out", shape=(None, 3, 1)), ValueError,
         r"^out: expected 3 dimensions"),
        (lambda: check_array(np.zeros((4, 4))[:, ::2], "buf"), ValueError, r"^buf: expected a C-contiguous"),
    ],
)
def test_check_array_errors(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_check_array_shape_message_shows_wildcards():
    with pytest.raises(ValueError, match=r"^lse: expected shape \(\*, 16\), got \(4, 8\) \(axis 1\)$"):
        check_array(np.zeros((4, 8)), "lse", shape=(None, 16))


def test_check_finite():
    check_finite(np.ones(4, np.float32), "x")
    check_finite(np.array([1, 2]), "x")  # integers are always finite
    for dtype in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16):
        a = np.zeros((2, 3), dtype)
        a[1, 2] = np.inf
        with pytest.raises(ValueError, match=r"^kv: NaN or Inf at index \(1, 2\)"):
            check_finite(a, "kv")
        a[0, 1] = np.nan
        with pytest.raises(ValueError, match=r"^kv: NaN or Inf at index \(0, 1\)"):  # the first one
            check_finite(a, "kv")


def test_check_indptr():
    good = np.array([0, 0, 5, 9], np.int32)
    assert check_indptr(good) is good
    assert check_indptr(good.astype(np.int64), total_rows=9) is not None
    cases = [
        (np.array([0], np.int32), {}, ValueError, r"^kv_indptr: expected batch \+ 1 >= 2 entries, got 1$"),
        (np.array([2, 5], np.int32), {}, ValueError, r"^kv_indptr: must start at 0, got 2$"),
        (np.array([0, 5, 4, 6], np.int32), {}, ValueError,
         r"^kv_indptr: must be non-decreasing, kv_indptr\[2\] = 4 < kv_indptr\[1\] = 5$"),
        (good, {"total_rows": 8}, ValueError, r"^kv_indptr: last entry 9 exceeds the 8 rows"),
        (good.astype(np.float32), {}, TypeError, r"^kv_indptr: expected dtype int32 or int64, got float32$"),
        (good.reshape(2, 2), {}, ValueError, r"^kv_indptr: expected 1 dimensions"),
        ([0, 1], {}, TypeError, r"^kv_indptr: expected a numpy.ndarray"),
    ]
    for arr, kwargs, exc, message in cases:
        with pytest.raises(exc, match=message):
            check_indptr(arr, **kwargs)
    with pytest.raises(ValueError, match=r"^page_indptr: must start at 0"):
        check_indptr(np.array([1, 2], np.int32), "page_indptr")


def test_check_positive_finite():
    assert check_positive_finite(0.5, "sm_scale") == 0.5
    assert check_positive_finite(np.float32(2), "sm_scale") == 2.0
    assert isinstance(check_positive_finite(3, "sm_scale"), float)
    assert check_positive_finite(np.int64(3), "sm_scale") == 3.0
    assert check_positive_finite(np.array(0.25), "sm_scale") == 0.25  # a 0-d array (or tensor) is a number
    for bad in (0, -1.0, float("nan"), float("inf"), -float("inf"), 10**400, np.float64("nan")):
        with pytest.raises(ValueError, match=r"^sm_scale: expected a finite number > 0, got"):
            check_positive_finite(bad, "sm_scale")
    # text float() would parse is no number; nor is a bool or a complex
    for bad in (None, "abc", "0.5", b"0.5", [1.0], True, np.True_, 1 + 0j):
        with pytest.raises(TypeError, match=r"^sm_scale: expected a real number, got"):
            check_positive_finite(bad, "sm_scale")


def test_check_choice():
    assert check_choice("fp8", "format", ("bf16", "fp8")) == "fp8"
    with pytest.raises(ValueError, match=r"^format: expected one of 'bf16', 'fp8', got 'int4'$"):
        check_choice("int4", "format", ("bf16", "fp8"))
    with pytest.raises(ValueError, match=r"^format: .*got None$"):
        check_choice(None, "format", ("bf16", "fp8"))


def test_folder_arg_expands_the_home_folder_as_a_shell_would(monkeypatch, tmp_path):
    from hipmla.validate import folder_arg

    monkeypatch.setenv("HOME", str(tmp_path))
    assert folder_arg("~/out") == tmp_path / "out"
    assert str(folder_arg("rel/out")) == "rel/out"


def test_folder_arg_refuses_an_empty_folder_name():
    import argparse

    from hipmla.validate import folder_arg

    for text in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a folder"):
            folder_arg(text)
