"""DiffusionGemma read natively: a tiny random instance saved by transformers' own DiffusionGemmaForBlockDiffusion
(its key layout and config.json), loaded by the engine, against that class's encoder and canvas passes."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from studio.engine.engine import Engine
from studio.engine.families import read_config
from studio.engine.random_models import SHAPES, random_config
from studio.engine.strategies import STRATEGIES, make_strategy
from studio.engine.weights import load_hf_dir
from studio.errors import BadInput
from studio.run.session import Settings, kv_length_needed
from tests.support.hf_files import tiny_tokenizer_files

tf = pytest.importorskip("transformers")

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            top_k_experts=2, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            global_head_dim=32, num_global_key_value_heads=1, sliding_window=8, max_position_embeddings=512,
            use_bidirectional_attention="vision")   # 5 sliding layers, then a full one
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, position_embedding_size=64, patch_size=4, pooling_kernel_size=1)
CANVAS = 6


def oracle(seed=0):
    """transformers' DiffusionGemma, every gain, scale and layer scalar away from 1 (a `1 + w` or a missing scalar
    shows), matrices scaled up so the logits reach into the soft cap; one scalar set per pass."""
    torch.manual_seed(seed)
    cfg = tf.DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=CANVAS)
    cfg._attn_implementation = cfg.text_config._attn_implementation = "sdpa"
    model = tf.DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else p * (10 if "embed_tokens" in name else 2))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusiongemma")
    model = oracle()
    model.save_pretrained(path)
    tiny_tokenizer_files(path)
    return path, model


def ours(path):
    cfg, sd, _ = load_hf_dir(path)
    from studio.engine.gemma import DiffusionGemma
    model = DiffusionGemma(cfg).eval()
    model.load_state_dict(sd, strict=False)   # the head is the embedding
    return model


def positions(start, n, batch=2):
    return torch.arange(start, start + n).repeat(batch, 1)


@pytest.mark.parametrize("prompt_len", [5, 19])   # inside the sliding window of 8, and far past it
def test_the_encoder_and_canvas_passes_match_transformers(checkpoint, prompt_len):
    path, hf = checkpoint
    model = ours(path)
    g = torch.Generator().manual_seed(prompt_len)
    prompt, canvas, canvas2 = (torch.randint(0, 128, (2, n), generator=g) for n in (prompt_len, CANVAS, CANVAS))
    with torch.no_grad():
        cache = tf.DynamicCache(config=hf.config.text_config)
        want_hidden = hf.model.encoder(input_ids=prompt, past_key_values=cache).last_hidden_state
        want = hf(past_key_values=cache, decoder_input_ids=canvas).logits
        conditioned = want / 0.7   # the previous step's temperature-scaled logits
        want_sc = hf(past_key_values=cache, decoder_input_ids=canvas, self_conditioning_logits=conditioned).logits
        hf.model.encoder(input_ids=canvas, past_key_values=cache)   # commit the canvas, then the next one
        want_next = hf(past_key_values=cache, decoder_input_ids=canvas2).logits

        kv = model.new_cache(64, batch=2)
        hidden = model.encode(prompt, positions(0, prompt_len), kv)
        kv.commit(prompt_len)
        got = model(canvas, positions(prompt_len, CANVAS), kv)
        got_sc = model(canvas, positions(prompt_len, CANVAS), kv, self_conditioning=conditioned)
        assert kv.length == prompt_len   # the decoder pass only reads the cache
        model.encode(canvas, positions(prompt_len, CANVAS), kv)
        kv.commit(CANVAS)
        got_next = model(canvas2, positions(prompt_len + CANVAS, CANVAS), kv)
    assert want.abs().max() > 5   # far enough into the soft cap of 30 that a missing cap would show
    for mine, theirs in ((hidden, want_hidden), (got, want), (got_sc, want_sc), (got_next, want_next)):
        assert (mine - theirs).abs().max().item() <= 1e-4
    assert (got_sc - got).abs().max() > 1e-2   # the self-conditioning signal matters


def test_a_prompt_encoded_in_pieces_gives_the_cache_of_one_pass_and_a_canvas_reads_it_unchanged(checkpoint):
    """Causal prefix reuse (across the sliding window too): K/V committed piece by piece are those of one encoder
    pass, so a canvas over them gets the same logits; and the decoder never changes what it reads."""
    model = ours(checkpoint[0])
    g = torch.Generator().manual_seed(1)
    prompt, canvas = torch.randint(0, 128, (2, 19), generator=g), torch.randint(0, 128, (2, CANVAS), generator=g)
    with torch.no_grad():
        whole = model.new_cache(64, batch=2)
        model.encode(prompt, positions(0, 19), whole)
        whole.commit(19)
        pieces = model.new_cache(64, batch=2)
        for start, end in ((0, 3), (3, 12), (12, 19)):
            model.encode(prompt[:, start:end], positions(start, end - start), pieces)
            pieces.commit(end - start)
        first = model(canvas, positions(19, CANVAS), whole)
        again = model(canvas, positions(19, CANVAS), whole)
        from_pieces = model(canvas, positions(19, CANVAS), pieces)
    assert torch.equal(first, again)
    assert (from_pieces - first).abs().max().item() <= 1e-4   # fp32 rounding of other GEMM shapes only


def test_the_text_model_loads_without_the_vision_tower_and_other_strategies_refuse_it_in_one_line(checkpoint, tmp_path):
    path, _ = checkpoint
    sd = load_file(path / "model.safetensors")
    assert any(k.startswith("model.encoder.vision_tower.") for k in sd)   # transformers saved one; it is skipped
    engine = Engine.load(str(path), device="cpu")
    cfg = engine.config
    assert (cfg.family, cfg.attention, cfg.logit_shift, cfg.mask_token_id, cfg.block_size) == \
        ("diffusion_gemma", "canvas", False, None, CANVAS)
    assert cfg.layer_types == ["sliding"] * 5 + ["full"] and cfg.kv_geometry(5) == (1, 32)
    for name in set(STRATEGIES) - {"gemma-canvas"}:
        with pytest.raises(BadInput, match=f"DiffusionGemma model: .* which strategy gemma-canvas runs and '{name}' "
                                           "does not") as e:
            kv_length_needed(engine, make_strategy(name), Settings(max_new_tokens=4), [3, 4, 5])
        assert "\n" not in str(e.value)
    assert kv_length_needed(engine, make_strategy("gemma-canvas"), Settings(max_new_tokens=4), [3, 4, 5]) == 3 + 4 + 6
    # an unknown tensor, and a variant the engine does not run: one line each
    save_file({**sd, "model.decoder.layers.0.mystery.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tiny_tokenizer_files(tmp_path)
    with pytest.raises(BadInput, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        Engine.load(str(tmp_path), device="cpu")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["use_bidirectional_attention"] = "all"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BadInput, match="use_bidirectional_attention 'all'"):
        load_hf_dir(tmp_path)


def test_models_info_shows_the_layer_kinds_the_experts_and_the_canvas(checkpoint):
    from typer.testing import CliRunner

    from studio.cli import app
    out = CliRunner().invoke(app, ["models", "info", str(checkpoint[0])])
    assert out.exit_code == 0, out.output
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if ":" in line}
    assert lines["family"] == "diffusion_gemma (gemma4 block)" and lines["attention"].startswith("canvas")
    assert lines["layer kinds"].startswith("5 sliding-window (window 8), 1 full (heads 4/1, head_dim 32")
    assert lines["experts"].startswith("8 x ffn 32, top 2 (gemma router)")
    assert lines["mask token"].startswith("None (none: a canvas starts as uniform noise)")
    assert lines["block size"] == "6 (the canvas length)" and lines["logit softcap"] == "30"


def test_the_random_shape_is_transformers_text_model_at_the_published_sizes():
    """random:diffusiongemma-26b-a4b counts as many parameters as transformers' own class built from the same
    config.json (its text part: the vision tower has no part in a text step) -- 25.25B."""
    raw = SHAPES["diffusiongemma-26b-a4b"]
    with torch.device("meta"):
        theirs = tf.DiffusionGemmaForBlockDiffusion(tf.DiffusionGemmaConfig(
            text_config={k: v for k, v in raw["text_config"].items() if k != "model_type"}, vision_config=VISION))
        from studio.engine.gemma import DiffusionGemma
        mine = DiffusionGemma(random_config("random:diffusiongemma-26b-a4b"))
    count = lambda m: sum(p.numel() for n, p in m.named_parameters() if "vision" not in n)   # noqa: E731 (tied once)
    assert count(mine) == count(theirs) and 25.2e9 < count(mine) < 25.3e9
    cut = random_config("random:diffusiongemma-26b-a4b@2")
    assert cut.layer_types == ["sliding", "full"] and cut.mask_token_id is None   # @L keeps a full layer last
    from studio.presets import load_model_preset
    preset, published = load_model_preset("diffusiongemma-26b-a4b-it"), read_config(raw)
    assert preset.overrides == {"block_size": published.block_size, "logit_shift": published.logit_shift}
    assert (preset.strategy, preset.max_new_tokens, published.block_size) == ("diffusiongemma", 256, 256)
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    from studio.presets import load_strategy_preset
    own = load_strategy_preset(preset.strategy)   # transformers' defaults (the checkpoint's generation_config.json)
    p = make_strategy(own.strategy, own.params).params
    theirs = DiffusionGemmaGenerationConfig._get_default_generation_params()
    assert p == make_strategy("gemma-canvas").params   # they are the strategy's defaults too
    assert (own.max_new_tokens, p.max_denoising_steps, p.entropy_bound, p.t_min, p.t_max, p.stability_threshold,
            p.confidence_threshold) == (theirs["max_new_tokens"], theirs["max_denoising_steps"],
                                        theirs["sampler_config"].entropy_bound, theirs["t_min"], theirs["t_max"],
                                        theirs["stability_threshold"], theirs["confidence_threshold"])


class TransformersKV:
    """transformers' DynamicCache with the committed length a DecodeContext keeps: its encoder pass appends, its
    decoder pass only reads."""
    runner = None

    def __init__(self, hf):
        self.cache, self.length = tf.DynamicCache(config=hf.config.text_config), 0

    def commit(self, n):
        self.length += n
        return self.length - n, self.length

    def rollback(self, to_len):   # the context's first forward rolls back to what it may reuse: nothing here
        assert to_len == self.length
        return to_len, to_len


class TransformersModel:
    """transformers' DiffusionGemma behind the engine model's two passes, so the gemma-canvas strategy runs on its
    forward: checked against `generate` on identical logits (an independent forward within 1e-4 could move a sampled
    trajectory)."""

    def __init__(self, hf, config):
        self.hf, self.config, self.lm_head = hf, config, hf.lm_head

    def modules(self):
        return self.hf.modules()

    def encode(self, tokens, positions, kv):
        return self.hf.model.encoder(input_ids=tokens[None], past_key_values=kv.cache,
                                     position_ids=positions[None]).last_hidden_state

    def __call__(self, tokens, positions, kv, mask=None, lora_gate=None, logits_rows=None, self_conditioning=None):
        return self.hf(past_key_values=kv.cache, decoder_input_ids=tokens[None], decoder_position_ids=positions[None],
                       self_conditioning_logits=self_conditioning).logits


@pytest.mark.parametrize("seed, params", [
    (0, dict(max_denoising_steps=6)),                                               # 3 canvases of 6 steps, no EOS
    (2, dict(max_denoising_steps=8, entropy_bound=5.0, confidence_threshold=100.0)),   # an EOS in the third canvas
    (2, dict(max_denoising_steps=8, entropy_bound=50.0, confidence_threshold=100.0)),  # every draw kept; an EOS early
    (2, dict(max_denoising_steps=4, entropy_bound=3.0, stability_threshold=0, confidence_threshold=100.0))])   # 1 step
def test_gemma_canvas_commits_what_transformers_generate_commits_with_the_same_seed(checkpoint, seed, params):
    """The strategy on transformers' forward commits generate's tokens bit for bit (its decoder passes too); run by
    the session on the engine's own passes and KV cache, it commits the same tokens."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import DecodeContext, Output
    from studio.run.session import run_to_end
    from tests.support.tiny import TinyTokenizer
    path, hf = checkpoint
    strategy = make_strategy("gemma-canvas", params)
    p, n = strategy.params, 3 * CANVAS
    prompt = [5, 9, 17, 3, 88, 41, 7, 12, 60, 2, 33]   # longer than the sliding window of 8
    torch.manual_seed(seed)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                           max_denoising_steps=p.max_denoising_steps,
                           sampler_config=EntropyBoundSamplerConfig(entropy_bound=p.entropy_bound),
                           stability_threshold=p.stability_threshold, confidence_threshold=p.confidence_threshold,
                           t_min=p.t_min, t_max=p.t_max, pad_token_id=0, eos_token_id=1)
    new = want.sequences[0, len(prompt):].tolist()
    out = Output(TinyTokenizer(128), n, frozenset({1}))
    ctx = DecodeContext(TransformersModel(hf, load_hf_dir(path)[0]), out.tokenizer, SamplingParams(), seed, out, None,
                        0, kv=TransformersKV(hf))
    strategy.start(ctx, prompt)
    while not strategy.finished(ctx):
        strategy.step(ctx)
    decoder_passes = sum(e["t"] == "forward" and e["role"] == "draft" for e in ctx.drain())
    got = out.token_ids
    assert new[:len(got)] == got and all(t == 0 for t in new[len(got):])   # pad after an EOS
    assert want.tokens_per_forward.item() == pytest.approx(len(got) / decoder_passes)
    engine = Engine.load(str(path), device="cpu")
    engine.config = engine.model.config = dataclasses.replace(engine.config, eos_ids=[1])
    ours = run_to_end(engine, make_strategy("gemma-canvas", params), Settings(max_new_tokens=n, seed=seed), "", prompt)
    assert ours.token_ids == got
