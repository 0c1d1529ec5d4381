"""A session runs one strategy on one prompt: seeding, stop rules, timing, the event stream and
the trace. Everything a front end shows comes out of here as events (DESIGN §2.2)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from studio import events as ev
from studio.engine.engine import Engine
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, Strategy
from studio.errors import BadInput


@dataclass
class Settings:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RunResult:
    header: dict
    events: list[dict]
    footer: dict
    token_ids: list[int]

    def summary(self) -> dict:
        """The `run --json` object (DESIGN §2.1)."""
        f, h = self.footer, self.header
        return {"text": f["text"], "token_ids": self.token_ids, "n_tokens": f["n_tokens"],
                "forwards": f["forwards"], "tpf": f["tpf"], "accept_rate": f["accept_rate"],
                "wall_s": f["wall_s"], "tok_s": f["tok_s"], "prefill_s": f["prefill_s"],
                "strategy": h["strategy"], "params": h["params"], "model": h["model"], "stop_reason": f["stop_reason"]}


def encode_prompt(engine: Engine, text: str, chat: bool = True) -> list[int]:
    tok = engine.tokenizer
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


class Session:
    def __init__(self, engine: Engine, strategy: Strategy, settings: Settings):
        self.engine, self.strategy, self.settings = engine, strategy, settings

    def header(self, prompt_text: str, prompt_ids: list[int]) -> dict:
        s = self.settings
        params = dict(self.strategy.header_params(), temperature=s.sampling.temperature, top_k=s.sampling.top_k,
                      top_p=s.sampling.top_p, max_new_tokens=s.max_new_tokens)
        return {"strategy": self.strategy.name, "params": params, "model": self.engine.model_meta(),
                "tokenizer": self.engine.tokenizer_meta(), "prompt": {"text": prompt_text, "token_ids": prompt_ids},
                "seed": s.seed}

    def _check(self, prompt_ids: list[int]) -> int:
        cfg, s = self.engine.config, self.settings
        if not prompt_ids:
            raise BadInput("the prompt is empty")
        if self.strategy.needs_mask and cfg.mask_token_id is None:
            raise BadInput(f"strategy {self.strategy.name!r} needs a MASK token and model {self.engine.name!r} has "
                           "none: give an adapter that adds one or a model preset with mask_token_id")
        kv_len = len(prompt_ids) + s.max_new_tokens + self.strategy.kv_headroom(cfg)
        if len(prompt_ids) >= cfg.max_seq_len:
            raise BadInput(f"the prompt is {len(prompt_ids)} tokens, longer than the model's context "
                           f"of {cfg.max_seq_len}")
        if kv_len > cfg.max_seq_len:
            raise BadInput(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens ({s.max_new_tokens}) exceeds the "
                           f"model's context of {cfg.max_seq_len}; lower --max-new-tokens")
        return kv_len

    def run(self, prompt_text: str, prompt_ids: list[int], sinks: list[Callable[[dict], None]] = (),
            trace_path: str | None = None) -> RunResult:
        """Generate; every event goes to each sink (between steps, never inside timed work)."""
        kv_len = self._check(prompt_ids)
        s, engine = self.settings, self.engine
        header = self.header(prompt_text, prompt_ids)
        writer = ev.TraceWriter(trace_path, header) if trace_path else None
        out = Output(engine.tokenizer, s.max_new_tokens, frozenset(engine.eos_ids()), tuple(s.stop))
        ctx = DecodeContext(engine.model, engine.tokenizer, s.sampling, s.seed, out,
                            engine.config.mask_token_id, kv_len)
        events: list[dict] = []

        def publish() -> None:
            for e in ctx.drain():
                events.append(e)
                if writer:
                    writer.write(e)
                for sink in sinks:
                    sink(e)

        t0 = time.perf_counter()
        self.strategy.start(ctx, prompt_ids)
        prefill_s = time.perf_counter() - t0
        prefill_tokens = len(out.token_ids)
        publish()
        decode_s = 0.0
        while not out.finished:
            t = time.perf_counter()
            self.strategy.step(ctx)
            decode_s += time.perf_counter() - t
            publish()
        decoded = len(out.token_ids) - prefill_tokens
        footer = dict(ev.summarize(events), stop_reason=out.stop_reason, prefill_s=prefill_s,
                      wall_s=prefill_s + decode_s, tok_s=decoded / decode_s if decode_s > 0 else 0.0)
        if writer:
            writer.close(footer)
        return RunResult(header=header, events=events, footer=footer, token_ids=list(out.token_ids))
