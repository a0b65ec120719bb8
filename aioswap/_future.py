# cython: language_level=3, annotation_typing=False, binding=True
"""IOFuture: the future of one asynchronous request, and the only module that touches
:mod:`concurrent.futures`' internals.

Built by Cython from this source (``setup.py``): the engine finishes futures in the thread
that waits (``wait()``, ``result()``), often the main one, and compiled code runs no Python
bytecode there, so a signal handler that raises (KeyboardInterrupt) lands in the wait, never
half-way through a delivery. The source runs as plain Python too.

The engine (``aioswap._aio.Core``) is handed three functions of this module when a handle is
made (:data:`ENGINE`): :func:`new` makes a future for a request, :func:`finish` completes it,
:func:`detach` tells it that the handle no longer keeps its error. Nothing else reaches into a
future.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from aioswap import _aio
from aioswap._files import FileArg, describe

__all__ = ["ENGINE", "IOFuture", "detach", "finish", "new"]

_RUNNING = concurrent.futures._base.RUNNING
_FINISHED = concurrent.futures._base.FINISHED
_cond_lock = threading.Lock()       # making a future's Condition, or finishing it

# A thread that waits for an asynchronous result reaps and delivers it itself, looking at
# Python signals (KeyboardInterrupt) and at the state it waits for at least this often.
HELP_S = 0.01


def _lazy_list(name: str) -> Any:
    """A property over the list in attribute ``name`` (None until first read: then made)."""
    def get(self: Any) -> list[Any]:
        v: list[Any] | None = getattr(self, name)
        if v is None:
            v = []
            setattr(self, name, v)
        return v

    def put(self: Any, value: list[Any]) -> None:
        setattr(self, name, value)
    return property(get, put)


class IOFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The future of one asynchronous request; ``result()`` is the number of bytes moved.

    A real :class:`concurrent.futures.Future`: callbacks, ``wait``/``as_completed`` and
    ``asyncio.wrap_future`` work. ``op`` is ``"read"`` or ``"write"``, ``file`` the path,
    fd or :class:`AioFile`, ``nbytes`` and ``offset`` the request. A request is running
    from the moment it is submitted, so ``cancel()`` returns False.
    """

    # Future.__init__ makes a Condition per future; most futures of a burst are never
    # looked at (the caller uses wait()), so this one is made on first use, and a request
    # that ends before anybody used it just records its result (finish). Creating it and
    # that check happen under one lock, so a waiter always finds the result or is woken.

    # Future.__init__'s fields, as class defaults (see new()): an instance gets its own when
    # it finishes, or when a waiter or a callback is added
    _cond: threading.Condition | None = None
    _state = _RUNNING
    _result: Any = None
    _exception: BaseException | None = None
    _generation = 0             # the fork generation it was made in (0: the first process)
    _waiter_list: list[Any] | None = None
    _callback_list: list[Any] | None = None
    op: str
    file: FileArg
    nbytes: int
    offset: int

    def __init__(self, op: str, file: FileArg, nbytes: int, offset: int) -> None:
        # Future.__init__'s fields (RUNNING is what set_running_or_notify_cancel() does for
        # a future nobody else has seen yet: it cannot be cancelled), and the request's
        _fill(self, op, file, nbytes, offset, None)

    @property
    def _condition(self) -> threading.Condition:      # type: ignore[override]
        c = self._cond
        if c is None:
            with _cond_lock:
                c = self._cond
                if c is None:
                    c = self._cond = threading.Condition()
        return c

    # Future's lists, made on first use (a waiter or a callback added), each per future
    _waiters = _lazy_list("_waiter_list")
    _done_callbacks = _lazy_list("_callback_list")

    # the lane queue (requests in a lane's queue): its hurry() gets a thread blocked in
    # result() the request at once, and with its help() that thread reaps and delivers
    _queue: Any = None
    # the Core whose wait() would raise this future's error; told once result() or
    # exception() has handed it to the caller, so the handle keeps no delivered error
    _ledger: Any = None
    # the Core's wait() generation in which it finished (-1: unfinished, or forgotten)
    _wgen = -1

    def result(self, timeout: float | None = None) -> Any:
        if self._state == _FINISHED:
            # finished (its result set before its state, and never changed after): no
            # Condition to make and hold, as Future.result would for every future of a burst
            self._deliver()
            if self._exception is not None:
                raise self._exception
            return self._result
        return self._hurried(super().result, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == _FINISHED:
            self._deliver()
            return self._exception
        exc: BaseException | None = self._hurried(super().exception, timeout)
        return exc

    def done(self) -> bool:
        # a state read (Future.done would make this future's Condition to read it)
        return self._state == _FINISHED

    def _deliver(self) -> None:
        ledger = self._ledger
        if ledger is not None:
            self._ledger = None
            ledger.delivered(self)

    def _hurried(self, get: Any, timeout: float | None) -> Any:
        if self._state == _RUNNING and self._generation != _aio.fork_generation():
            raise RuntimeError(f"{self!r} belongs to the process that forked this one and "
                               f"cannot finish here; make a new AioHandle in the child")
        q = self._queue
        try:
            if q is None or self._state != _RUNNING:
                return get(timeout)
            # this thread reaps and delivers while it waits
            end = None if timeout is None else time.monotonic() + timeout
            while self._state == _RUNNING:
                left = HELP_S if end is None else min(HELP_S, end - time.monotonic())
                if left <= 0:
                    break
                if not q.help(left):
                    break                       # the lane's thread delivers the rest
            if end is not None:
                timeout = max(0.0, end - time.monotonic())
            if self._state != _RUNNING:
                return get(timeout)
            q.hurry(1)
            try:
                return get(timeout)
            finally:
                q.hurry(-1)
        finally:
            if self._state == _FINISHED:
                self._deliver()

    def __repr__(self) -> str:
        return (f"<IOFuture {self.op} {self.nbytes} bytes at {self.offset} of "
                f"{describe(self.file)} {self._state.lower()}>")


def _fill(fut: IOFuture, op: str, file: FileArg, nbytes: int, offset: int, queue: Any) -> None:
    # The class holds the defaults of Future.__init__'s fields (RUNNING, no result, no
    # Condition, no waiter or callback lists until one is added, fork generation 0), so a
    # future of a burst that nobody looks at costs these fields and no list (lists are
    # objects the cyclic garbage collector tracks: a burst of a thousand futures set off
    # full collections)
    gen = _aio.fork_generation()
    if gen:
        fut._generation = gen
    fut.op = op
    fut.file = file
    fut.nbytes = nbytes
    fut.offset = offset
    if queue is not None:
        fut._queue = queue


def new(op: str, file: FileArg, nbytes: int, offset: int, queue: Any) -> IOFuture:
    """The future of a request the engine queued on ``queue`` (an ``AioQueue``, or None)."""
    fut: IOFuture = IOFuture.__new__(IOFuture)
    _fill(fut, op, file, nbytes, offset, queue)
    return fut


def finish(fut: IOFuture, result: Any, error: BaseException | None, wgen: int,
           ledger: Any) -> None:
    """Complete ``fut`` with ``result`` or ``error``; ``wgen``: the wait() generation of the
    Core that counted it (-1: none), ``ledger``: that Core while it keeps ``error`` for
    wait() (None: nobody does)."""
    fut._wgen = wgen
    if ledger is not None:
        fut._ledger = ledger
    if fut._cond is None:
        with _cond_lock:
            if fut._cond is None:
                if error is None:
                    fut._result = result
                else:
                    fut._exception = error
                fut._state = _FINISHED
                return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def detach(fut: IOFuture, wgen: int) -> bool:
    """The Core no longer keeps ``fut``'s error; with ``wgen`` >= 0: also uncount it from
    wait() when it finished in that wait generation (returns whether it was)."""
    fut._ledger = None
    if wgen >= 0 and fut._wgen == wgen:
        fut._wgen = -1
        return True
    return False


#: What a Core is handed: how to make, finish and detach futures.
ENGINE = (IOFuture, new, finish, detach)
