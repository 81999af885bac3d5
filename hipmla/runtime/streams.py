"""Streams and events: where work is ordered, and how long it took.

Functions that take a stream accept ``None`` (the null stream), a :class:`Stream`, or
the raw handle an embedding runtime has (:func:`_stream_handle` tells them apart).
"""

from __future__ import annotations

import os

from hipmla import runtime  # the process's runtime state: runtime.hip
from hipmla.runtime.library import _Owned, _ensure_runtime, check


def _stream_handle(stream):
    """None, a :class:`Stream` or a raw handle (int or hip-python object) -> raw."""
    if isinstance(stream, Stream):
        if stream.closed:
            raise ValueError("stream: this hipmla.runtime.Stream was closed (its handle is destroyed)")
        return stream.handle
    return stream


class Stream(_Owned):
    """A HIP stream. ``Stream()`` creates one; ``Stream.null()`` is the null stream.

    ``handle`` is what hip-python takes: a hip-python stream object, or 0 for the null
    stream. Functions that take a stream also accept such a raw handle directly, so an
    embedding runtime can pass its own stream without wrapping it.
    """

    closed = False  # set by close(): work enqueued on a destroyed handle would be lost or worse

    def __init__(self):
        _ensure_runtime()
        self.handle = check(runtime.hip.hipStreamCreate())
        self._owned = True
        self._owner_pid = os.getpid()

    @classmethod
    def null(cls) -> Stream:
        stream = cls.__new__(cls)
        stream.handle = 0
        stream._owned = False
        stream._owner_pid = os.getpid()
        return stream

    def synchronize(self) -> None:
        _ensure_runtime()
        check(runtime.hip.hipStreamSynchronize(self.handle))

    def close(self) -> None:
        if self._owned:
            self._owned = False
            self.closed = True
            check(runtime.hip.hipStreamDestroy(self.handle))

    def _live(self) -> bool:
        return getattr(self, "_owned", False)


class Event(_Owned):
    """A HIP event for timing work on a stream."""

    def __init__(self):
        _ensure_runtime()
        self.handle = check(runtime.hip.hipEventCreate())
        self._owner_pid = os.getpid()

    def record(self, stream=None) -> None:
        check(runtime.hip.hipEventRecord(self.handle, _stream_handle(stream)))

    def synchronize(self) -> None:
        check(runtime.hip.hipEventSynchronize(self.handle))

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; both must have completed."""
        if not isinstance(end, Event):
            raise TypeError(f"end: expected an Event, got {type(end).__name__}")
        return float(check(runtime.hip.hipEventElapsedTime(self.handle, end.handle)))

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            check(runtime.hip.hipEventDestroy(handle))

    def _live(self) -> bool:
        return getattr(self, "handle", None) is not None
