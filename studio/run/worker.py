"""Decoding in a background thread, so it never waits for drawing (docs/ui.md#threading-model).

A `Worker` drives one run, or several in lock-step, with `session.drive` on its own thread and queues
each step's events; a UI takes them with `drain()` at its own frame rate. In step mode the worker
advances once per `step()` call. `cancel()` stops every run at its next step boundary. An exception in
the engine ends the worker and is kept in `error` for the UI to show.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:   # studio.run.session imports torch; importing this module must not
    from studio.run.session import Run


def reserve_cores_for_drawing(n: int = 1) -> int:
    """Decode on every core but `n`, so a UI thread draws on a core of its own: torch's intra-op threads
    spin while they wait for each other, and a third busy thread on a 2-core machine slows every matmul
    several-fold. Process-wide (torch's setting is); returns the decode thread count."""
    import torch

    from studio.engine.device import cpu_threads
    threads = max(1, cpu_threads() - n)
    torch.set_num_threads(threads)
    return threads


class Worker:
    def __init__(self, runs: Sequence[Run], step_mode: bool = False):
        self.runs = list(runs)
        self.error: BaseException | None = None
        self._batches: deque[tuple[int, list[dict]]] = deque()   # (run index, events of one advance)
        self._step_mode = step_mode
        self._permits = threading.Semaphore(0)
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._main, name="dlm-studio-decode", daemon=True)

    def start(self) -> "Worker":
        self._thread.start()
        return self

    def _main(self) -> None:
        from studio.run.session import drive
        try:
            drive(self.runs, lambda i, events: self._batches.append((i, events)), self._wait_turn)
        except BaseException as e:  # noqa: BLE001 - the UI shows it; the thread must not die silently
            self.error = e

    def _wait_turn(self) -> None:
        if self._step_mode and not self._cancelled.is_set():
            self._permits.acquire()

    @property
    def done(self) -> bool:
        """The thread has ended (read it before the last `drain`, so no batch is missed)."""
        return not self._thread.is_alive()

    def drain(self) -> list[tuple[int, list[dict]]]:
        """Every (run index, events) batch queued since the last call, oldest first."""
        out = []
        while self._batches:
            out.append(self._batches.popleft())
        return out

    def cancel(self) -> None:
        self._cancelled.set()
        for run in self.runs:
            run.cancel()
        self._permits.release()

    @property
    def step_mode(self) -> bool:
        return self._step_mode

    def set_step_mode(self, on: bool) -> None:
        self._step_mode = on
        if not on:
            self._permits.release()   # a worker waiting for a step goes on by itself

    def step(self) -> None:
        """Step mode: allow one more advance (one strategy step: one forward for most strategies)."""
        self._permits.release()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
