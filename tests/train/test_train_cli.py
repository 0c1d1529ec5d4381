"""`dlm-studio train …` from the command line: bad input is one line and exit 2 before any model loads; the
whole path (data -> idlm -> eval -> run --adapter) on the embedded model."""
import json
import signal
import subprocess
import time

import pytest

from studio.engine.lora import read_adapter

from studio.train.prompts import eval_prompts
from tests.support.cli import CLI, assert_one_line_error, cli


def test_a_prompt_file_with_a_held_out_prompt_is_refused(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(f"Tell me a joke.\n{eval_prompts()[3]}\n")
    assert_one_line_error(cli("train", "data", "--out", str(tmp_path / "d"), "--prompts", str(f)),
                          "held-out evaluation prompt")


@pytest.mark.parametrize("args, needle", [
    (["idlm", "--data", "nowhere", "--out", "o"], "not a training-data directory"),
    (["idlm", "--data", "d", "--out", "o", "--gate", "rows"], "--gate must be 'mask' or 'all'"),
    (["block", "--data", "d", "--out", "o", "--time-budget", "soon"], "--time-budget"),
    (["idlm", "--data", "d", "--out", "o", "--steps", "0"], "--steps must be >= 1"),
    (["idlm", "--data", "d", "--out", "o", "--gate", "all", "--clean-loss", "mse"], "--clean-loss must be one of"),
    (["block", "--data", "d", "--out", "o", "--clean-loss", "kl"], "--clean-loss applies to --gate all"),
    (["idlm", "--data", "d", "--out", "o", "--mask-loss", "soft"], "--mask-loss must be one of"),
    (["eval", "no-such-adapter", "--n-prompts", "0"], "--n-prompts"),
    (["jacobi", "--data", "d", "--out", "o", "--schedule", "cyclic"], "--schedule must be one of"),
    (["jacobi", "--data", "d", "--out", "o", "--block-size", "8", "--rows", "4"], "--rows must hold a whole block"),
    (["jacobi", "--data", "d", "--out", "o", "--resume"], "nothing to resume in o"),
    (["jacobi", "--data", "nowhere", "--out", "o"], "not a training-data directory"),
    (["dflash", "--data", "d", "--out", "o", "--taps", "1,x"], "--taps: expected layer numbers"),
    (["dflash", "--data", "d", "--out", "o", "--block-size", "1"], "--block-size must be >= 2"),
    (["dflash", "--data", "nowhere", "--out", "o"], "not a training-data directory"),
])
def test_bad_training_arguments_are_one_line_errors(tmp_path, args, needle):
    assert_one_line_error(cli("train", *args, cwd=tmp_path), needle)


@pytest.fixture(scope="module")
def embedded_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("train") / "data"
    r = cli("train", "data", "--out", str(d), "--n-prompts", "4", "--max-new-tokens", "12", "--batch-size", "2",
            check_rc=0)
    assert "4 sequences" in r.stdout
    return d


@pytest.mark.slow
def test_data_idlm_eval_and_run_on_the_embedded_model(tmp_path, embedded_data):
    d, ad = embedded_data, tmp_path / "adapter"
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["shard_sizes"] == [4] and manifest["n_answer_tokens"] > 20
    r = cli("train", "idlm", "--data", str(d), "--out", str(ad), "--steps", "2", "--batch-size", "2", "--rows", "6",
            "--rank", "2", "--mask-loss", "kl", check_rc=0)
    assert "step 2/2 (done)" in r.stdout
    assert [json.loads(x)["step"] for x in (ad / "train_log.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((ad / "train_state.json").read_text())["config"]["mask_loss"] == "kl"   # soft targets
    r = cli("train", "eval", str(ad), "--n-prompts", "1", "--max-new-tokens", "8", "--json", check_rc=0)
    report = json.loads(r.stdout)
    assert [row["label"] for row in report["rows"]] == ["ar", "r-isd"]          # what a --gate mask adapter is for
    assert report["rows"][1]["identical_prompts"] == 1                            # lossless
    prompt = "Name two planets."
    ar = json.loads(cli("run", prompt, "-s", "ar", "--max-new-tokens", "12", "--json", check_rc=0).stdout)
    risd = json.loads(cli("run", prompt, "-s", "r-isd", "--adapter", str(ad), "--max-new-tokens", "12", "--json",
                          check_rc=0).stdout)
    assert risd["token_ids"] == ar["token_ids"] and risd["model"]["adapter"] == str(ad)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_resume_goes_on(tmp_path, embedded_data):
    """A real SIGINT mid-training: exit 130 with one line, a complete checkpoint at the last finished step,
    and --resume continues from it."""
    ad = tmp_path / "adapter"
    args = ["train", "idlm", "--data", str(embedded_data), "--out", str(ad), "--batch-size", "1", "--rows", "3",
            "--rank", "2", "--save-every", "1000"]
    proc = subprocess.Popen(CLI + args + ["--steps", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = ad / "train_log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("dlm-studio: interrupted: checkpoint saved")
    state = json.loads((ad / "train_state.json").read_text())
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    assert state["stopped"] == "interrupted" and state["step"] == steps[-1] >= 2
    read_adapter(ad)                                     # the adapter files are whole
    r = cli(*args, "--steps", str(state["step"] + 2), "--resume", check_rc=0)
    assert f"step {state['step'] + 2}/{state['step'] + 2} (done)" in r.stdout


def test_pack_writes_a_compact_shippable_copy(tmp_path):
    import torch

    from studio.presets import shipped as adapters
    from tests.support.adapters import random_mask_adapter
    from tests.support.tiny import tiny_model
    src = random_mask_adapter(tmp_path / "src", tiny_model("llama", dim=32))
    r = cli("train", "pack", str(src), str(tmp_path / "packed"), "--strategies", "r-isd,isd", check_rc=0)
    assert "in bf16" in r.stdout
    a, b = read_adapter(src), read_adapter(tmp_path / "packed")
    for name, (A, B) in a.lora.items():
        assert b.lora[name][0].dtype == torch.bfloat16
        assert torch.allclose(b.lora[name][0].float(), A, rtol=1e-2, atol=1e-3)
    assert (tmp_path / "packed" / adapters.META).read_text() == \
        'model = "default"\nstrategies = ["r-isd", "isd"]\ndescription = ""\n'
    assert_one_line_error(cli("train", "pack", str(src), str(tmp_path / "packed")), "exists")


def test_eval_measures_every_draft_slot_of_a_cost_aware_strategy():
    """train eval reports an adapter's acceptance by slot: a strategy that plans its drafts drafts every slot there,
    and one that can copy drafts from its context does not (they are not the adapter's), unless the user chose
    otherwise."""
    from studio.run.config import RunConfig
    from studio.train.evaluate import measuring_every_slot
    got = measuring_every_slot({"ar": RunConfig("ar"), "r-isd": RunConfig("r-isd"), "s2d2": RunConfig("s2d2"),
                                "blockdiff": RunConfig("blockdiff"),
                                "isd": RunConfig("isd", params={"drafting": "auto"})})
    assert got["r-isd"].params == got["s2d2"].params == {"drafting": "fixed", "lookup": 0}
    assert got["isd"].params == {"drafting": "auto", "lookup": 0}
    assert got["ar"].params == {} and got["blockdiff"].params == {}


@pytest.mark.slow
def test_train_jacobi_in_two_rounds_on_the_embedded_model(tmp_path, embedded_data):
    """Round 1 records the trajectories at n=4 and trains; round 2 answers the prompts with round 1's model,
    records at n=8 and trains on from round 1; a second call with --resume finds everything done; jacobi on the
    adapter decodes what ar on it decodes."""
    out = tmp_path / "jf"
    args = ["train", "jacobi", "--data", str(embedded_data), "--out", str(out), "--block-size", "4", "--rounds", "2",
            "--steps", "2", "--batch-size", "2", "--rows", "8", "--rank", "2"]
    r = cli(*args, check_rc=0)
    assert "round 2: training, step 2/2 (done)" in r.stdout
    log = r.stderr.splitlines()     # not a terminal: a line per recording batch and at each stage's end, no bar
    assert any(x.startswith("record n=4 4/4 · ") for x in log) and any(x.startswith("train n=8 2/2 · ") for x in log)
    first = [json.loads(x) for x in (out / "round1" / "trajectories.jsonl").read_text().splitlines()]
    second = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(first) == 4 and {len(s) for t in first for b in t["states"] for s in b} == {4}
    assert second and {len(s) for t in second for b in t["states"] for s in b} == {8}
    assert json.loads((out / "train_state.json").read_text())["config"]["init"] == str(out / "round1")
    assert json.loads((out / "round2-data" / "manifest.json").read_text())["adapter"] == str(out / "round1")
    assert read_adapter(out).adapted_rows == "all"
    assert "all rounds were done" in cli(*args, "--resume", check_rc=0).stdout
    assert_one_line_error(cli(*args), "exists and is not empty")
    prompt = "Name two planets."
    runs = [json.loads(cli("run", prompt, "-s", s, "--adapter", str(out), "--max-new-tokens", "16", "--json",
                           check_rc=0).stdout) for s in ("ar", "jacobi")]
    assert runs[0]["token_ids"] == runs[1]["token_ids"]


@pytest.mark.slow
def test_train_tc_compresses_the_shipped_canvas_adapter_s_trajectories(tmp_path, embedded_data):
    out = tmp_path / "tc"
    args = ["train", "tc", "--data", str(embedded_data), "--out", str(out), "--max-new-tokens", "16", "--min-agreement", "0",
            "--steps", "2", "--batch-size", "2"]
    r = cli(*args, check_rc=0)
    assert "4 golden trajectories of 4, step 2/2 (done)" in r.stdout
    rows = [json.loads(x) for x in (out / "golden.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(d["reveal"]) == 16 and min(d["reveal"]) >= 1 for d in rows)
    state = json.loads((out / "train_state.json").read_text())
    assert state["config"]["kind"] == "tc" and state["config"]["init"].endswith("smollm2-mdm")
    assert read_adapter(out).attention == "bidirectional"
    assert "step 2/2 (done)" in cli(*args, "--resume", check_rc=0).stdout      # nothing left to do
    run = json.loads(cli("run", "Name two planets.", "--preset", "canvas-cpu", "--adapter", str(out),
                         "--max-new-tokens", "16", "--json", check_rc=0).stdout)
    assert run["model"]["adapter"] == str(out) and run["token_ids"]


@pytest.mark.slow
def test_dflash_trains_a_drafter_that_run_eval_and_compare_read(tmp_path, embedded_data):
    """train dflash on the embedded model (the features, two steps), then the drafter in the published layout drives
    `run -s dflash --draft-model` (ar's tokens), `train eval DRAFTER` and a refusal of a model it was not made for."""
    out = tmp_path / "drafter"
    r = cli("train", "dflash", "--data", str(embedded_data), "--out", str(out), "--steps", "2", "--batch-size", "2",
            "--anchors", "2", "--block-size", "4", "--layers", "1", "--taps", "3,20", check_rc=0)
    assert "step 2/2 (done)" in r.stdout and f"--draft-model {out}" in r.stdout and "reads 8,192 tokens" in r.stdout
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [3, 20]
    prompt = "Name two planets."
    ar = json.loads(cli("run", prompt, "-s", "ar", "--max-new-tokens", "12", "--json", check_rc=0).stdout)
    run = json.loads(cli("run", prompt, "-s", "dflash", "-p", "drafting=fixed", "--draft-model", str(out),
                         "--max-new-tokens", "12", "--json", check_rc=0).stdout)
    assert run["token_ids"] == ar["token_ids"] and run["params"]["drafter"] == str(out)
    report = json.loads(cli("train", "eval", str(out), "--n-prompts", "1", "--max-new-tokens", "8", "--json",
                            check_rc=0).stdout)
    assert [row["label"] for row in report["rows"]] == ["ar", "dflash"] and report["rows"][1]["identical_prompts"] == 1
    assert_one_line_error(cli("run", prompt, "-s", "dflash", "--draft-model", str(out), "--model",
                              "random:qwen3-0.6b@1"), "wide")
    cli("train", "pack", str(out), str(tmp_path / "packed"), "--strategies", "dflash", check_rc=0)
    from studio.engine.dflash import load_drafter
    from studio.engine.lazy_tensors import read_safetensors
    packed = read_safetensors(tmp_path / "packed" / "model.safetensors")
    assert {str(t.dtype) for name, t in packed.items() if name != "draft_vocab"} == {"torch.bfloat16"}
    assert load_drafter(tmp_path / "packed").config == load_drafter(out).config
    assert load_drafter(tmp_path / "packed").vocab.tolist() == load_drafter(out).vocab.tolist()   # ids, not bf16
    # resumed with a second --data, the run computes the appended answers' features and trains on both
    r = cli("train", "dflash", "--data", str(embedded_data), "--data", str(embedded_data), "--out", str(out),
            "--steps", "3", "--batch-size", "2", "--anchors", "2", "--block-size", "4", "--layers", "1",
            "--taps", "3,20", "--resume", check_rc=0)
    assert "step 3/3 (done)" in r.stdout
    assert len(read_safetensors(out / "features" / "feat-00000.safetensors")["prompt_lens"]) == 8
