"""Argument checks shared by every public function.

Each check raises before any work starts, with a message that names the argument,
says what was expected and what came.
"""

from __future__ import annotations

import argparse
import math
import numbers
from pathlib import Path
from typing import Sequence

import numpy as np

#: The largest value of the kernels' 32-bit integer fields.
INT32_MAX = int(np.iinfo(np.int32).max)
#: Most kv tokens a sequence may have (hip_src/common/config.h): the kernels count an item's
#: tokens and tiles in int32, and below 2^30 no such sum can wrap.
MAX_SEQ_TOKENS = 1 << 30


def format_shape(shape: Sequence[int | None]) -> str:
    """``(4, *, 576)``: ``None`` extents print as ``*``."""
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_array(
    arr,
    name: str,
    *,
    dtype=None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = True,
) -> np.ndarray:
    """Check a host array; ``None`` in ``shape`` matches any extent."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(arr).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if not any(arr.dtype == np.dtype(d) for d in allowed):
            want = " or ".join(str(np.dtype(d)) for d in allowed)
            raise TypeError(f"{name}: expected dtype {want}, got {arr.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, arr.shape)):
            if want is not None and want != got:
                raise ValueError(
                    f"{name}: expected shape {format_shape(shape)}, got {arr.shape} (axis {axis})"
                )
    if contiguous and not arr.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (strides {arr.strides})")
    return arr


def check_finite(arr: np.ndarray, name: str) -> None:
    """Quantizers reject NaN and Inf (no block scale can represent them faithfully) and, in
    wider input than float32, finite values beyond float32's range: the caches decode to
    float32, as the kernels compute."""
    if arr.dtype.kind == "f" or arr.dtype.name in ("bfloat16",):
        wide = arr.dtype.kind == "f" and arr.dtype.itemsize > 4
        finite = np.isfinite(arr if wide else arr.astype(np.float32, copy=False))
        if not finite.all():
            idx = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise ValueError(f"{name}: NaN or Inf at index {idx}; quantizers need finite input")
        if wide:
            big = np.abs(arr) > float(np.finfo(np.float32).max)
            if big.any():
                idx = tuple(int(i) for i in np.argwhere(big)[0])
                raise ValueError(f"{name}: {float(arr[idx]):.6g} at index {idx} is beyond float32's range "
                                 f"(+-{float(np.finfo(np.float32).max):.6g}); the caches decode to float32")


def check_indptr(kv_indptr, name: str = "kv_indptr", total_rows: int | None = None) -> np.ndarray:
    """A host indptr: int32/int64, 1-D, >= 2 entries, starts at 0, non-decreasing."""
    arr = check_array(kv_indptr, name, dtype=(np.int32, np.int64), ndim=1, contiguous=False)
    if arr.shape[0] < 2:
        raise ValueError(f"{name}: expected batch + 1 >= 2 entries, got {arr.shape[0]}")
    if int(arr[0]) != 0:
        raise ValueError(f"{name}: must start at 0, got {int(arr[0])}")
    steps = np.diff(arr.astype(np.int64))
    if (steps < 0).any():
        b = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(
            f"{name}: must be non-decreasing, {name}[{b + 1}] = {int(arr[b + 1])} < "
            f"{name}[{b}] = {int(arr[b])}"
        )
    if total_rows is not None and int(arr[-1]) > total_rows:
        raise ValueError(
            f"{name}: last entry {int(arr[-1])} exceeds the {total_rows} rows of the KV cache"
        )
    return arr


def check_positive_finite(value, name: str) -> float:
    """A real number (what float() takes as one: an int, a float, a numpy or 0-d array scalar;
    not a bool, a complex, or text float() would parse) that is finite and > 0 as a float."""
    if isinstance(value, (bool, np.bool_, str, bytes, bytearray)) \
            or isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        v = math.inf
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}") from None
    if not np.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return v


def check_int(value, name: str, lo: int, hi: int | None = None) -> int:
    """An int (a numpy integer too, never a bool) in ``lo .. hi``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected an int {want}, got {int(value)}")
    return int(value)


def check_choice(value, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:  # never == on an array
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def folder_arg(text: str) -> Path:
    """argparse type of an output folder: ``~`` expanded as a shell would (``--out=~/x``
    reaches the program unexpanded), so every command's ``--out`` means the same place. An
    empty text is refused: ``Path("")`` would quietly be the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    return Path(text).expanduser()


def arch_list_arg(known: Sequence[str], *, allow_none: bool = False):
    """argparse type of ``--arch``: comma-separated targets, each one of ``known``, in order
    and once each; with ``allow_none`` the word ``none`` alone is the empty list."""
    extra = ", or none alone" if allow_none else ""

    def parse(text: str) -> list[str]:
        names = [a.strip() for a in text.split(",") if a.strip()]
        if allow_none and names == ["none"]:
            return []
        unknown = [a for a in names if a not in known]
        if not names or unknown:
            what = f"{unknown[0]!r} is not one of them" if unknown else f"got {text!r}"
            raise argparse.ArgumentTypeError(f"expected comma-separated targets among {', '.join(known)}{extra}; "
                                             f"{what}")
        return list(dict.fromkeys(names))

    return parse
