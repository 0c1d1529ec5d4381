"""Runs: one strategy on one prompt, driven one forward at a time, and the loops built on it.

`prepare(engine, strategy)` readies a strategy (adapter, forward costs, packed weights) before any clock starts;
`Run` is the steppable object every front end drives (docs/architecture.md): `advance()` does the prefill, then
one strategy step per call, and hands back that step's events; `cancel()` (from any thread) ends the
run at the next step boundary with `stop_reason = "cancelled"`. `drive` is the one loop: a single run
to its end, or several in lock-step by forward count (compare). `run_to_end` is `drive` on one run.
Seeding, stop rules, timing and the trace live here; what a UI shows comes out as events.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from studio import events as ev
from studio.engine.cost_model import cost_table
from studio.engine.cost_table import CostTable, stored_table
from studio.engine.device import synchronize
from studio.engine.engine import Engine
from studio.engine.kernels.projection import pack_weights
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, Strategy
from studio.errors import BadInput
from studio.run import mirror

CANCELLED = "cancelled"
PREFILL_CHUNK = 256   # prompt tokens per prefill forward of a long prompt: a cancel waits for one chunk at most
                      # (well under a second on a CPU for the embedded model), and the UIs show the progress


# The answer length every front end starts at (run, chat, the TUI and the web, compare included) unless told
MAX_NEW_TOKENS = 128


@dataclass
class Settings:
    max_new_tokens: int = MAX_NEW_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop: tuple[str, ...] = ()
    oracle_accept: float | None = None   # bench: accept decisions are Bernoulli(P) draws (the output means nothing)
    prefill_chunk: int = field(default_factory=lambda: PREFILL_CHUNK)

    def __post_init__(self):
        for flag, value, least in (("--max-new-tokens", self.max_new_tokens, 1), ("--seed", self.seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadInput(f"{flag} must be a whole number, got {value!r}")
            if value < least:
                raise BadInput(f"{flag} must be >= {least}, got {value}")
        if self.prefill_chunk < 1:
            raise BadInput(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")
        if self.oracle_accept is not None and not 0 < self.oracle_accept <= 1:
            raise BadInput(f"--oracle-accept must be in (0, 1], got {self.oracle_accept}")


@dataclass
class RunResult:
    header: dict
    events: list[dict]
    footer: dict
    token_ids: list[int]
    model_adapter: str | None = None   # the adapter whose model the output follows (`Run.model_adapter`)
    reference: str | None = None       # a comparison's label of the run this one's output is compared with

    def summary(self) -> dict:
        """The `run --json` object (docs/cli.md#json-outputs)."""
        f, h = self.footer, self.header
        return {"text": f["text"], "token_ids": self.token_ids, "n_tokens": f["n_tokens"],
                "forwards": f["forwards"], "tpf": f["tpf"], "accept_rate": f["accept_rate"],
                "wall_s": f["wall_s"], "tok_s": f["tok_s"], "prefill_s": f["prefill_s"],
                "strategy": h["strategy"], "params": h["params"], "model": h["model"], "stop_reason": f["stop_reason"]}

    def save(self, path) -> None:
        """Write this run as a trace file (for runs that were not traced while they ran)."""
        with ev.TraceWriter(path, self.header) as writer:
            for e in self.events:
                writer.write(e)
            writer.close(self.footer)


def encode_prompt(engine: Engine, text: str, chat: bool = True) -> list[int]:
    return encode_messages(engine, [{"role": "user", "content": text}], chat)


def encode_messages(engine: Engine, messages: list[dict], chat: bool = True) -> list[int]:
    """Token ids of a conversation ready for the assistant's turn: the model's chat template, or (no
    template, or `chat=False`) the message texts concatenated."""
    tok = engine.tokenizer
    if chat and getattr(tok, "chat_template", None):
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    return tok.encode("".join(m["content"] for m in messages))


def decoded_model(engine: Engine, strategy: Strategy) -> str | None:
    """The adapter whose model a run of `strategy` on `engine` (its adapter view) decodes: the adapter when its
    LoRA applies at the clean rows (`Strategy.clean_gate`), else None for the base model."""
    return engine.adapter if strategy.clean_gate(engine.lora) else None


def kv_length_needed(engine: Engine, strategy: Strategy, settings: Settings, prompt_ids: list[int]) -> int:
    """KV slots a run needs; BadInput when the prompt or the run does not fit the model's context."""
    cfg = engine.config
    if not prompt_ids:
        raise BadInput("the prompt is empty")
    if not strategy.fits(cfg):
        from studio.engine.strategies import STRATEGIES
        fits = ", ".join(sorted(n for n, s in STRATEGIES.items() if s.fits(cfg)))
        raise BadInput(f"{strategy.misfit(cfg, engine.name)}; strategies that fit: {fits}")
    if strategy.own_sampling and settings.sampling != SamplingParams():
        raise BadInput(f"{strategy.name} samples at its own temperature schedule (-p t_min=... -p t_max=...): "
                       "--temperature, --top-k and --top-p do not apply to it")
    if strategy.needs_mask and cfg.mask_token_id is None:
        raise BadInput(f"strategy {strategy.name!r} needs a MASK token and model {engine.name!r} has "
                       "none: give an adapter that adds one or a model preset with mask_token_id")
    strategy.check_run(cfg, settings.max_new_tokens)
    if len(prompt_ids) >= cfg.max_seq_len:
        raise BadInput(f"the prompt is {len(prompt_ids)} tokens, longer than the model's context of {cfg.max_seq_len}")
    kv_len = len(prompt_ids) + settings.max_new_tokens + strategy.kv_headroom(cfg)
    if kv_len > cfg.max_seq_len:
        raise BadInput(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens ({settings.max_new_tokens}) exceeds the "
                       f"model's context of {cfg.max_seq_len}; lower --max-new-tokens")
    return kv_len


def planning_costs(engine: Engine):
    """The cost table a cost-aware run plans with. Under tensor parallelism the forwards that measure it are
    collective: rank 0 has every rank measure (when it has no stored table) and announces the table with the run,
    which a following rank takes in place of this placeholder."""
    if mirror.following():
        return None
    leader = mirror.leader()
    if leader is None or stored_table(engine) is not None:
        return cost_table(engine)
    with leader.lock:
        leader.send("calibrate", engine.adapter)
        return cost_table(engine, refresh=True)


def costs_pending(engine: Engine, strategy: Strategy) -> bool:
    """Whether `prepare(engine, strategy)` would measure the machine's cost table (a cost-aware strategy on a model,
    device and dtype without a stored one): seconds that a front end says, then spends off its UI thread."""
    return strategy.plans_drafts and not mirror.following() and stored_table(engine.for_strategy(strategy.name)) is None


@dataclass(frozen=True)
class Prepared:
    """A strategy ready to run on an engine: `engine` is the adapter view the strategy decodes with, `costs` the
    forward-cost table a cost-aware strategy plans with (else None). Made by `prepare`; a `Run` built from it
    reads, loads and measures nothing. Its runs go one after another: the strategy object holds its run's state."""
    engine: Engine
    strategy: Strategy
    costs: CostTable | None = None


def prepare(engine: Engine, strategy: Strategy, *, view: Engine | None = None) -> Prepared:
    """Everything a run of `strategy` on `engine` needs before its clock starts: the strategy's adapter (`view`, the
    adapter view a caller chose, else the one shipped for the strategy unless the engine has a fixed choice), what the
    strategy loads itself (`Strategy.ready`: DFlash's drafter), the
    machine's forward costs for a cost-aware strategy (measured here when none are stored: `costs_pending` says so
    first), and packed weights for a strategy whose forwards score many rows. Cheap after the first call for the
    same engine and strategy."""
    view = view or engine.for_strategy(strategy.name)
    strategy.ready(view)
    costs = planning_costs(view) if strategy.plans_drafts else None
    if strategy.wide_forwards:
        pack_weights(view.model)
    return Prepared(view, strategy, costs)


def run_header(engine: Engine, strategy: Strategy, settings: Settings, prompt_text: str, prompt_ids: list[int]) -> dict:
    """The trace header of a run of `strategy` on `engine` (its adapter view) with `settings` (docs/events.md)."""
    s = settings
    params = dict(strategy.header_params(), temperature=s.sampling.temperature, top_k=s.sampling.top_k,
                  top_p=s.sampling.top_p, max_new_tokens=s.max_new_tokens)
    if s.oracle_accept is not None:   # a trace made under the oracle says so
        params["oracle_accept"] = s.oracle_accept
    return {"strategy": strategy.name, "params": params, "model": engine.model_meta(),
            "tokenizer": engine.tokenizer_meta(), "prompt": {"text": prompt_text, "token_ids": list(prompt_ids)},
            "seed": s.seed, **strategy.header_fields(engine.config, s.max_new_tokens)}


class Run:
    """One generation, advanced one strategy step at a time, of a strategy `prepare` readied (building a run
    checks the prompt against the model's context, lends a KV cache from the pool and opens the trace: nothing
    that takes seconds).

    `kv`: a cache whose committed slots hold a prefix of `prompt_ids` (a chat's earlier turns); the
    prefill then computes only the tokens after it. `on_finish(run)` is called once, when the result
    is ready. Not thread-safe except `cancel` and reading `prefill_progress`: one thread advances a run.

    A long prompt is prefilled in chunks of `settings.prefill_chunk` tokens, one per `advance()`, when the
    strategy's committed KV is token-causal (`Strategy.causal_kv`), so a cancel lands between chunks and
    `prefill_progress` moves; the strategy's own prefill then computes only the last chunk (as after a
    reused prefix). The chunks' events are handed out with the strategy's prefill, so step 0 stays one whole
    step for every reader.
    """

    def __init__(self, prepared: Prepared, settings: Settings, prompt_text: str, prompt_ids: list[int], *,
                 trace_path: str | None = None, kv=None, on_finish: Callable[["Run"], None] | None = None,
                 reference: str | None = None):
        engine, strategy = prepared.engine, prepared.strategy
        kv_len = kv_length_needed(engine, strategy, settings, prompt_ids)
        continues = getattr(kv, "mirror_id", None)   # under tensor parallelism, the announced run whose cache this is
        if kv is not None and kv.max_len < kv_len:
            kv = kv.grown(engine.caches.size_for(engine.model, kv_len))
        # with graphs, a pooled cache brings the graphs earlier runs captured; it goes back when the run ends,
        # unless `keep_cache` took it (a chat keeping its history)
        self._lent = kv is None and engine.graphs
        if self._lent:
            kv = engine.caches.lend(engine.model, kv_len)
        self.engine, self.strategy, self.settings = engine, strategy, settings
        self.reference = reference   # set by a comparison (studio.run.compare.make_runs)
        self.prompt_ids = list(prompt_ids)
        self.header = run_header(engine, strategy, settings, prompt_text, self.prompt_ids)
        self.out = Output(engine.tokenizer, settings.max_new_tokens, frozenset(engine.eos_ids()), tuple(settings.stop))
        self.ctx = DecodeContext(engine.model, engine.tokenizer, settings.sampling, settings.seed, self.out,
                                 engine.config.mask_token_id, kv_len, kv=kv, oracle_accept=settings.oracle_accept,
                                 graphs=engine.graphs, clean_gate=strategy.clean_gate(engine.lora),
                                 costs=prepared.costs, graph_tokens=strategy.graph_tokens())
        self._writer = ev.TraceWriter(trace_path, self.header) if trace_path else None
        self._on_finish = on_finish
        self._cancel = threading.Event()
        self.events: list[dict] = []
        self.forwards = 0            # forwards after the prefill (the lock-step clock, docs/metrics.md)
        self._chunk_ends = self._plan_chunks() if strategy.causal_kv(engine.config) else []
        self._held: list[dict] = []  # events of the prefill chunks so far (step 0 is handed out whole)
        self.started = False         # the strategy's own prefill has run
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.result: RunResult | None = None
        # under tensor parallelism rank 0 announces the run to the other ranks, which build it alike
        leader = mirror.leader()
        self.mirror_id = leader.announce(self, prompt_text, continues, prepared.costs) if leader else None

    def _plan_chunks(self) -> list[int]:
        """Prompt lengths after each chunk forward: chunks from the committed KV on, leaving the strategy's prefill
        the last 1..chunk tokens."""
        chunk = self.settings.prefill_chunk
        return list(range(self.ctx.kv.length + chunk, len(self.prompt_ids), chunk))

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def prefilling(self) -> bool:
        """Prefill chunks remain before the strategy's own prefill (they run without step-mode waits)."""
        return bool(self._chunk_ends) and not self.done

    @property
    def prefill_progress(self) -> tuple[int, int] | None:
        """(prompt tokens in the KV cache, prompt tokens) until the strategy's prefill has run, then None."""
        if self.started or self.done:
            return None
        return min(self.ctx.kv.length, len(self.prompt_ids)), len(self.prompt_ids)

    @property
    def model_adapter(self) -> str | None:
        """The adapter whose model this run decodes (its LoRA on the clean rows), None for the base model."""
        return decoded_model(self.engine, self.strategy)

    def keep_cache(self):
        """The run's KV cache, kept by the caller after the run (not given back to the pool)."""
        self._lent = False
        return self.ctx.kv

    def cancel(self) -> None:
        """Ask the run to stop; it ends at the next step boundary (safe from any thread)."""
        self._cancel.set()

    def token_text(self, token_id: int) -> str:
        """The text of one token (for displays of proposals, which events carry as ids only)."""
        return self.engine.tokenizer.token_text(token_id)

    def advance(self) -> list[dict]:
        """The prefill (one chunk per call for a long prompt, handing out nothing until the strategy's own prefill
        has run), then one strategy step per call; returns the events of what ran. A finished run returns [].
        An exception leaves the trace truncated (the honest record)."""
        if self.mirror_id is None:
            return self._advance(self._cancel.is_set())
        leader = mirror.leader()
        with leader.lock:   # the step's collectives follow its message, nothing between them
            cancelled = self._cancel.is_set()   # read once: every rank must see the same answer
            if not self.done:
                leader.send("advance", self.mirror_id, cancelled)
            return self._advance(cancelled)

    def _advance(self, cancelled: bool) -> list[dict]:
        if self.done:
            return []
        if cancelled:
            self.out.stop_reason = CANCELLED
            events = self._publish()   # a prefill cancelled between chunks: the chunks that ran
            self._finish()
            return events
        self.engine.activate()                      # runs sharing the model may use different adapters
        t = time.perf_counter()
        self.ctx.resume_clock()
        try:
            if self._chunk_ends:
                end = self._chunk_ends.pop(0)
                self.ctx.prefill_prefix(self.prompt_ids[self.ctx.kv.length:end], self.strategy.prefill_gate(self.ctx))
                synchronize(self.ctx.device)
                self.prefill_s += time.perf_counter() - t
                self._held.extend(self.ctx.drain())
                return []
            elif not self.started:
                self.started = True
                self.strategy.start(self.ctx, self.prompt_ids)
                synchronize(self.ctx.device)
                self.prefill_s += time.perf_counter() - t
            else:
                self.strategy.step(self.ctx)
                synchronize(self.ctx.device)
                self.decode_s += time.perf_counter() - t
        except BaseException:
            if self._writer:
                self._writer.close()
            raise
        finally:
            self.ctx.pause_clock()
        events = self._publish()
        if self.strategy.finished(self.ctx):
            self._finish()
        return events

    def _publish(self) -> list[dict]:
        events, self._held = self._held + self.ctx.drain(), []
        for e in events:
            if e["t"] == "forward" and e["role"] != "prefill":
                self.forwards += 1
            if self._writer:
                self._writer.write(e)
        self.events.extend(events)
        return events

    def _finish(self) -> None:
        tally = ev.Tally().feed_all(self.events)
        footer = dict(tally.footer(), stop_reason=self.out.stop_reason, prefill_s=self.prefill_s,
                      wall_s=self.prefill_s + self.decode_s, tok_s=ev.tok_per_s(tally.decoded, self.decode_s))
        if self._writer:
            self._writer.close(footer)
        self.result = RunResult(header=self.header, events=self.events, footer=footer,
                                token_ids=list(self.out.token_ids), model_adapter=self.model_adapter,
                                reference=self.reference)
        if self._on_finish:
            self._on_finish(self)
        if self._lent:
            self._lent = False
            self.engine.caches.give_back(self.ctx.kv)


def drive(runs: Sequence[Run], on_events: Callable[[int, list[dict]], None] | None = None,
          before_advance: Callable[[], None] | None = None) -> None:
    """Advance `runs` until every one is done, in lock-step by forward count: the unfinished run with the
    fewest forwards goes next (ties: list order). `on_events(index, events)` after every advance;
    `before_advance()` before it (step mode waits there; not before a prefill chunk)."""
    while True:
        live = [i for i, r in enumerate(runs) if not r.done]
        if not live:
            return
        i = min(live, key=lambda i: runs[i].forwards)
        if before_advance and not runs[i].prefilling:
            before_advance()
        events = runs[i].advance()
        if on_events:
            on_events(i, events)


def run_to_end(engine: Engine, strategy: Strategy, settings: Settings, prompt_text: str, prompt_ids: list[int],
             sinks: Sequence[Callable[[dict], None]] = (), trace_path: str | None = None) -> RunResult:
    """One run to its end (`drive` on it); every event goes to each sink (between steps, never inside timed work)."""
    run = Run(prepare(engine, strategy), settings, prompt_text, prompt_ids, trace_path=trace_path)

    def publish(_, events: list[dict]) -> None:
        for e in events:
            for sink in sinks:
                sink(e)
    drive([run], publish)
    return run.result
