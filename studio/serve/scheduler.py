"""The decode thread of the server: requests wait in a bounded queue, up to `max_running` of them decode, one step at
a time each, in lock-step by forward count (docs/serving.md#scheduling).

One thread owns the engine: runs are built, advanced and finished only here, so the HTTP side never touches the
model. A job's messages go back to its handler through `Job.post` (thread-safe), in order:
  ("start", header)           the run was built (its trace header); the handler may now answer 200
  ("events", [event, ...])    one step's events
  ("done", RunResult)         the run ended
  ("error", ApiError)         the run could not start (400) or failed (500); nothing follows
A cancelled job (its client went away) stops at the next step boundary and posts "done" with stop_reason
"cancelled"; a job cancelled while it waits never starts. Finished runs' traces stay on disk, the newest
`keep_traces` of them.
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from studio.errors import BadInput
from studio.serve.protocol import ApiError, Limits, Request

log = logging.getLogger("dlm-studio.serve")

RETRY_AFTER_S = 1


@dataclass
class Job:
    request: Request
    prompt_ids: list[int]
    id: str
    post: Callable[[tuple], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, engine, trace_dir: Path, limits: Limits = Limits(), keep_traces: int = 256):
        self.engine, self.trace_dir, self.limits, self.keep_traces = engine, Path(trace_dir), limits, keep_traces
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[tuple[Job, object]] = []       # (job, its Run)
        self._traces: collections.OrderedDict[str, Path] = collections.OrderedDict()   # finished, oldest first
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="dlm-studio-serve", daemon=True)

    # -- the HTTP side ------------------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        """Queue a job; ApiError 429 (with Retry-After) when the queue is full."""
        with self._wake:
            free = max(0, self.limits.max_running - len(self._running))   # a waiting job may be about to start
            if len(self._waiting) >= self.limits.max_queued + free:
                raise ApiError(429, f"the server is busy: {len(self._running)} requests decoding and "
                               f"{len(self._waiting)} waiting; retry shortly", type="rate_limit_exceeded",
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
            self._waiting.append(job)
            self._wake.notify()

    def trace(self, rid: str) -> Path | None:
        """A finished request's trace file, while it is among the newest kept."""
        with self._wake:
            return self._traces.get(rid)

    @property
    def load(self) -> tuple[int, int]:
        """(requests decoding, requests waiting)."""
        with self._wake:
            return len(self._running), len(self._waiting)

    def stop(self) -> None:
        """Cancel everything and end the thread."""
        with self._wake:
            self._stopping = True
            for job in self._waiting:
                job.cancel()
            for job, _ in self._running:
                job.cancel()
            self._wake.notify()
        self._thread.join(timeout=30)

    # -- the decode thread -----------------------------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping and not self._running:
                    return
                starting = []
                while self._waiting and len(self._running) + len(starting) < self.limits.max_running:
                    starting.append(self._waiting.popleft())
            for job in starting:
                self._begin(job)
            if self._running:
                self._step()

    def _begin(self, job: Job) -> None:
        """Build the job's run (BadInput: a 400 to its client) and add it to the running ones."""
        from studio.run.session import Run
        if job.cancelled.is_set():
            return
        try:
            strategy, settings = job.request.config.build()
            run = Run(self.engine, strategy, settings, job.request.prompt_text, job.prompt_ids,
                      trace_path=self.trace_dir / f"{job.id}.jsonl")
        except BadInput as e:
            job.post(("error", ApiError(400, str(e))))
            return
        except Exception as e:  # noqa: BLE001 - the client gets a 500, the server goes on
            log.exception("request %s failed to start", job.id)
            job.post(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")))
            return
        job.post(("start", run.trace_header))
        with self._wake:
            self._running.append((job, run))

    def _step(self) -> None:
        """Advance the running job with the fewest forwards by one step (a cancelled one ends there)."""
        with self._wake:
            job, run = min(self._running, key=lambda jr: jr[1].forwards)
        if job.cancelled.is_set():
            run.cancel()
        try:
            events = run.advance()
        except Exception as e:  # noqa: BLE001 - one request failed; the others go on
            log.exception("request %s failed", job.id)
            self._drop(job)
            job.post(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")))
            return
        if events:
            job.post(("events", events))
        if run.done:
            self._drop(job)
            self._keep_trace(job.id)
            job.post(("done", run.result))

    def _drop(self, job: Job) -> None:
        with self._wake:
            self._running = [(j, r) for j, r in self._running if j is not job]

    def _keep_trace(self, rid: str) -> None:
        with self._wake:
            self._traces[rid] = self.trace_dir / f"{rid}.jsonl"
            while len(self._traces) > self.keep_traces:
                _, old = self._traces.popitem(last=False)
                old.unlink(missing_ok=True)
