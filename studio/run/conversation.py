"""A multi-turn conversation whose history keeps its committed KV between turns (see `Conversation`)."""
from __future__ import annotations

from studio.engine.engine import Engine
from studio.engine.strategies import Strategy
from studio.run.session import CANCELLED, Run, RunResult, Settings, encode_messages, prepare


class Conversation:
    """A multi-turn chat: the messages so far, and the committed KV of the history kept between turns,
    so that a turn prefills only the tokens after the longest prefix it shares with the cached history.

    The cache is reused only by a strategy whose committed KV is token-causal (`Strategy.causal_kv`) and
    with the same strategy and parameters as the turn that filled it; otherwise, or after `reset`, the
    turn prefills the whole history. An edited history shares a shorter prefix and so re-prefills from
    the first changed token. `chat=False` concatenates the messages without the chat template.
    """

    def __init__(self, engine: Engine, chat: bool = True):
        self.engine, self.chat = engine, chat
        self.messages: list[dict] = []
        self.turns: list[RunResult] = []
        self._kv = None            # the cache after the last turn, its committed slots = _kv_ids
        self._kv_ids: list[int] = []
        self._kv_key: tuple | None = None

    def reset(self) -> None:
        self.messages, self.turns = [], []
        self._kv, self._kv_ids, self._kv_key = None, [], None

    def start_turn(self, user_text: str, strategy: Strategy, settings: Settings,
                   trace_path: str | None = None) -> Run:
        """The run of the assistant's answer to `user_text`. When it finishes, both messages join the
        history; a run that fails, is never finished, or is cancelled before its first token (during a long
        prefill) leaves the history as it was (keeping the prompt's KV computed so far, for a resend)."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        ids = encode_messages(self.engine, messages, self.chat)
        key = (strategy.kv_signature(), self.engine.for_strategy(strategy.name).adapter)
        kv, self._kv = self._kv, None          # the run owns the cache until it finishes
        if kv is not None and key == self._kv_key and strategy.causal_kv(self.engine.config):
            shared = 0
            for a, b in zip(self._kv_ids, ids):
                if a != b:
                    break
                shared += 1
            kv.rollback(min(shared, len(ids) - 1))   # at least the last prompt token is recomputed
        else:
            kv = None

        def finished(run: Run) -> None:
            answered = bool(run.out.token_ids) or run.out.stop_reason != CANCELLED
            if answered:
                self.messages = messages + [{"role": "assistant", "content": run.out.text}]
                self.turns.append(run.result)
            cache = run.keep_cache()
            # committed slots hold (prompt + output) in order; a commit past the output (drafts after an EOS) is dropped
            valid = min(cache.length, len(ids) + len(run.out.token_ids))
            cache.rollback(valid)
            self._kv, self._kv_ids, self._kv_key = cache, (ids + run.out.token_ids)[:valid], key
        return Run(prepare(self.engine, strategy), settings, user_text, ids, trace_path=trace_path, kv=kv,
                   on_finish=finished)
