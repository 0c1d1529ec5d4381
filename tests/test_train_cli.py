"""`dlm-studio train …` from the command line: bad input is one line and exit 2 before any model loads; the
whole path (data -> idlm -> eval -> run --adapter) on the embedded model."""
import json

import pytest

from studio.train.prompts import eval_prompts
from tests.test_cli import assert_one_line_error, cli


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
    (["eval", "no-such-adapter", "--n-prompts", "0"], "--n-prompts"),
])
def test_bad_training_arguments_are_one_line_errors(tmp_path, args, needle):
    assert_one_line_error(cli("train", *args, cwd=tmp_path), needle)


@pytest.mark.slow
def test_data_idlm_eval_and_run_on_the_embedded_model(tmp_path):
    d, ad = tmp_path / "data", tmp_path / "adapter"
    r = cli("train", "data", "--out", str(d), "--n-prompts", "4", "--max-new-tokens", "12", "--batch-size", "2",
            check_rc=0)
    assert "4 sequences" in r.stdout
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["shard_sizes"] == [4] and manifest["n_answer_tokens"] > 20
    r = cli("train", "idlm", "--data", str(d), "--out", str(ad), "--steps", "2", "--batch-size", "2", "--rows", "6",
            "--rank", "2", check_rc=0)
    assert "step 2/2 (done)" in r.stdout
    assert [json.loads(x)["step"] for x in (ad / "train_log.jsonl").read_text().splitlines()] == [1, 2]
    r = cli("train", "eval", str(ad), "--n-prompts", "1", "--max-new-tokens", "8", "--json", check_rc=0)
    report = json.loads(r.stdout)
    assert [row["label"] for row in report["rows"]] == ["ar", "r-isd"]          # what a --gate mask adapter is for
    assert report["rows"][1]["identical_prompts"] == 1                            # lossless
    prompt = "Name two planets."
    ar = json.loads(cli("run", prompt, "-s", "ar", "--max-new-tokens", "12", "--json", check_rc=0).stdout)
    risd = json.loads(cli("run", prompt, "-s", "r-isd", "--adapter", str(ad), "--max-new-tokens", "12", "--json",
                          check_rc=0).stdout)
    assert risd["token_ids"] == ar["token_ids"] and risd["model"]["adapter"] == str(ad)
