"""The decode thread of the server: requests wait in a bounded queue and up to `max_running` of them decode
(docs/serving.md#scheduling). Greedy, lossless ar/isd/r-isd requests decode in continuous batches (one per strategy
and stride: a request joins between rounds and leaves when it ends, its output its solo run's; where the machine's
forward costs say drafts do not pay at the server's batch size, isd and r-isd batches run AR rounds of the model
they decode, the same tokens); every other request is a run of its own. Each turn of the loop advances every batch
by one round and every solo run by one step.

One thread owns the engine: runs are built, advanced and finished only here, so the HTTP side never touches the
model. A job's messages go back to its handler through `Job.post` (thread-safe), in order:
  ("start", header)           the run was built (its trace header); the handler may now answer 200
  ("events", [event, ...])    one step's events (to streaming requests only)
  ("done", RunResult)         the run ended
  ("error", ApiError)         the run could not start (400) or failed (500); nothing follows
A cancelled job (its client went away) stops at the next step boundary and posts "done" with stop_reason
"cancelled"; a job cancelled while it waits never starts. Finished runs' traces stay on disk, the newest
`keep_traces` of them.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from studio.errors import BadInput
from studio.serve.protocol import ApiError, Limits, Request

CANCELLED = "cancelled"

log = logging.getLogger("dlm-studio.serve")

RETRY_AFTER_S = 1


@dataclass
class Job:
    request: Request
    prompt_ids: list[int]
    id: str
    post: Callable[[tuple], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    header: dict | None = None    # its trace header, once started
    result: object = None         # its RunResult, once done

    def cancel(self) -> None:
        self.cancelled.set()

    def post_events(self, events: list[dict]) -> None:
        """One step's events, to a streaming client only (a whole answer waits for "done": no wake-up per step)."""
        if events and self.request.stream:
            self.post(("events", events))


class _Solo:
    """A request decoded by a `Run` of its own."""

    def __init__(self, job: Job, run):
        self.job, self.run = job, run

    @property
    def jobs(self) -> list[Job]:
        return [] if self.run.done else [self.job]

    def step(self) -> list[Job]:
        """One step; the jobs it finished (their `result` set)."""
        if self.job.cancelled.is_set():
            self.run.cancel()
        self.job.post_events(self.run.advance())
        if not self.run.done:
            return []
        self.job.result = dataclasses.replace(self.run.result, header=self.job.header)
        return [self.job]


class _Batch:
    """Requests decoded together in a `ContinuousBatch`, and how many of each one's events are posted."""

    def __init__(self, batch):
        self.batch = batch
        self.members: dict[int, tuple[Job, int]] = {}     # id(sequence) -> (job, events posted)

    @property
    def jobs(self) -> list[Job]:
        return [job for job, _ in self.members.values()]

    def join(self, job: Job, settings) -> list[Job]:
        seq = self.batch.join(job.prompt_ids, settings.max_new_tokens, settings.stop)
        job.post(("start", job.header))
        self.members[id(seq)] = (job, 0)
        self._post(seq)
        return [] if seq.live else [self._finish(seq)]

    def step(self) -> list[Job]:
        finished = []
        for seq in list(self.batch.sequences):
            if self.members[id(seq)][0].cancelled.is_set():
                self.batch.drop(seq, CANCELLED)
                finished.append(self._finish(seq))
        if self.batch.sequences:
            running = list(self.batch.sequences)
            ended = self.batch.step()
            for seq in running:
                self._post(seq)
            finished += [self._finish(seq) for seq in ended]
        return finished

    def _post(self, seq) -> None:
        job, seen = self.members[id(seq)]
        job.post_events(seq.events[seen:])
        self.members[id(seq)] = job, len(seq.events)

    def _finish(self, seq) -> Job:
        from studio.run.session import RunResult
        job, _ = self.members.pop(id(seq))
        r = seq.result()
        job.result = RunResult(header=job.header, events=r.events, footer=r.footer, token_ids=r.token_ids)
        return job


class Scheduler:
    def __init__(self, engine, trace_dir: Path, limits: Limits = Limits(), keep_traces: int = 256):
        self.engine, self.trace_dir, self.limits, self.keep_traces = engine, Path(trace_dir), limits, keep_traces
        self._waiting: collections.deque[Job] = collections.deque()
        self._units: list[_Solo | _Batch] = []
        self._batches: dict[tuple, _Batch] = {}     # (strategy, stride, adapter) -> its batch
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
            running = self._n_running()
            free = max(0, self.limits.max_running - running)   # a waiting job may be about to start
            if len(self._waiting) >= self.limits.max_queued + free:
                raise ApiError(429, f"the server is busy: {running} requests decoding and "
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
            return self._n_running(), len(self._waiting)

    def stop(self) -> None:
        """Cancel everything and end the thread."""
        with self._wake:
            self._stopping = True
            for job in list(self._waiting) + [j for unit in self._units for j in unit.jobs]:
                job.cancel()
            self._wake.notify()
        self._thread.join(timeout=30)

    def _n_running(self) -> int:
        return sum(len(unit.jobs) for unit in self._units)

    # -- the decode thread -----------------------------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._units:
                    self._wake.wait()
                if self._stopping and not self._units:
                    return
                starting = []
                while self._waiting and self._n_running() + len(starting) < self.limits.max_running:
                    starting.append(self._waiting.popleft())
            for job in starting:
                self._guarded(job, lambda job=job: self._begin(job))
            for unit in list(self._units):
                self._guarded(unit, unit.step)

    def _guarded(self, owner, work) -> None:
        """Run `work` (a start or a step); the jobs it finished leave, and an error ends the jobs involved with a
        400 (bad input) or a 500, the others going on."""
        jobs = owner.jobs if not isinstance(owner, Job) else [owner]
        try:
            self._finished(work() or [])
        except BadInput as e:
            self._failed(jobs, ApiError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - these requests failed; the server goes on
            log.exception("requests %s failed", ", ".join(j.id for j in jobs))
            self._failed(jobs, ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def _begin(self, job: Job) -> list[Job]:
        """Start a job: join its batch, or build its run; the jobs that finished at once."""
        from studio import events as ev
        from studio.engine.batch import ContinuousBatch, batch_stride, round_shape, unbatchable
        from studio.run.session import Run, kv_length_needed, planning_costs, prepare, run_header
        if job.cancelled.is_set():
            return []
        strategy, settings = job.request.config.build()
        # a tensor-parallel engine runs every request on its own: batches are not mirrored to the other ranks yet
        if unbatchable(strategy, settings.sampling) is None and self.engine.model.parallel is None:
            view = self.engine.for_strategy(strategy.name)
            kv_length_needed(view, strategy, settings, job.prompt_ids)
            header = run_header(view, strategy, settings, job.request.prompt_text, job.prompt_ids)
            costs = planning_costs(view) if round_shape(strategy, settings.sampling) > 1 else None
            stride = batch_stride(strategy, settings.sampling, costs, self.limits.max_running,
                                  strategy.clean_gate(view.lora))
            if stride > 1 and "drafting" in header["params"]:   # a drafting batch drafts in full (round_shape)
                header["params"].update(drafting="fixed", lookup=0)
            job.header = ev.full_header(dict(header, batched=True, batch_stride=stride))
            key = (strategy.name, stride, view.adapter)
            if key not in self._batches:
                self._batches[key] = _Batch(ContinuousBatch(view, strategy, settings.sampling, stride))
                with self._wake:
                    self._units.append(self._batches[key])
            return self._batches[key].join(job, settings)
        run = Run(prepare(self.engine, strategy), settings, job.request.prompt_text, job.prompt_ids)
        job.header = ev.full_header(run.header)
        job.post(("start", job.header))
        with self._wake:
            self._units.append(_Solo(job, run))
        return []

    def _finished(self, jobs: list[Job]) -> None:
        """Write each finished job's trace, then tell its client (who may ask for the trace at once)."""
        for job in jobs:
            job.result.save(self.trace_dir / f"{job.id}.jsonl")
            self._keep_trace(job.id)
            job.post(("done", job.result))
        # ended runs and emptied batches leave (a batch comes back with its next request)
        self._keep_units(lambda unit: bool(unit.jobs))

    def _failed(self, jobs: list[Job], error: ApiError) -> None:
        for job in jobs:
            job.post(("error", error))
        failed = set(map(id, jobs))
        self._keep_units(lambda unit: not failed & set(map(id, unit.jobs)))

    def _keep_units(self, keep: Callable[[object], bool]) -> None:
        with self._wake:
            self._units = [u for u in self._units if keep(u)]
            self._batches = {k: b for k, b in self._batches.items() if b in self._units}

    def _keep_trace(self, rid: str) -> None:
        with self._wake:
            self._traces[rid] = self.trace_dir / f"{rid}.jsonl"
            while len(self._traces) > self.keep_traces:
                _, old = self._traces.popitem(last=False)
                old.unlink(missing_ok=True)
