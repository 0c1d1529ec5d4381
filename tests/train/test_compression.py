"""Trajectory compression (dInfer App. C.1): a canvas run's trajectory from its events and the compressed-transition
batches (`train tc` on the embedded model: tests/train/test_train_cli.py)."""
from __future__ import annotations

import json

import pytest
import torch

from studio.train.compression import CanvasTrajectory, Compression, agreement, record, trajectory_of
from studio.train.data import Sequence
from studio.train.objectives import IGNORE

MASK, EOS = 99, 7


def test_a_trajectory_records_the_step_that_revealed_each_canvas_position():
    events = [{"t": "forward"}, {"t": "unmask", "pos": [2], "tok": [11]},
              {"t": "forward"}, {"t": "unmask", "pos": [0, 1], "tok": [12, 13]},
              {"t": "forward"}, {"t": "unmask", "pos": [3, 1], "tok": [EOS, 50]}]   # a revealed one stays
    t = trajectory_of([1, 2], events, canvas_len=5, fill=EOS)
    assert t.tokens == [1, 2, 12, 13, 11, EOS, EOS] and t.prompt_len == 2
    assert t.reveal == [2, 2, 1, 3, 3] and t.steps == 3          # the never-revealed last cell: EOS, last step
    assert agreement([12, 13, 11, 8], [12, 0, 11]) == pytest.approx(2 / 3)


def test_a_batch_feeds_state_a_and_targets_what_was_revealed_between_a_and_b():
    """Input: the canvas after a steps (later reveals MASKed); targets: the positions revealed in steps a+1..b, each
    on the row before it; over draws every pair a < b of the 5 states comes up."""
    reveal = [3, 1, 4, 2, 2, 4]
    t = CanvasTrajectory([5, 6, 7] + [20, 21, 22, 23, 24, 25], 3, reveal)
    objective = Compression(MASK, [EOS], shift=True)
    gen = torch.Generator().manual_seed(0)
    pairs = set()
    for _ in range(200):
        batch = objective.make_batch([t], 0, 0.0, gen)
        masked = [i for i in range(6) if batch.tokens[0, 3 + i] == MASK]
        a = next(a for a in range(5) if masked == [i for i in range(6) if reveal[i] > a])
        jumped = [i for i in range(6) if batch.targets[0, 2 + i] != IGNORE]
        b = max(reveal[i] for i in jumped)
        assert jumped == [i for i in range(6) if a < reveal[i] <= b]
        assert all(batch.targets[0, 2 + i] == 20 + i for i in jumped)
        assert batch.n_answer == len(jumped) and batch.tokens[0, :3].tolist() == [5, 6, 7]
        pairs.add((a, b))
    assert pairs == {(a, b) for a in range(5) for b in range(a + 1, 5)}


def test_golden_trajectories_are_judged_on_the_canvas_and_rejudged_on_resume(tmp_path):
    """A canvas run answers at most canvas_len tokens, so it is held to the data's answer cut to the canvas (a full
    match keeps it at min_agreement 1 however long the data's answer is); the file keeps every run's agreement, and
    a resumed call with another threshold keeps what that threshold keeps without running anything again."""
    canvas = 4
    seqs = [Sequence([1, 2] + [10, 11, 12, 13, 14, 15, 16, EOS], 2),       # data answers longer than the canvas
            Sequence([3, 4] + [20, 21, 22, 23, 24, 25, 26, EOS], 2)]
    answers = {(1, 2): [10, 11, 12, 13], (3, 4): [20, 21, 0, 0]}           # agreement 1 and 1/2

    def run_one(prompt):
        answer = answers[tuple(prompt)]
        return answer, [{"t": "forward"}, {"t": "unmask", "pos": list(range(canvas)), "tok": answer}]

    path = tmp_path / "golden.jsonl"
    kept, tried = record(run_one, seqs, canvas, EOS, 1.0, path)
    assert tried == 2 and [t.tokens[2:] for t in kept] == [[10, 11, 12, 13]]
    assert [json.loads(x)["agreement"] for x in path.read_text().splitlines()] == [1.0, 0.5]

    def never(prompt):
        raise AssertionError("a recorded run was run again")

    assert len(record(never, seqs, canvas, EOS, 0.5, path)[0]) == 2


def test_recording_stops_at_its_deadline_and_resumes_where_it_stopped(tmp_path):
    seqs = [Sequence([1, p, 10, EOS], 2) for p in range(5)]
    ran = []

    def run_one(prompt):
        ran.append(prompt[1])
        return [10], [{"t": "forward"}, {"t": "unmask", "pos": [0], "tok": [10]}]

    path = tmp_path / "golden.jsonl"
    assert record(run_one, seqs, 1, EOS, 0.5, path, deadline=0.0) == ([], 0)      # past: nothing starts
    assert record(run_one, seqs[:2], 1, EOS, 0.5, path)[1] == 2
    kept, tried = record(run_one, seqs, 1, EOS, 0.5, path)
    assert tried == 5 and len(kept) == 5 and ran == [0, 1, 2, 3, 4]
