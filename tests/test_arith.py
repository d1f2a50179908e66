"""The arith task kind (taskkinds.py) and its data set (tasks.py): the reward reads the last number
a text writes, the data is every sum of two ranges with a fixed md5 split, and registering the
kind leaves the toy world as it was. CPU, offline, a second: `python -m pytest -q tests/test_arith.py`."""
import hashlib

import pytest

import flags
import rewards
import sweep
import taskkinds
import tasks
import toy
import workflows
from conftest import refused


@pytest.mark.parametrize("text,value", [
    ("8 + 9 = 17. The answer is 17.", 17), ("17, I think, or 2", 2), ("x = -4", -4), ("5-3", 3), ("a-1", 1),
    ("(2)-1", 1), ("The total is 1,234.", 1234), ("1, 234", 234), ("2.50", 2.5), ("result: -12.", -12),
    ("12345", 12345), ("no number here", None), ("", None)])
def test_last_number_is_the_last_number_written(text, value):
    assert rewards.last_number(text) == value


def test_the_reward_is_1_only_when_the_last_number_is_the_answer():
    p = {"id": "arith-12+5", "prompt": "What is 12 + 5?", "source": "arith", "kind": "arith", "answer": "17"}
    texts = ["12 + 5 = 17.", "The answer is 17.0", "17 is the answer, I checked it 2 times", "\\boxed{17}",
             "12 + 5 = 17. 17 + 1 = 18", "seventeen", "12 + 5 = 71"]
    assert taskkinds.score(texts, [p] * len(texts), "arith") == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert rewards.number_reward("-3", "-3") == 1.0 and rewards.number_reward("3", "-3") == 0.0


def test_the_data_is_every_sum_split_by_an_md5_of_its_unordered_pair():
    train, test = tasks.load_task("arith", "train"), tasks.load_task("arith", "test")
    (a0, a1), (b0, b1) = tasks.ARITH
    assert len(train) + len(test) == (a1 - a0 + 1) * (b1 - b0 + 1)
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    assert 0.32 < len(test) / (len(train) + len(test)) < 0.48          # ARITH_TEST_SHARE of 256, about 40%
    for r in train + test:
        tasks.validate(r)
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert r["answer"] == str(a + b) and r["kind"] == "arith" and r["id"] == f"arith-{a}+{b}"
        pair = f"{min(a, b)}+{max(a, b)}"
        assert (hashlib.md5(pair.encode()).digest()[0] < tasks.ARITH_TEST_SHARE) == (r in test)
    # no held-out sum has its commuted twin in the training split (a split by the text leaked 93 of 161)
    train_ids = {r["id"] for r in train}
    assert [r["id"] for r in test if "arith-{1}+{0}".format(*r["id"].removeprefix("arith-").split("+")) in train_ids] == []
    assert tasks.load_task("arith", "test") == test                      # fixed, in one order
    assert tasks.task_kind("arith") == "arith"


def test_a_record_without_an_integer_answer_is_refused():
    base = {"id": "a", "prompt": "What is 1 + 1?", "source": "x", "kind": "arith"}
    for answer in (None, "", "two", "1.5"):
        with pytest.raises(ValueError, match="'answer' must be an integer"):
            tasks.validate({**base, "answer": answer})
    assert taskkinds.kind_of({**base, "answer": "2"}) == "arith"
    assert taskkinds.kind_of({"answer": "2"}) == "math"                 # no kind field: the answer marks math


def test_the_kind_runs_every_workflow_at_real_scales_and_none_in_the_toy_world(tmp_path, capsys):
    for wf in workflows.WORKFLOWS:
        workflows.check_run(wf, "arith")                                # every role has an instruction written for it
    assert workflows.instruction("generator", "arith") == taskkinds.GENERATOR_ARITH
    assert workflows.instruction("aggregator", "arith") == taskkinds.AGGREGATOR_MATH
    args = flags.parse_args(["--scale", "0.6b", "--task", "arith", "--out", str(tmp_path / "r")])
    assert (args.data, args.max_new_tokens) == ("arith", taskkinds.ARITH_MAX_NEW_TOKENS)
    assert refused(capsys, ["--task", "arith", "--out", str(tmp_path / "t")]) == (   # once, with the way out
        "error: --task arith has no data in the toy world, which knows math and code alone; run it on a real model, "
        "e.g. --scale smollm2-135m --data FILE (a .jsonl of arith records; README, Forking) (see python train.py --help)")
    assert "only know the toy tasks" in refused(capsys, ["--task", "arith", "--data", "arith", "--out", str(tmp_path / "t")])


def test_the_kind_leaves_the_toy_world_as_it_was():
    """The toy vocabulary holds the built-in math and code phrases alone: the arith instruction
    is not a token of it (and the shipped models' keys, tests/test_toy.py, are unchanged)."""
    assert taskkinds.GENERATOR_ARITH not in toy.phrases()
    assert set(toy.phrases()) == set(workflows.phrases(kinds=toy.BUILT_IN_KINDS, registered=False))
    assert taskkinds.GENERATOR_ARITH not in toy.build_tokenizer().get_vocab()


def test_a_sweep_runs_arith_only_where_it_has_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sweep.parse_args(["--dry-run"])[0].tasks == ["math", "code"]
    assert sweep.parse_args(["--dry-run", "--scale", "0.6b"])[0].tasks == ["math", "code", "arith"]
