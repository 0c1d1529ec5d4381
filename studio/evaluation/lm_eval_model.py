"""The `dlm-studio` model of lm-evaluation-harness: `dlm-studio lm-eval --model dlm-studio --model_args
model=default,strategy=r-isd ...` (docs/serving.md#lm-eval).

Importing this module registers the model (lm-eval finds models only in its own registry, so its `lm_eval` command
cannot see ours: `dlm-studio lm-eval` imports this, then runs lm-eval's command line unchanged).

- `generate_until`: every strategy, through the same runs as `dlm-studio run` (the context as given: lm-eval applies
  the chat template itself with --apply_chat_template), stopping at the task's `until` strings.
- `loglikelihood`, `loglikelihood_rolling`: the log-probabilities of the model the strategy decodes (its adapter
  where the strategy's clean rows carry it), which must be causal (a bidirectional model scores nothing
  left-to-right: a clear error).
model_args: model, strategy (or a preset), preset, adapter, device, dtype, max_gen_toks; any other key is a strategy
parameter (`strategy=isd,stride=3`). lm-eval's own `--device` (`cuda`, `cuda:0`, `cpu`) is the device when model_args
name none; `dlm-studio lm-eval` passes `auto` for it when the command line does not (lm-eval's default, cuda:0, would
refuse a machine without CUDA).
"""
from __future__ import annotations

import dataclasses
import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from studio.errors import BadInput
from studio.run import mirror

GREEDY_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}


@register_model("dlm-studio")
class StudioLM(LM):
    def __init__(self, model: str = "default", strategy: str | None = None, preset: str | None = None,
                 adapter: str | None = None, device: str = "auto", dtype: str = "auto", max_gen_toks: int = 256,
                 tp: int = 1, ep: int = 1,
                 batch_size=None, **params):   # batch_size: lm-eval passes its own; runs here are one at a time
        super().__init__()
        from studio.run.config import ModelChoice, RunConfig, strategy_or_preset
        # no strategy: the preset's, else ar
        named, named_preset = strategy_or_preset(strategy) if strategy else (None if preset else "ar", None)
        if named_preset and preset:
            raise BadInput(f"strategy={strategy} is a preset: give it or preset={preset}, not both")
        self.config = RunConfig(named, preset or named_preset, params=dict(params), max_new_tokens=int(max_gen_toks))
        self.strategy, _ = self.config.build()
        self.engine = ModelChoice(str(model), None if adapter is None else str(adapter), device=device,
                                  dtype=dtype, tp=int(tp), ep=int(ep)).load()
        self.stats = {"tokens": 0, "forwards": 0, "decode_s": 0.0}

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "StudioLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "StudioLM":
        """The model from `--model_args` and lm-eval's own settings (batch size, device): a device in model_args is
        the device, lm-eval's `--device` the default (`auto`: no preference); both, differing, are refused."""
        args = dict(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        device = extra.pop("device", "auto")
        if "device" in args and device != "auto" and lm_eval_device(device) != lm_eval_device(args["device"]):
            raise BadInput(f"--model_args device={args['device']} and --device {device} disagree: give one")
        args["device"] = lm_eval_device(args.get("device", device))
        return cls(**{**extra, **args})

    # -- generation ----------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from studio.run.session import run_to_end
        out = []
        for request in tqdm(requests, desc=f"dlm-studio {self.config.label}", unit="answer", disable=disable_tqdm):
            context, kwargs = request.args
            unknown = set(kwargs) - GREEDY_KEYS
            if unknown:
                raise BadInput(f"generation argument(s) {', '.join(sorted(unknown))} are not supported")
            until = kwargs.get("until") or []
            config = dataclasses.replace(
                self.config, stop=tuple([until] if isinstance(until, str) else until),
                max_new_tokens=int(kwargs.get("max_gen_toks", self.config.max_new_tokens)),
                temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                top_p=kwargs.get("top_p") if kwargs.get("do_sample") else None)
            strategy, settings = config.build()
            result = run_to_end(self.engine, strategy, settings, context, self._encode(context))
            f = result.footer
            self.stats["tokens"] += f["n_tokens"]
            self.stats["forwards"] += f["forwards"]
            self.stats["decode_s"] += f["wall_s"] - f["prefill_s"]
            out.append(f["text"])
            self.cache_hook.add_partial("generate_until", request.args, f["text"])
        if self.stats["forwards"]:
            print(self.summary(), file=sys.stderr)
        return out

    def summary(self) -> str:
        """One line on how the answers so far were decoded (printed after each generate_until)."""
        s = self.stats
        return (f"dlm-studio {self.config.label}: {s['tokens']} tokens in {s['forwards']} forwards "
                f"(TPF {s['tokens'] / max(s['forwards'], 1):.2f}), {s['tokens'] / max(s['decode_s'], 1e-9):.1f} tok/s")

    # -- scoring -------------------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            context_ids, continuation_ids = self._split(context, continuation)
            logp, greedy = self._score(context_ids, continuation_ids)
            out.append((logp, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (logp, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            ids = self._encode(request.args[0])
            windows = get_rolling_token_windows(ids, self._prefix_id(), self.engine.config.max_seq_len, 1)
            total = 0.0
            for context_ids, target_ids in map(make_disjoint_window, windows):
                total += self._score(context_ids, target_ids)[0]
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return out

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context and the continuation as the whole text tokenizes (a word at the boundary may
        merge); the context's trailing spaces go with the continuation, as lm-eval's own models do."""
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self._prefix_id()], self._encode(continuation)
        whole, head = self._encode(context + continuation), self._encode(context)
        return head, whole[len(head):]

    @torch.inference_mode()
    def _score(self, context_ids: list[int], target_ids: list[int]) -> tuple[float, bool]:
        """log p(target | context) under the decoded model, and whether greedy decoding would produce it."""
        view = self.engine.for_strategy(self.strategy.name)
        cfg = view.config
        if cfg.attention != "causal" or not cfg.logit_shift:
            raise BadInput(f"loglikelihood needs a causal model; {self.engine.name} decodes bidirectionally: "
                           "use generate_until tasks with it")
        ids = (context_ids + target_ids)[-cfg.max_seq_len:]
        n = len(target_ids)
        logits = mirror.score_logits(view, ids, list(range(len(ids) - n - 1, len(ids) - 1)), self.strategy.clean_gate(view.lora))
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(target_ids, device=logits.device)
        return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

    # -- text ----------------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def _prefix_id(self) -> int:
        """What an empty context is conditioned on: the model's BOS, else its first EOS."""
        tok = self.engine.tokenizer
        bos = getattr(tok, "bos_id", None)
        return bos if bos is not None else self.engine.eos_ids()[0]

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.engine.tokenizer, "name", self.engine.name))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadInput(f"{self.engine.name} has no chat template: drop --apply_chat_template")
        return tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)


def lm_eval_device(device: str) -> str:
    """lm-eval's device spellings as the studio's: `cuda:0` is `cuda` (one GPU per process; `tp=N` for more)."""
    return "cuda" if str(device) == "cuda:0" else str(device)
