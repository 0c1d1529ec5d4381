"""What every strategy stands on: the decode context (model, KV, sampler, output, events) and the
Strategy interface. A strategy only decides *what* to run and keep; the context does the plumbing
and turns every forward, KV move and emitted token into an event.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from studio import events as ev
from studio.engine import kernels
from studio.engine.graphs import WIDE, GraphRunner
from studio.engine.moe import MoE
from studio.engine.cost_table import FLAT_COSTS, CostTable
from studio.engine.draft_tree import DraftTree, TreeVerdict, verify as walk_tree
from studio.engine.oracle import oracle_chain
from studio.engine.sampling import ChainResult, Proposal, SamplingParams, verify_chain
from studio.errors import BadInput
from studio.engine.strategies.params import parse_params


@dataclass
class Output:
    """The generated tokens and the stop rules (EOS ids, stop strings, max_new_tokens)."""
    tokenizer: Any
    max_new_tokens: int
    eos_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def draft_room(self, written: int = 0) -> int:
        """How many drafts a forward can verify usefully once `written` more tokens are out: it writes a token of its
        own after the drafts it accepts, so one fewer than the tokens left to max_new_tokens."""
        return max(0, self.max_new_tokens - len(self.token_ids) - written - 1)

    def append(self, tokens: list[int]) -> tuple[list[int], str]:
        """Take tokens one by one until a stop rule fires. Returns (taken tokens, new text)."""
        taken = []
        for tok in tokens:
            if self.finished:
                break
            taken.append(tok)
            self.token_ids.append(tok)
            if tok in self.eos_ids:
                self.stop_reason = "eos"
            elif len(self.token_ids) >= self.max_new_tokens:
                self.stop_reason = "max_new_tokens"
        text = self.tokenizer.decode([t for t in self.token_ids if t not in self.eos_ids])
        for s in self.stop_strings:
            cut = text.find(s)
            if cut >= 0:
                text, self.stop_reason = text[:cut], "stop_string"
        if not self.finished:
            text = text[:len(text) - self._held_back(text)]
        new = text[len(self.text):]
        self.text = text
        return taken, new

    def _held_back(self, text: str) -> int:
        """Characters not to show yet: an incomplete UTF-8 sequence, or a possible stop-string start."""
        if text.endswith("\ufffd"):
            return 1
        return max((k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class DecodeContext:
    """Model + KV cache + sampler + output for one generation, with event bookkeeping.

    Events are buffered and handed out between steps (`drain`), so rendering never runs inside the
    timed decode loop. Every tensor of the run (KV, masks, gates, the sampler's generator) lives on the
    model's device. `oracle_accept` = P replaces every accept decision by a Bernoulli(P) draw (bench).
    `clean_gate`: the LoRA gate of the run's clean (non-MASK) rows, `Strategy.clean_gate` of its adapter.
    `costs`: the machine's forward cost table for this model, which cost-aware drafting plans with (None: a context
    built by hand plans as if up to 16 rows cost what one does). `graph_tokens`: with `graphs`, the widest forward
    that replays a graph (`Strategy.graph_tokens`).
    """

    def __init__(self, model, tokenizer, sampling: SamplingParams, seed: int, output: Output,
                 mask_id: int | None, kv_len: int, kv=None, oracle_accept: float | None = None, graphs: bool = False,
                 clean_gate: bool = False, costs: CostTable | None = None, graph_tokens: int | None = WIDE):
        self.model = model
        self.costs = costs or FLAT_COSTS
        self.clean_gate = clean_gate
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.device = model.lm_head.weight.device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.oracle_accept = oracle_accept
        self.out = output
        self.mask_id = mask_id
        # `kv` may arrive holding a committed prefix of the prompt (a chat's earlier turns): the prefill
        # then computes only what follows it (see `_skip_reused`)
        self.kv = kv if kv is not None else model.new_cache(kv_len)
        # graphs: the run's own decode-sized forwards replay CUDA graphs captured on this cache (the prefill,
        # and a second model such as SimSD's drafter, fall back to eager inside the runner). The runner stays
        # with the cache, so a pooled cache or a chat's kept one replays the graphs of earlier runs.
        self._runner = None
        if graphs:
            if self.kv.runner is None:
                self.kv.runner = GraphRunner(model, self.kv)
            self._runner = self.kv.runner
            self._runner.max_tokens = graph_tokens   # this run's strategy says how wide (a pooled cache served others)
        self._reusable: int | None = self.kv.length
        self._skipped = 0      # prompt tokens the prefill did not recompute; the next commit counts them
        self._adapters: dict[int, bool] = {}   # id(model) -> has a LoRA adapter attached
        self._moe: dict[int, list] = {}         # id(model) -> its MoE layers (their expert counts go in the events)
        self.step = 0          # index of the last forward (0 = prefill)
        # what `costs` prices the forwards after the prefill at, and a drafter's forwards (`price`): cost-aware
        # drafting's regret
        self.table_ms = 0.0
        self._elapsed_s = 0.0  # the run's own clock: it runs only while the run is advancing, so a run
        self._since: float | None = None   # stepped in lock-step with others stamps only its own time
        self._pending: list[dict] = []

    @property
    def graphs(self) -> bool:
        """Whether this run's forwards replay CUDA graphs where they can (a strategy's own passes may too)."""
        return self._runner is not None

    # -- events ---------------------------------------------------------------------------
    def resume_clock(self) -> None:
        self._since = time.perf_counter()

    def pause_clock(self) -> None:
        if self._since is not None:
            self._elapsed_s += time.perf_counter() - self._since
            self._since = None

    def ms(self) -> float:
        running = time.perf_counter() - self._since if self._since is not None else 0.0
        return (self._elapsed_s + running) * 1000.0

    def event(self, kind: str, *, at_step: int | None = None, **fields) -> None:
        """Record an event of the current step (`at_step`: of another, e.g. a plan for the next forward)."""
        self._pending.append(ev.make(kind, self.step if at_step is None else at_step, self.ms(), **fields))

    def drain(self) -> list[dict]:
        out, self._pending = self._pending, []
        return out

    # -- model ----------------------------------------------------------------------------
    def forward(self, role: str, tokens: list[int], positions: list[int] | torch.Tensor | None = None,
                mask=None, lora_gate: list[bool] | None = None, logits_rows=None, model=None, kv=None,
                embed_shift: torch.Tensor | None = None) -> torch.Tensor:
        """One model forward over new tokens written after the committed KV. Returns logits [R, V].
        `positions` (default: the slots) may be a tensor already on the device (a mask builder's).
        `lora_gate`: per row, whether the adapter applies; None = every row is a clean row (`clean_gate`).
        `model`/`kv` default to the run's own; a second model (SimSD's drafter) passes its own pair.
        `embed_shift` [T, D]: added to the rows' token embeddings (`Transformer.forward`; such a forward runs
        eagerly, never through a CUDA graph)."""
        model, kv = model or self.model, kv or self.kv
        if role != "prefill":
            self.step += 1
        if kv is self.kv and self._reusable is not None:
            tokens, positions, mask, lora_gate, logits_rows = self._skip_reused(
                role, tokens, positions, mask, lora_gate, logits_rows)
        L = kv.length
        pos = torch.arange(L, L + len(tokens), device=self.device) if positions is None else \
            torch.as_tensor(positions, device=self.device)
        if lora_gate is None and self.clean_gate and model is self.model:
            lora_gate = [True] * len(tokens)
        gate, gated = None, 0
        if lora_gate is not None and self._has_adapter(model):
            gate = torch.tensor(lora_gate, dtype=torch.bool, device=self.device)
            gated = sum(map(bool, lora_gate))
        if role != "prefill":
            self.table_ms += self.costs.forward_ms(len(tokens), gated)
        t = time.perf_counter()
        graphed = self._runner is not None and model is self.model and embed_shift is None
        run = self._runner.forward if graphed else model
        shift = {} if embed_shift is None else {"embed_shift": embed_shift}
        with torch.inference_mode():
            logits = run(torch.tensor(tokens, device=self.device), pos, kv, mask=mask, lora_gate=gate,
                         logits_rows=logits_rows, **shift)[0]
        if torch.isnan(logits).any():
            raise BadInput(f"model produced NaN logits at forward {self.step} ({role})")
        moe = self._moe_layers(model)
        self.event("forward", role=role, n_tokens=len(tokens), lora_rows=gated,
                   wall_ms=(time.perf_counter() - t) * 1000.0, **({"experts": [int(m.experts_run) for m in moe]} if moe else {}))
        return logits

    def price(self, steps: float) -> None:
        """Count work besides the target's forwards (a drafter's forward), priced at `steps` 1-token steps, in the
        run's priced time: a planner's regret then sees what the drafts cost to make, as well as to verify."""
        self.table_ms += steps * self.costs.forward_ms(1, 0)

    def _skip_reused(self, role, tokens, positions, mask, lora_gate, logits_rows):
        """The run's first forward on a cache that holds a reused prefix. A prefill passes its tokens from
        position 0 (as on an empty cache); the reused ones are dropped, down to the first row whose logits
        are wanted, and the masks, gates and rows follow. Any other first forward starts from scratch."""
        reusable, self._reusable = self._reusable, None
        skip = 0
        if role == "prefill" and positions is None:
            first_row = 0 if logits_rows is None else min(logits_rows)
            skip = min(reusable, first_row, len(tokens))
        if skip < self.kv.length:   # the prefill wants logits of rows already in the cache: recompute them
            self.event("kv", op="rollback", from_len=self.kv.length, to_len=skip)
        self.kv.rollback(skip)
        self._skipped = skip
        if skip:
            tokens = tokens[skip:]
            mask = None if mask is None else mask[skip:]
            lora_gate = None if lora_gate is None else lora_gate[skip:]
            logits_rows = [r - skip for r in logits_rows]
        return tokens, positions, mask, lora_gate, logits_rows

    def prefill_prefix(self, tokens: list[int], lora_gate: bool) -> None:
        """Commit the K/V of `tokens`, the prompt's next tokens after the committed KV, in one causal "prefill"
        forward (a long prompt's chunks, `Run`); the strategy's own prefill then skips them as a reused prefix."""
        self._reusable = None
        self.forward("prefill", tokens, lora_gate=[lora_gate] * len(tokens), logits_rows=[len(tokens) - 1])
        self.commit(len(tokens))
        self._reusable = self.kv.length

    def _moe_layers(self, model) -> list:
        if id(model) not in self._moe:
            self._moe[id(model)] = [m for m in model.modules() if isinstance(m, MoE)]
        return self._moe[id(model)]

    def _has_adapter(self, model) -> bool:
        if id(model) not in self._adapters:
            self._adapters[id(model)] = any(getattr(m, "lora_A", None) is not None for m in model.modules())
        return self._adapters[id(model)]

    def commit(self, n: int) -> None:
        """Keep the first n rows of the last forward (counted from the tokens the strategy passed)."""
        n, self._skipped = n - self._skipped, 0
        frm, to = self.kv.commit(n)
        self.event("kv", op="commit", from_len=frm, to_len=to)

    def rollback(self, to_len: int) -> None:
        """Forget committed slots past `to_len` (a cache about to be rebuilt)."""
        if to_len < self.kv.length:
            frm, to = self.kv.rollback(to_len)
            self.event("kv", op="rollback", from_len=frm, to_len=to)

    def keep(self, rows: list[int]) -> None:
        rows, self._skipped = [r - self._skipped for r in rows], 0
        frm, to = self.kv.keep(rows)
        self.event("kv", op="commit", from_len=frm, to_len=to)

    def verify(self, pos: list[int], drafts: list[int], p: torch.Tensor, q: torch.Tensor | None,
               proposal: Proposal, sampling: SamplingParams | None = None,
               logits: tuple[torch.Tensor, torch.Tensor | None] | None = None, forced: int = 0,
               **rule) -> ChainResult:
        """Verify `drafts` left to right against the target distributions `p` (one row per draft; `q` the
        distributions they were drawn from) by the exact rule (docs/verification.md; `sampling.verify_chain`; `rule`:
        its tau, reference, gamma; `sampling` defaults to the run's), or under the oracle by Bernoulli draws;
        the verdict becomes events. `pos[i]` is draft i's output position. Every strategy verifies here.

        `logits` = (target, draft or None): the raw rows that p and q are `process_logits(·, sampling)` of. A
        strategy that has them passes them, and on CUDA the fused kernel verifies the chain from them in one
        launch (`kernels.verify_logits`): the same rule and distribution, drawing its noise from the run's
        generator in another order, so a seeded sampled run commits other tokens than on the torch path.

        `forced`: the first drafts were drawn from the target's own distribution (q is p by construction: S2D2's
        first slot on a right-shifted model), so they are verified like the rest, but an accepted one is the
        target's token, not an accepted proposal: the strategy does not propose it and no accept reports it."""
        sampling = sampling or self.sampling
        if self.oracle_accept is not None:
            res = oracle_chain(drafts, p, q, sampling, self.gen, self.oracle_accept)
        elif logits is not None and kernels.engine_verifies_fused(logits[0]):
            res = kernels.verify_logits(drafts, logits[0], logits[1], proposal, sampling, self.gen, **rule)
        else:
            res = verify_chain(drafts, p, q, proposal, sampling, self.gen, **rule)
        self._report_chain(pos, drafts, res, forced, None if logits is None else logits[0])
        return res

    def verify_tree(self, tree: DraftTree, pending: int, src: str, forward=None) -> TreeVerdict:
        """One forward over [pending] + a draft tree (`draft_tree`: positions by depth, each node seeing its ancestors),
        the walk that verifies it, the K/V of the pending token and the accepted path kept (the rest rolled back), and
        the events: `propose` with the tree's parents, `accept` with the path's nodes, a `reject` with its node for
        each candidate the walk refused (a sibling of the path, or a child of its last node), `bonus` or `resample`. The
        caller emits the accepted tokens and the verdict's next one. `forward` (default: this context's) runs the
        forward, for a strategy that reads more of it than the logits."""
        L, start, depths = self.kv.length, self.n_out, tree.depths()
        logits = (forward or self.forward)("verify", [pending] + tree.tokens, tree.positions(L),
                                           mask=tree.attention_mask(L, device=self.device))
        self.event("propose", pos=[start - 1 + d for d in depths], tok=tree.tokens, q=[1.0] * len(tree),
                   src=src, parent=tree.parents)   # after the forward: an event belongs to the forward's step
        v = walk_tree(tree, logits, self.sampling, self.gen)
        self.keep([0] + [1 + i for i in v.accepted])
        accepted = [tree.tokens[i] for i in v.accepted]
        if accepted:
            self.event("accept", pos=list(range(start, start + len(accepted))), tok=accepted, p=v.p,
                       q=[1.0] * len(accepted), node=v.accepted)
        for node, p in v.refused:
            self.event("reject", pos=start - 1 + depths[node], tok=tree.tokens[node], p=p, q=1.0, node=node)
        self.event("bonus" if v.bonus else "resample", pos=start + len(accepted), tok=v.next_token)
        return v

    def _report_chain(self, pos: list[int], drafts: list[int], res: ChainResult, forced: int,
                      target_logits: torch.Tensor | None) -> None:
        """Accept for the accepted prefix (forced drafts left out), then reject + resample at the first rejection
        (a forced draft rejected over numerical noise included: it was verified and failed). With the raw target
        rows, each verdict carries the target's entropy there (`h`, what acceptance is analysed against)."""
        a = res.n_accepted
        verified = a + (res.correction is not None)
        h = [] if target_logits is None else entropy(target_logits[:verified])
        if a > forced:
            self.event("accept", pos=pos[forced:a], tok=drafts[forced:a], p=res.p_draft[forced:a],
                       q=res.q_draft[forced:a], **({"h": h[forced:a]} if h else {}))
        if res.correction is not None:
            self.event("reject", pos=pos[a], tok=drafts[a], p=res.p_draft[a], q=res.q_draft[a],
                       **({"h": h[a]} if h else {}))
            self.event("resample", pos=pos[a], tok=res.correction)

    # -- output ---------------------------------------------------------------------------
    @property
    def n_out(self) -> int:
        return len(self.out.token_ids)

    def emit(self, tokens: list[int]) -> list[int]:
        """Make tokens final output (stop rules apply). Returns the tokens actually taken."""
        start = self.n_out
        taken, text = self.out.append(tokens)
        if taken:
            pieces = [self.tokenizer.token_text(t) for t in taken]
            self.event("emit", pos=list(range(start, start + len(taken))), tok=taken, text=text, pieces=pieces)
        return taken


class Strategy:
    """One decoding strategy; the contract a new one implements is in docs/strategies.md ("Writing a strategy").
    Subclasses declare their parameters as dataclass fields of `Params`, implement `start` and `step`, and override
    the other hooks only where the default does not hold. The class flags below say what it needs of a model."""
    name: ClassVar[str]
    needs_mask: ClassVar[bool] = False   # proposals come from MASK rows
    # reads token-causal predictions (AR next-token rows): a model trained bidirectionally has none
    needs_causal_model: ClassVar[bool] = True
    # decodes a plain AR model (no MASK-trained attention of its own) as it is; canvas does not
    decodes_ar_models: ClassVar[bool] = True
    # samples at a schedule of its own (DiffusionGemma's temperatures): --temperature, --top-k, --top-p do not apply
    own_sampling: ClassVar[bool] = False
    # decodes with forwards of several rows: on a CPU they run on packed weight copies, made before the run's clock
    wide_forwards: ClassVar[bool] = True

    # -- its parameters
    @dataclass
    class Params:
        pass

    def __init__(self, params: dict | None = None):
        self.params = self.parse(params or {})

    @classmethod
    def parse(cls, params: dict):
        p = parse_params(f"strategy {cls.name!r}", cls.Params, params)
        cls.validate(p)
        return p

    @staticmethod
    def validate(p) -> None:
        """Raise BadInput for out-of-range parameter values."""

    # -- what it needs: checked before a run starts (session.kv_length_needed), each refusal one line
    @classmethod
    def ready_for(cls, model: str) -> bool:
        """Whether a run on the model preset `model` finds what `ready` loads by default (DFlash: a drafter shipped
        for it): the demo and the server's model list offer only such strategies."""
        return True

    def ready(self, engine) -> None:
        """Load what its runs need besides the model and its adapter (DFlash's drafter), once, before any clock starts
        (`session.prepare`); BadInput when it cannot."""

    @classmethod
    def fits(cls, config) -> bool:
        """Whether this strategy decodes a model of this kind at all (a one-line refusal, `misfit`, otherwise). A
        DiffusionGemma model (canvas attention) runs its own loop only."""
        return config.attention != "canvas" and (not cls.needs_causal_model or config.attention == "causal")

    @classmethod
    def misfit(cls, config, name: str) -> str:
        """Why `fits` is False for the model `name`."""
        if config.attention == "canvas":
            return (f"{name!r} is a DiffusionGemma model: it denoises noise canvases with its own encoder/decoder loop, "
                    f"which strategy gemma-canvas runs and {cls.name!r} does not")
        return f"strategy {cls.name!r} needs a causal model and {name!r} was trained with {config.attention} attention"

    def check_run(self, config, max_new_tokens: int) -> None:
        """Raise BadInput when this strategy cannot decode `max_new_tokens` on a model of `config` (checked before
        the run starts: one line, nothing decoded)."""

    def kv_headroom(self, config=None) -> int:
        """Slots a single forward may need beyond the committed length (`config`: the model's ModelConfig)."""
        return 1

    def graph_tokens(self) -> int | None:
        """Under CUDA graphs, the widest forward captured (None: any the cache holds). Decode-sized by default: a
        causal run's prefill varies with every prompt, and a graph per prompt length would cost more than it saves."""
        return WIDE

    # -- decoding: the prefill, then one step per `Run.advance` (each at least one forward and one emitted token)
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        """Run the prefill (and whatever the strategy folds into it); may emit tokens."""
        raise NotImplementedError

    def step(self, ctx: DecodeContext) -> None:
        """One decoding iteration: at least one forward, at least one emitted token."""
        raise NotImplementedError

    def finished(self, ctx: DecodeContext) -> bool:
        """Whether the run is over: by default once the output is (EOS, a stop string, --max-new-tokens). A canvas
        decoded to its end after an early EOS (LLaDA without early termination) goes on filling the padding."""
        return ctx.out.finished

    # -- the adapter's rows and the KV it leaves (a chat's next turn may reuse it)
    def clean_gate(self, adapter) -> bool:
        """Whether the LoRA of `adapter` (a LoadedAdapter, or None) applies at this strategy's clean (non-MASK)
        rows. A run decodes the model the adapter makes, the LoRA on the rows it adapts: on for an adapter of
        every row ("all"), off for a MASK-row one ("mask": the base model on clean tokens). So greedy output
        of a lossless strategy equals greedy `ar` on the same adapter. MASK rows are gated by the strategy."""
        return adapter is not None and adapter.adapted_rows == "all"

    def prefill_gate(self, ctx: DecodeContext) -> bool:
        """The LoRA gate of the prompt rows in this strategy's prefill (prefill chunks are written with it)."""
        return ctx.clean_gate

    def causal_kv(self, config) -> bool:
        """Whether every KV row this strategy commits is the token-causal K/V of the token in that slot, so a
        later run with the same strategy may reuse the cache as a prompt prefix (chat turns)."""
        return False

    def kv_signature(self) -> tuple:
        """Runs whose committed KV may be shared: the same strategy with the same parameters."""
        return self.name, tuple(sorted((k, repr(v)) for k, v in self.header_params().items()))

    # -- what it reports: the trace header, the exact run it approximates, the TPF a bench prints beside
    def header_params(self) -> dict:
        """The parameters a trace header records."""
        return dict(vars(self.params))

    def header_fields(self, config, max_new_tokens: int) -> dict:
        """Optional header fields a run of this strategy adds (a canvas strategy: `canvas`)."""
        return {}

    def lossless(self) -> bool:
        """Whether these parameters verify every token exactly, so the greedy output is greedy `ar`'s on the same
        model (up to near-ties of float reduction order) and a sampled run keeps its law. `tune` asserts it."""
        return False

    def exact_reference(self) -> dict | None:
        """Parameter overrides that turn this run into the exact decode it approximates (a canvas cache: cache=none),
        which a comparison runs beside it; None when the run is exact itself."""
        return None

    def expected_tpf(self, accept: float) -> float | None:
        """Tokens per forward when every verified draft is accepted with probability `accept`, where a
        closed form is known (bench --oracle-accept prints it beside the measured TPF); else None."""
        return None

    # -- how it plans: cost-aware drafting (studio.engine.strategies.drafting)
    @property
    def plans_drafts(self) -> bool:
        """Whether this run sizes its drafts by the measured forward costs (`drafting="auto"`, drafting.py)."""
        return getattr(self.params, "drafting", None) == "auto"


def entropy(logits: torch.Tensor) -> list[float]:
    """Each row's entropy in nats, of the softmax of its raw logits (temperature 1)."""
    logp = torch.log_softmax(logits.detach().float(), dim=-1)
    return (-(logp.exp() * logp).sum(-1)).tolist()
