"""`WeightsLock`: forwards share a model's weights, a change of their layout has them alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WeightsLock:
    """Shared by forward passes, exclusive for changes of the weights' layout (`Llama.pack_weights`).

    Forward passes in several threads run together. A layout change waits until the running ones
    have returned and holds new ones back meanwhile; when it is done, the forwards that waited for
    it go before the next change: neither a stream of forwards nor a stream of changes starves the
    other. A thread may take the lock again while it holds it (shared in shared, anything in
    exclusive); a layout change inside a forward of the same model is refused, as it could never
    get the lock. Deep copies and pickles of a model get a new lock (a model and its drafts copied
    together share theirs).
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._shared = 0                 # shared holds, by all threads
        self._owner: int | None = None   # the thread holding it exclusively
        self._exclusive = 0              # that thread's holds
        self._waiting_exclusive = 0      # threads waiting to hold it exclusively
        self._waiting_shared = 0         # threads waiting to hold it shared
        self._turn_of_shared = False     # set by an exclusive release: those waiting to share go first
        self._held = threading.local()   # .shared: this thread's shared holds

    def __reduce__(self):
        return (type(self), ())

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        held = self._held
        with self._condition:
            if not getattr(held, "shared", 0) and self._owner != threading.get_ident():
                self._waiting_shared += 1
                try:
                    while self._owner is not None or (self._waiting_exclusive and not self._turn_of_shared):
                        self._condition.wait()
                finally:  # (also when interrupted: a count left behind would block the others for good)
                    self._waiting_shared -= 1
                    if not self._waiting_shared:
                        self._turn_of_shared = False
                        self._condition.notify_all()
            held.shared = getattr(held, "shared", 0) + 1
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                held.shared -= 1
                self._shared -= 1
                if not self._shared:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._condition:
            if self._owner != me:
                if getattr(self._held, "shared", 0):
                    raise RuntimeError("the weights' layout cannot change inside a forward pass of the same model")
                self._waiting_exclusive += 1
                try:
                    while self._owner is not None or self._shared or self._turn_of_shared:
                        self._condition.wait()
                finally:
                    self._waiting_exclusive -= 1
                    self._condition.notify_all()
                self._owner = me
            self._exclusive += 1
        try:
            yield
        finally:
            with self._condition:
                self._exclusive -= 1
                if not self._exclusive:
                    self._owner = None
                    self._turn_of_shared = self._waiting_shared > 0
                    self._condition.notify_all()
