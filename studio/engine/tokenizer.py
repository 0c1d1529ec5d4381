"""Tokenizer: a `tokenizers.Tokenizer` plus the chat template and special ids (no transformers at runtime).

Two ways in:
  * `Tokenizer.from_dir(dir)`: a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`,
    optionally `chat_template.jinja`, `generation_config.json`, `config.json`), or a directory we wrote
    with `save_dir` (the model cache).
  * `Tokenizer.from_gguf_fields(fields)` / `Tokenizer.from_gguf_reader(reader)`: rebuilds the byte-level
    BPE llama.cpp describes in GGUF metadata (`tokenizer.ggml.*`).
`ByteIdTokenizer` stands in for models that come without tokenizer files (`random:` shape-only models).

The chat template is rendered the way transformers does it: a Jinja `ImmutableSandboxedEnvironment`
with trim_blocks/lstrip_blocks, `loopcontrols`, a `{% generation %}` tag that just renders its body,
`raise_exception`, `strftime_now`, a non-escaping `tojson`, and the special-token strings
(`bos_token`, `eos_token`, ...) as variables.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from studio.errors import BadInput

TOKENIZER_FORMAT = 1  # bump when save_dir's layout changes

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
# "Digits first" family: llama.cpp splits every \p{N} on its own, then applies the GPT-2 regex
# (LLAMA_VOCAB_PRE_TYPE_STARCODER / SMOLLM / ...); the HF tokenizer.json of these models is
# Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)].
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _dedupe(ids: Iterable[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i is not None and i not in out:
            out.append(int(i))
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"invalid JSON in {path}: {e}") from None
    if not isinstance(data, dict):
        raise BadInput(f"invalid JSON in {path}: expected an object")
    return data


@lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (assistant-mask tracking): render the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise BadInput(f"the model's chat template does not parse: {e}") from None


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and special ids.

    Attributes: `name`, `vocab_size` (incl. added tokens), `bos_id` (the BOS token's id, or None),
    `add_bos` (whether `encode(..., add_special_tokens=True)` prepends it), `eos_ids` (every id that
    ends a turn, first = the primary one), `special_ids` (ids of special added tokens, e.g. ChatML
    markers), `chat_template` (Jinja source or None), `bos_token`/`eos_token` (strings, for templates).
    """

    def __init__(self, tok: tokenizers.Tokenizer, *, name: str = "", chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, eos_ids: Iterable[int] = (),
                 add_bos: bool = False, extra_special: Mapping[str, str] | None = None):
        self._tok = tok
        self.name = name
        self.chat_template = chat_template or None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = bool(add_bos)
        self.extra_special = dict(extra_special or {})  # unk_token / pad_token strings, for templates
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None
        eos_from_token = tok.token_to_id(eos_token) if eos_token else None
        self.eos_ids = _dedupe([*eos_ids, *([] if eos_from_token is None else [eos_from_token])])
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._token_text: dict[int, str] = {}

    # -- text <-> ids ------------------------------------------------------------------------------
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (a lone UTF-8 fragment shows as U+FFFD), for UIs."""
        token_id = int(token_id)
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chat --------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        import jinja2

        if not self.chat_template:
            raise BadInput(f"model {self.name or '?'} has no chat template; use a plain prompt instead")
        template = _compile_template(self.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update((k, v) for k, v in self.extra_special.items() if v is not None)
        variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables.update(kwargs)
        variables.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
        try:
            return template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise BadInput(f"chat template error: {e}") from None

    # -- persistence -------------------------------------------------------------------------------
    def save_dir(self, path: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json; `from_dir` reads them back exactly."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        cfg = {
            "dlm_studio_tokenizer_format": TOKENIZER_FORMAT,
            "name": self.name,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "eos_token_ids": self.eos_ids,
            "chat_template": self.chat_template,
            **self.extra_special,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def from_dir(cls, path: str | Path, name: str | None = None) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise BadInput(f"no tokenizer.json in {path} (dlm-studio needs a fast-tokenizer file){_why_none(path)}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise BadInput(f"cannot load {tj}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        tc_path = path / "tokenizer_config.json"
        tc = _read_json(tc_path) if tc_path.is_file() else {}

        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        eos_ids: list[int] = list(_as_id_list(tc.get("eos_token_ids")))
        for fname in ("generation_config.json", "config.json"):
            f = path / fname
            if f.is_file() and "dlm_studio_tokenizer_format" not in tc:  # ours already lists them
                try:
                    data = json.loads(f.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                if isinstance(data, dict):
                    eos_ids += _as_id_list(data.get("eos_token_id"))
        extra = {k: _token_str(tc.get(k)) for k in ("unk_token", "pad_token") if _token_str(tc.get(k))}
        ours = "dlm_studio_tokenizer_format" in tc
        bos_str = _token_str(tc.get("bos_token"))
        if ours:
            add_bos = bool(tc.get("add_bos_token", False))
        else:  # in an HF tokenizer.json the post-processor decides about BOS; report what it does
            bos_id = tok.token_to_id(bos_str) if bos_str else None
            add_bos = bos_id is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(tok, name=name if name is not None else (tc.get("name") or path.name),
                   chat_template=template if isinstance(template, str) else None,
                   bos_token=bos_str, eos_token=_token_str(tc.get("eos_token")),
                   eos_ids=eos_ids, add_bos=add_bos, extra_special=extra)

    # -- GGUF --------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_reader(cls, reader, name: str = "") -> "Tokenizer":
        """From a `gguf.GGUFReader`: reads the `tokenizer.*` fields and calls `from_gguf_fields`."""
        fields: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                fields[key] = field.contents()
        return cls.from_gguf_fields(fields, name=name)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], name: str = "") -> "Tokenizer":
        """Build the tokenizer from GGUF `tokenizer.*` metadata values (keys as llama.cpp spells them)."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise BadInput(f"unsupported GGUF tokenizer {model!r}: only byte-level BPE ('gpt2') GGUFs are supported")
        tokens = fields.get("tokenizer.ggml.tokens")
        merges = fields.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise BadInput("GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
        types = list(fields.get("tokenizer.ggml.token_type") or [])

        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            spelled = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            vocab.setdefault(spelled, i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise BadInput(f"corrupt GGUF tokenizer merge {m!r}")
            pairs.append((a, b))
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))

        pre = fields.get("tokenizer.ggml.pre") or "default"
        if pre in _DIGITS_THEN_GPT2:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif pre in _SPLIT_REGEX:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:  # "gpt2", "default", unknown: plain GPT-2 regex
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()

        # Control tokens (type 3) become special added tokens so text like "<|im_end|>" stays whole.
        # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; skip it.
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        if control:
            tok.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
        if user:
            tok.add_tokens(user)

        def tok_str(key: str) -> str | None:
            i = fields.get(key)
            return tokens[int(i)] if isinstance(i, int) and 0 <= i < len(tokens) else None

        bos_token = tok_str("tokenizer.ggml.bos_token_id")
        eos_token = tok_str("tokenizer.ggml.eos_token_id")
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos_token is not None
        if add_bos:
            bos_id = vocab.get(bos_token, tokens.index(bos_token))
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B:1", special_tokens=[(bos_token, bos_id)])
        eos_ids = [fields.get("tokenizer.ggml.eos_token_id"), fields.get("tokenizer.ggml.eot_token_id"),
                   fields.get("tokenizer.ggml.eom_token_id")]
        extra = {k: v for k, v in (("unk_token", tok_str("tokenizer.ggml.unknown_token_id")),
                                   ("pad_token", tok_str("tokenizer.ggml.padding_token_id"))) if v}
        template = fields.get("tokenizer.chat_template")
        return cls(tok, name=name, chat_template=template if isinstance(template, str) else None,
                   bos_token=bos_token, eos_token=eos_token, eos_ids=[i for i in eos_ids if isinstance(i, int)],
                   add_bos=add_bos, extra_special=extra)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, bos_id={self.bos_id})"


class ByteIdTokenizer:
    """For models without tokenizer files (`random:` models): a prompt encodes to its UTF-8 byte values
    (mod the vocabulary), an id decodes to the text `<id>`. No chat template, no EOS."""
    name = "bytes"
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.token_text(i) for i in ids)

    def token_text(self, token_id: int) -> str:
        return f"<{int(token_id)}>"


def _why_none(path: Path) -> str:
    """What a directory without tokenizer.json has instead, as the tail of the one-line error."""
    tc_path = path / "tokenizer_config.json"
    try:
        tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    except (OSError, ValueError):
        tc = {}
    remote = (tc.get("auto_map") or {}).get("AutoTokenizer") if isinstance(tc, dict) else None
    if remote:
        code = remote[0] if isinstance(remote, list) else remote
        return (f": its tokenizer is remote code ({code}), which dlm-studio never runs -- save its fast tokenizer as "
                "tokenizer.json with transformers yourself, if it has one")
    if (path / "tokenizer.model").is_file():
        return ": it has only a SentencePiece tokenizer.model -- convert it to tokenizer.json with transformers first"
    return ""
