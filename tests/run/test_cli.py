"""The CLI end to end, as scripts call it: output contracts, traces, exit codes for bad input."""
import json
import os
import shutil

import pytest
import torch

from studio.run.config import RunConfig
from studio.events import read_trace
from studio.presets import list_presets, load_strategy_preset
from tests.support.adapters import random_mask_adapter
from tests.support.cli import assert_one_line_error, cli
from tests.support.tiny import tiny_model

@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ar", "isd"])
def test_run_json_and_trace_agree(tmp_path, strategy):
    trace = tmp_path / "t.jsonl"
    r = cli("run", "List three colors.", "-s", strategy, "--max-new-tokens", "24", "--temperature", "1.0",
            "--seed", "3", "--json", "--trace", str(trace), check_rc=0)
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "n_tokens", "forwards", "tpf", "accept_rate", "wall_s", "tok_s",
                        "strategy", "params", "model", "stop_reason"}
    assert out["strategy"] == strategy and out["model"]["name"] == "default"
    assert out["n_tokens"] == len(out["token_ids"]) > 0
    t = read_trace(trace)
    for key in ("text", "n_tokens", "forwards", "tpf", "accept_rate", "wall_s", "tok_s", "stop_reason"):
        assert t.footer[key] == out[key], key
    assert t.header["prompt"]["text"] == "List three colors." and t.header["strategy"] == strategy
    assert [tok for e in t.events if e["t"] == "emit" for tok in e["tok"]] == out["token_ids"]


@pytest.mark.slow
def test_run_streams_text_and_reports_metrics():
    r = cli("run", "What is the capital of France?", "-s", "isd", "--max-new-tokens", "16", check_rc=0)
    assert "Paris" in r.stdout
    assert "[isd]" in r.stderr and "TPF" in r.stderr and "forwards" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("preset, strategy", [("isd-n4", "isd"), ("r-isd-n4", "r-isd")])
def test_preset_sets_paper_configuration(preset, strategy):
    r = cli("run", "Hi", "--preset", preset, "--max-new-tokens", "8", "--json", check_rc=0)
    out = json.loads(r.stdout)
    params = out["params"]
    assert out["strategy"] == strategy
    assert (params["stride"], params["temperature"], params["top_k"], params["top_p"]) == (4, 1.0, 50, 0.95)


@pytest.mark.parametrize("preset", list_presets("strategies"))
def test_every_strategy_preset_builds_a_run(preset):
    """`run --preset NAME` for every file in presets/strategies: it parses, names a strategy and its params validate."""
    strategy, settings = RunConfig(None, preset=preset).build()
    assert strategy.name == load_strategy_preset(preset).strategy
    assert settings.max_new_tokens >= 1


def test_unknown_strategy_is_exit_2():
    assert_one_line_error(cli("run", "hi", "-s", "beam-search"), "unknown strategy", "beam-search")


def test_missing_weights_is_exit_2(tmp_path):
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--model", str(tmp_path / "nope")), "not found")


def test_corrupt_weights_are_exit_2(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--model", str(bad)), str(bad))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                               "hidden_size": 8, "num_hidden_layers": 1,
                                               "num_attention_heads": 2, "intermediate_size": 8}))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--model", str(d)), "safetensors")


@pytest.mark.slow
def test_prompt_longer_than_context_is_exit_2():
    assert_one_line_error(cli("run", "word " * 9000, "-s", "ar"), "longer than the model's context")


def test_bad_sampling_and_params_are_exit_2():
    assert_one_line_error(cli("run", "hi", "-s", "isd", "--param", "stride=1"), "stride")
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--top-p", "1.5"), "top_p")
    assert_one_line_error(cli("run", "hi", "--preset", "no-such-preset"), "unknown strategy preset")
    # an explicit 0 is a value, not "unset": bench refuses it as run does rather than measuring 64 tokens
    assert_one_line_error(cli("bench", "-s", "ar", "--max-new-tokens", "0", "--prompts", "bench/ordinary-prompts.txt"),
                          "--max-new-tokens must be >= 1")


@pytest.mark.slow
def test_bad_canvas_runs_are_exit_2():
    """On the embedded model: canvas without the adapter that makes it a diffusion model, an empty canvas, blocks
    that do not tile it, a confidence bar or an edit bar outside [0, 1]."""
    assert_one_line_error(cli("run", "hi", "-s", "canvas", "--adapter", "none"), "is an AR model")
    assert_one_line_error(cli("run", "hi", "-s", "canvas", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1")
    assert_one_line_error(cli("run", "hi", "-s", "canvas", "-p", "block_size=8", "--max-new-tokens", "12"),
                          "not a multiple of the block size 8")
    assert_one_line_error(cli("run", "hi", "-s", "canvas", "-p", "threshold=1.5"), "threshold must be in [0, 1]")
    assert_one_line_error(cli("run", "hi", "-s", "blockdiff", "-p", "edit_threshold=-0.1"), "edit_threshold")


def test_no_prompt_is_usage_error():
    r = cli("run")
    assert r.returncode == 2 and "Traceback" not in r.stderr


# -------------------------------------------------------------------------------------------------
# jacobi-mr and r-isd from the command line
# -------------------------------------------------------------------------------------------------
def recycled_accepts(events) -> list[tuple[int, int]]:
    """(pos, tok) accepted from a recycled n-gram candidate: proposed by a propose{src: ngram} earlier in the same
    step, and not by that step's own Jacobi drafts (so the candidate's chain is what the step committed)."""
    proposed: dict[tuple[int, str], set] = {}
    out = []
    for e in events:
        if e["t"] == "propose":
            proposed.setdefault((e["step"], e["src"]), set()).update(zip(e["pos"], e["tok"]))
        elif e["t"] == "accept":
            ngram, own = proposed.get((e["step"], "ngram"), set()), proposed.get((e["step"], "jacobi"), set())
            out += [pt for pt in zip(e["pos"], e["tok"]) if pt in ngram and pt not in own]
    return out


@pytest.mark.slow
def test_jacobi_mr_recycles_ngrams_on_a_numbered_list(tmp_path):
    trace = tmp_path / "mr.jsonl"
    r = cli("run", "Write a numbered list from 1 to 20.", "-s", "jacobi-mr", "--preset", "jacobi-mr-cpu",
            "-p", "drafting=fixed", "--max-new-tokens", "80", "--json", "--trace", str(trace), check_rc=0)
    out = json.loads(r.stdout)
    assert out["strategy"] == "jacobi-mr" and (out["params"]["block_size"], out["params"]["pool_size"]) == (8, 2)
    assert out["tpf"] > 1.0, out                              # measured 2.11 (80 tokens, 38 forwards)
    t = read_trace(trace)
    assert t.footer["tpf"] == out["tpf"]
    assert any(e["t"] == "propose" and e["src"] == "ngram" for e in t.events)
    assert len(recycled_accepts(t.events)) > 0                # measured 12 tokens


@pytest.fixture(scope="module")
def embedded_adapter(tmp_path_factory, default_engine):
    """A random adapter (LoRA on q/k/v/o/gate/up/down + a MASK row) saved for the embedded model's shapes."""
    return random_mask_adapter(tmp_path_factory.mktemp("adapter") / "random", default_engine.model, seed=0)


@pytest.mark.slow
def test_risd_with_an_adapter_follows_greedy_ar(embedded_adapter):
    prompt = "Write a numbered list of five fruits."
    ar = json.loads(cli("run", prompt, "-s", "ar", "--max-new-tokens", "32", "--json", check_rc=0).stdout)
    risd = json.loads(cli("run", prompt, "-s", "r-isd", "--adapter", str(embedded_adapter), "--max-new-tokens", "32",
                          "--json", check_rc=0).stdout)
    assert risd["token_ids"] == ar["token_ids"] and risd["text"] == ar["text"]
    assert risd["strategy"] == "r-isd" and risd["model"]["adapter"] == str(embedded_adapter)
    assert ar["model"]["adapter"] is None


def _other_model(path, adapter):
    random_mask_adapter(path, tiny_model("llama", dim=48))   # a tiny model: hidden 48, not 576


def _no_weights(path, adapter):
    shutil.copytree(adapter, path)
    (path / "adapter_model.safetensors").unlink()


def _corrupt(path, adapter):
    shutil.copytree(adapter, path)
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:4096])


@pytest.mark.slow
@pytest.mark.parametrize("make, needle", [(_other_model, "does not fit this model"),
                                          (_no_weights, "has no adapter_model.safetensors"),
                                          (_corrupt, "corrupt safetensors")])
def test_wrong_adapter_is_exit_2(tmp_path, embedded_adapter, make, needle):
    make(tmp_path / "bad", embedded_adapter)
    assert_one_line_error(cli("run", "hi", "-s", "r-isd", "--adapter", str(tmp_path / "bad")), needle)


def test_generation_commands_share_one_declaration_of_each_option():
    """run, chat, tui, web, compare and bench take the shared options from studio.run.options, each with its help
    text (compare and bench once redeclared some without), less the ones a command cannot use."""
    import typer.main

    from studio.cli import app
    from studio.run.options import MODEL_OPTIONS, RUN_OPTIONS
    left_out = {"web": {"draft_model", "draft_adapter"}, "compare": {"param"},
                "bench": {"draft_model", "draft_adapter", "param", "raw"}}
    commands = typer.main.get_command(app).commands
    for name in ("run", "chat", "tui", "web", "compare", "bench"):
        params = {p.name: p for p in commands[name].params}
        for option, (_, declared) in {**MODEL_OPTIONS, **RUN_OPTIONS}.items():
            if option in left_out.get(name, ()):
                assert option not in params, (name, option)
                continue
            assert params[option].help and params[option].help == declared.help, (name, option)
            assert params[option].opts[0] == declared.param_decls[0].split("/")[0], (name, option)


def test_the_strategy_option_s_help_names_every_registered_strategy():
    from studio.engine.strategies import STRATEGIES
    from studio.run.options import STRATEGY
    named = STRATEGY.help.split(", or a strategy preset")[0].split(", ")
    assert named == list(STRATEGIES)


def test_strategy_option_names_a_strategy_or_a_preset():
    """`-s` takes a preset as compare's list does; a preset given twice is refused; nothing given is ar."""
    from studio.errors import BadInput
    from studio.run.options import RUN_OPTIONS, run_config
    values = {name: option.default for name, (_, option) in RUN_OPTIONS.items()}
    config = run_config("isd-n4", values)
    strategy, _ = config.build()
    assert (config.strategy, config.preset, config.label, strategy.name) == (None, "isd-n4", "isd-n4", "isd")
    assert strategy.header_params()["stride"] == 4
    with pytest.raises(BadInput, match="not both"):
        run_config("isd-n4", {**values, "preset": "isd-n3"})
    assert (run_config(None, values).resolved()[0], run_config("jacobi", values).strategy) == ("ar", "jacobi")
    assert run_config(None, values).build()[0].name == "ar"


def test_a_model_preset_names_the_strategy_and_length_a_run_takes_when_none_is_given():
    """LLaDA refuses ar: its preset's run is canvas (LLaDA's own pipeline) for 128 tokens; anything on the command
    line, or a strategy preset's own length, comes first. The model preset is read once, when the run is built."""
    from studio.run.options import RUN_OPTIONS, run_config
    values = {**{name: option.default for name, (_, option) in RUN_OPTIONS.items()}, "model": "llada-8b-instruct"}
    plain = run_config(None, values)
    assert (plain.strategy, plain.label, plain.build()[0].name, plain.build()[1].max_new_tokens) == \
        (None, "canvas", "canvas", 128)
    assert plain.use("ar").build()[1].max_new_tokens == 128   # a strategy picked later keeps the model's length
    assert (run_config("s2d2", values).strategy, run_config("s2d2", values).build()[1].max_new_tokens) == ("s2d2", 128)
    assert run_config(None, {**values, "max_new_tokens": 7}).build()[1].max_new_tokens == 7
    preset = run_config("simsd-b4", values)
    assert (preset.preset, preset.max_new_tokens, preset.length_given()) == ("simsd-b4", None, None)
    from studio.presets import load_strategy_preset
    assert preset.build()[1].max_new_tokens == (load_strategy_preset("simsd-b4").max_new_tokens or 128)


def test_the_presets_offered_for_a_model_are_those_made_for_its_family(tmp_path):
    """The pickers (TUI, web, the server's model list) offer a family's own pipelines only for that family: LLaDA2's
    generate() is not offered for SmolLM2, LLaDA's for LLaDA2; a preset naming no family goes with any model its
    strategy fits."""
    from studio.engine.config import ModelConfig
    from studio.errors import BadInput
    from studio.presets import load_strategy_preset
    from studio.run.config import presets_for

    def config(**kw):
        return ModelConfig(arch="llama", vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4,
                           ffn_dim=8, **kw)
    smol = presets_for(config())
    assert {"isd-n4", "r-isd-n4", "jacobi-mr-cpu", "canvas-cpu", "simsd-cpu"} <= set(smol)
    assert not {"llada", "llada2", "llada21", "dinfer-credit", "dream-entropy", "diffusiongemma"} & set(smol)
    llada = presets_for(config(family="llada", attention="bidirectional", logit_shift=False, mask_token_id=15))
    assert {"llada", "fast-dllm-dual", "dinfer-threshold", "s2d2-d2f"} <= set(llada)
    assert not {"llada2", "dream-entropy", "diffusiongemma", "isd-n4"} & set(llada)   # isd needs a causal model
    assert load_strategy_preset("llada2").families == ("llada2",) and load_strategy_preset("isd-n4").families == ()
    bad = tmp_path / "bad-families.toml"
    bad.write_text('strategy = "ar"\nfamilies = "llada"\n')
    with pytest.raises(BadInput, match="families must be a list of strings"):
        load_strategy_preset(str(bad))


def test_models_list_lines_up_every_section():
    """Each section's rows start their second and third columns at one offset (a preset name longer than the
    column, `diffusiongemma-26b-a4b-it`, pushed its row out of line)."""
    out = cli("models", "list", check_rc=0).stdout
    for section in out.split("\n\n"):
        title, *lines = section.strip("\n").splitlines()
        starts = {len(line) - len(line[2 + len(line.split()[0]):].lstrip()) for line in lines}
        assert len(starts) == 1, (title, lines)


def test_models_info_describes_any_random_shape_without_building_it():
    """Every shape at once and in little memory (an 8B or 100B shape built in fp32 was killed for memory), its
    parameter count what the built model has (checked on the shapes whose one-layer cut can be built here)."""
    import subprocess
    import sys

    from studio.engine.memory import parameter_count
    from studio.engine.random_models import SHAPES, build_random, random_config
    for name in SHAPES:
        cfg = random_config(f"random:{name}@1")
        if parameter_count(cfg) * 4 > 2 ** 30:
            continue
        model = build_random(cfg, torch.device("cpu"), torch.float32)
        assert parameter_count(cfg) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()), name
    # each `models info` in a parent of its own, which reads its child's peak memory
    peak = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(r.stdout); print('peak', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    for name in ("llada2-flash", "diffusiongemma-26b-a4b", "llada-8b"):
        out = subprocess.run([sys.executable, "-c", peak, sys.executable, "-m", "studio", "models", "info",
                              f"random:{name}"], capture_output=True, text=True, timeout=120).stdout
        assert f"parameters:    {parameter_count(random_config(f'random:{name}')) / 1e6:.1f} M" in out, out
        assert int(out.rsplit("peak ", 1)[1]) < 2 ** 20, out   # KiB: under 1 GiB


def test_a_random_shape_too_large_for_the_memory_is_refused_before_it_is_built(monkeypatch):
    from studio.engine import engine as engine_module
    from studio.errors import BadInput
    monkeypatch.setattr(engine_module, "ram_bytes", lambda: 2 ** 30)
    with pytest.raises(BadInput, match=r"random:qwen3-0.6b: its weights take 2\.\d GiB in float32, more than this "
                                       r"machine's 1\.0 GiB"):
        engine_module.Engine.load("random:qwen3-0.6b", device="cpu")
    assert engine_module.Engine.load("random:qwen3-0.6b@1", device="cpu").config.n_layers == 1   # what fits loads


def test_a_file_model_too_large_for_the_memory_is_refused_before_its_tensors_are_read(monkeypatch, tmp_path):
    """A checkpoint directory whose fp32 weights and one run's KV cache exceed the memory: one line, before any
    tensor is read or the model built; a GGUF likewise before it is dequantised."""
    from studio.engine import engine as engine_module, gguf_file
    from studio.engine.memory import KV_CHECK_TOKENS, kv_bytes, parameter_count
    from studio.errors import BadInput
    from tests.support.fuzzing import gguf_bytes, tiny_gguf_spec
    from tests.support.hf_files import write_hf_dir
    write_hf_dir(tmp_path / "m")
    cfg = engine_module.Engine.load(str(tmp_path / "m"), device="cpu").config
    need = parameter_count(cfg) * 4 + kv_bytes(cfg, min(cfg.max_seq_len, KV_CHECK_TOKENS))
    monkeypatch.setattr(engine_module, "ram_bytes", lambda: need - 1)
    monkeypatch.setattr(engine_module, "model_class", lambda cfg: pytest.fail("the model was built"))
    with pytest.raises(BadInput, match=r"m: its weights take 0\.0 GiB in float32 \(as they are read, before any "
                                       r"--dtype\) and a \d+-token run's KV cache 0\.0 GiB, more than this machine's"):
        engine_module.Engine.load(str(tmp_path / "m"), device="cpu")
    monkeypatch.undo()
    monkeypatch.setattr(engine_module, "ram_bytes", lambda: need)   # exactly enough: it loads
    assert engine_module.Engine.load(str(tmp_path / "m"), device="cpu").config == cfg
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(gguf_bytes(*tiny_gguf_spec("llama"))[0])
    monkeypatch.setattr(gguf_file, "ram_bytes", lambda: 1)
    monkeypatch.setattr(gguf_file, "_dequantised", lambda *a: pytest.fail("the GGUF was dequantised"))
    with pytest.raises(BadInput, match=r"m\.gguf: its weights take .* in float32, more than this machine's"):
        gguf_file.read_gguf(gguf)
