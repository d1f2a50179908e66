"""Tests of toy.py: the character tokenizer, the toy problems and their splits, the role
transcripts with their slips, and the cached warm-start folder.

Anything that needs a built model builds it with tiny settings (2 steps, batch 4) in a
temporary cache, never the default warm start. The sandbox is used for a few code problems
only. CPU, offline, about 10 s: `python -m pytest -q tests/test_toy.py`.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import policies  # noqa: E402
import rewards  # noqa: E402
import runfolder  # noqa: E402
import taskkinds  # noqa: E402
import tasks  # noqa: E402
import toy  # noqa: E402
import workflows as wf  # noqa: E402

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the code sandbox needs Linux")
TASKS = ("math", "code")
TINY = {"steps": 2, "batch": 4}   # warm-start settings small enough for a test


@pytest.fixture(scope="module")
def tok():
    return toy.build_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _function(code_text):
    """The f defined by the python block of a (trusted, toy-written) solution."""
    env = {}
    exec(rewards.last_code_block(code_text), env)
    return env["f"]


def _same_function(a, b):
    # toy functions are linear in x (only +, -, * by constants), so two points decide
    return all(a(x) == b(x) for x in (0, 1))


def _exact(problem):
    return toy.code_solution(problem["ops"], random.Random(0), slip=0.0)


# ----------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------


def test_every_character_is_one_distinct_token(tok):
    ids = []
    for c in toy.CHARS:
        one = _ids(tok, c)
        assert len(one) == 1, repr(c)
        assert tok.decode(one) == c
        ids += one
    assert len(set(ids)) == len(toy.CHARS)  # no character falls back to the unknown token
    assert tok.convert_ids_to_tokens(_ids(tok, "1234567890")) == list("1234567890")  # digits never merge
    assert len(_ids(tok, "-17*305")) == 7


def test_every_phrase_and_word_is_one_token(tok):
    """The toy world's phrases (the built-in math and code kinds' and the headers), not every
    registered kind's: arith, or a fork's kind, is spelled in characters."""
    assert set(toy.phrases()) < set(wf.phrases())
    for text in list(toy.phrases()) + toy.WORDS:
        one = _ids(tok, text)
        assert len(one) == 1, repr(text)
        assert tok.decode(one) == text
    # the longer word wins over its prefix, and a numeric box is the word plus characters
    assert len(_ids(tok, "\\boxed{Incorrect}")) == 1
    assert tok.convert_ids_to_tokens(_ids(tok, "\\boxed{-12}")) == ["\\boxed{", "-", "1", "2", "}"]
    assert tok.convert_ids_to_tokens(_ids(tok, "Step 2 looks wrong.")) == ["Step ", "2", " looks wrong."]


def test_token_ids_do_not_depend_on_the_hash_seed():
    """Python seeds str hashing per process, so a set's order changes from run to run; the
    vocabulary (and so a fresh warm start) must not."""
    code = ("import json, sys; sys.path.insert(0, '.'); import toy; "
            "print(json.dumps(sorted(toy.build_tokenizer().get_vocab().items())))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    vocabs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert vocabs[0] == vocabs[1] and len(vocabs[0]) > 100


def test_special_tokens_eos_pad_and_chat_template(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in toy.SPECIAL:
        assert len(_ids(tok, t)) == 1
    assert tok.eos_token_id == _ids(tok, "<|im_end|>")[0] != tok.pad_token_id == _ids(tok, "<|endoftext|>")[0]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Problem:\n1+2*3"}]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nProblem:\n1+2*3<|im_end|>\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == body
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == body + "<|im_start|>assistant\n"
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    # the role headers are single tokens too: <|im_start|> and "system\n" are two tokens
    assert tok.convert_ids_to_tokens(_ids(tok, rendered))[:2] == ["<|im_start|>", "system\n"]
    assert tok.convert_ids_to_tokens(_ids(tok, rendered))[-2:] == ["<|im_start|>", "assistant\n"]


@pytest.mark.parametrize("task", TASKS)
def test_rendered_transcripts_round_trip(tok, task):
    rng = random.Random(1)
    train = toy.problems(task, "train")
    for role in toy.ROLE_MIX:
        msgs, target = toy.transcript(rng.choice(train), task, role, rng)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) + target + "<|im_end|>"
        ids = _ids(tok, text)
        assert tok.decode(ids) == text, role
        # every fixed phrase costs one token: far fewer tokens than characters
        assert len(ids) < len(text) - sum(len(m["content"]) for m in msgs if m["role"] == "system") + 10


# ----------------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,total,share", [("math", 9 ** 3 * 2 ** 2, 0.2), ("code", 27 ** 2 + 27 ** 3, 0.1)])
def test_splits_are_disjoint_fixed_and_of_the_documented_share(kind, total, share):
    train, test = toy.problems(kind, "train"), toy.problems(kind, "test")
    ids_train, ids_test = {p["id"] for p in train}, {p["id"] for p in test}
    assert len(ids_train) == len(train) and len(ids_test) == len(test)  # ids are unique
    assert not ids_train & ids_test
    assert len(train) + len(test) == total
    assert share - 0.03 < len(test) / total < share + 0.03
    if kind == "math":
        assert len(test) >= 512  # enough to judge a 10-point gain
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    for split, ids in (("train", ids_train), ("test", ids_test)):
        for seed in (0, 1, 7):
            assert {p["id"] for p in toy.problems(kind, split, seed=seed)} == ids  # seed: order only


@pytest.mark.parametrize("kind", ["math", "code"])
def test_seed_orders_and_n_truncates(kind):
    a, b, c = (toy.problems(kind, "test", seed=s) for s in (3, 3, 4))
    assert [p["id"] for p in a] == [p["id"] for p in b]
    assert [p["id"] for p in a] != [p["id"] for p in c]
    assert [p["id"] for p in toy.problems(kind, "test", n=5, seed=3)] == [p["id"] for p in a[:5]]
    # records are copies: editing one does not change the next call
    a[0]["prompt"] = "edited"
    assert toy.problems(kind, "test", seed=3)[0]["prompt"] != "edited"


@pytest.mark.parametrize("kind", ["math", "code"])
def test_records_are_valid_tasks_and_load_task_serves_them(kind):
    for split in ("train", "test"):
        for p in toy.problems(kind, split, n=200):
            tasks.validate(p)
            assert p["source"] == f"toy_{kind}" and p["id"].startswith(f"toy_{kind}/")
            assert ("answer" in p) == (kind == "math")
    got = tasks.load_task(f"toy_{kind}", "test", n=4, seed=2)
    assert [p["id"] for p in got] == [p["id"] for p in toy.problems(kind, "test", n=4, seed=2)]
    assert tasks.task_kind(f"toy_{kind}") == kind


def test_math_answers_are_python_arithmetic():
    for split in ("train", "test"):
        for p in toy.problems("math", split):
            assert re.fullmatch(r"[1-9][-+*][1-9][-+*][1-9]", p["prompt"])
            assert p["answer"] == str(eval(p["prompt"]))
            # the exact written solution reaches the same answer, one true step per line
            sol = toy.math_solution(p["prompt"], random.Random(0), slip=0.0)
            assert wf.last_boxed(sol) == p["answer"]


def test_code_prompt_matches_its_exact_solution():
    p = next(p for p in toy.problems("code", "train") + toy.problems("code", "test")
             if p["ops"] == (("+", 2), ("*", 3)))
    assert p["prompt"] == "f(x): add 2, times 3"
    assert _exact(p) == "```python\ndef f(x):\n    return (x+2)*3\n```"
    # every exact solution passes its own check(): operator precedence is right in all shapes
    for q in toy.problems("code", "train", seed=0)[:1500] + toy.problems("code", "test", seed=0)[:500]:
        env = {}
        exec(q["tests"]["test"], env)
        env["check"](_function(_exact(q)))


@linux_only
def test_code_solutions_through_the_real_sandbox():
    probs = toy.problems("code", "test", n=3, seed=5)
    rng = random.Random(0)
    slipped = []
    for p in probs:  # a solution with every operation slipped, until it is a different function
        while True:
            s = toy.code_solution(p["ops"], rng, slip=1.0)
            if not _same_function(_function(s), _function(_exact(p))):
                break
        slipped.append(s)
    texts = [_exact(p) for p in probs] + slipped
    assert taskkinds.score(texts, probs + probs, "code") == [1.0] * 3 + [0.0] * 3
    assert rewards.code_reward(_exact(probs[0]), probs[0]["tests"]) == 1.0


def test_bad_kind_or_split_raises():
    with pytest.raises(ValueError, match="kind"):
        toy.problems("physics", "train")
    with pytest.raises(ValueError, match="split"):
        toy.problems("math", "dev")


# ----------------------------------------------------------------------------------------
# Transcripts
# ----------------------------------------------------------------------------------------


def _user(msgs):
    return msgs[1]["content"]


@pytest.mark.parametrize("task", TASKS)
def test_every_role_transcript_parses(task):
    rng = random.Random(0)
    train = toy.problems(task, "train")
    rounds = taskkinds.get(task).rounds
    for role in toy.ROLE_MIX:
        for _ in range(60):
            p = rng.choice(train)
            msgs, target = toy.transcript(p, task, role, rng)
            assert [m["role"] for m in msgs] == ["system", "user"]
            assert _user(msgs).startswith(f"{wf.PROBLEM}\n{p['prompt']}\n") or _user(msgs) == f"{wf.PROBLEM}\n{p['prompt']}"
            system = taskkinds.get(task).revision() if role == "reviser" else wf.instruction(role, task)
            assert msgs[0]["content"] == system
            if role == "aggregator":   # 3 solutions (Voting's default) or 1-8, for any --n-voters
                n = _user(msgs).count("\nSolution ")
                k, fallback = wf.parse_choice(target, n)
                assert 1 <= n <= 8 and not fallback and 1 <= k <= n
            elif role == "evaluator":
                _, fallback = wf.parse_verdict(target)
                assert not fallback
                n_attempts = _user(msgs).count(wf.ATTEMPT)
                assert 1 <= n_attempts <= rounds and _user(msgs).count(wf.FEEDBACK) == n_attempts - 1
            elif role == "orchestrator":
                strategies, fallback = wf.parse_strategies(target)
                assert not fallback and 1 <= len(strategies) <= 3
            else:  # generator, reviser, worker, synthesizer write a solution
                if task == "math":
                    assert wf.last_boxed(target) is not None
                    assert re.fullmatch(r"-?\d+", wf.last_boxed(target))
                else:
                    assert rewards.last_code_block(target) is not None
                    _function(target)  # it defines f
                if role == "reviser":  # an Eval-Opt revision: 1..R earlier attempts, each judged wrong
                    n_attempts = _user(msgs).count(wf.ATTEMPT)
                    assert 1 <= n_attempts <= rounds and _user(msgs).count(wf.FEEDBACK) == n_attempts
                    assert _user(msgs).count("\\boxed{Incorrect}") == n_attempts
                if role == "worker":
                    assert f"\n{wf.STRATEGY}\n" in _user(msgs)
                if role == "synthesizer":
                    assert 1 <= _user(msgs).count("\nSolution ") <= 3
    with pytest.raises(ValueError, match="role"):
        toy.transcript(train[0], task, "critic", rng)


def test_math_slips_per_step():
    rng = random.Random(0)
    train = toy.problems("math", "train")
    n, wrong, steps, bad_steps = 2000, 0, 0, 0
    n_steps = None
    for _ in range(n):
        p = rng.choice(train)
        _, target = toy.transcript(p, "math", "generator", rng)
        wrong += wf.last_boxed(target) != p["answer"]
        lines = target.split("\n")[:-1]
        n_steps = sum(c in "+-*" for c in p["prompt"][1::2])  # one line per operator
        assert len(lines) == n_steps
        for line in lines:
            lhs, rhs = line.split("=")
            steps += 1
            bad_steps += eval(lhs) != int(rhs)
    assert abs(bad_steps / steps - toy.SLIP["math"]) < 0.03
    # a wrong answer needs at least one slipped step (two slips rarely cancel)
    expected = 1 - (1 - toy.SLIP["math"]) ** n_steps
    assert abs(wrong / n - expected) < 0.05, (wrong / n, expected)


def test_code_slips_per_operation():
    rng = random.Random(5)
    train = toy.problems("code", "train")
    n, wrong, expected = 1500, 0, 0.0
    for _ in range(n):
        p = rng.choice(train)
        _, target = toy.transcript(p, "code", "generator", rng)
        wrong += not _same_function(_function(target), _function(_exact(p)))
        expected += 1 - (1 - toy.SLIP["code"]) ** len(p["ops"])  # one chance to slip per operation
    # a slip that moves a constant past 1..9 is clamped back (a no-op), so a little below
    assert abs(wrong / n - expected / n) < 0.05, (wrong / n, expected / n)


@pytest.mark.parametrize("task", TASKS)
def test_evaluator_verdicts_are_true_at_rate_judge(task):
    rng = random.Random(3)
    train = toy.problems(task, "train")
    n, agree = 1000, 0
    for _ in range(n):
        p = rng.choice(train)
        msgs, target = toy.transcript(p, task, "evaluator", rng)
        attempt = _user(msgs).rsplit(wf.ATTEMPT + "\n", 1)[1]  # the last attempt is judged
        if task == "math":
            truth = wf.last_boxed(attempt) == p["answer"]
        else:
            truth = _same_function(_function(attempt), _function(_exact(p)))
        verdict, _ = wf.parse_verdict(target)
        agree += verdict == truth
    assert abs(agree / n - toy.JUDGE) < 0.05, agree / n


def test_aggregator_follows_the_majority_at_rate_pick():
    rng = random.Random(4)
    train = toy.problems("math", "train")
    split, majority = 0, 0
    for _ in range(5000):
        p = rng.choice(train)
        msgs, target = toy.transcript(p, "math", "aggregator", rng)
        sols = re.split(r"\nSolution \d:\n", _user(msgs))[1:]
        answers = [wf.last_boxed(s) for s in sols]
        assert 1 <= len(sols) <= 8 and None not in answers
        if len(sols) != 3:
            continue  # the rate is measured on Voting's default, 3 solutions
        if sorted(map(answers.count, answers)) != [1, 2, 2]:
            continue  # only a 2-1 split tells a majority pick from a random one
        k, _ = wf.parse_choice(target, 3)
        split += 1
        majority += answers.count(answers[k - 1]) == 2
    # the majority with prob PICK, else a uniform pick, which is the majority 2 times in 3
    expected = toy.PICK + (1 - toy.PICK) * 2 / 3
    assert split > 500 and abs(majority / split - expected) < 0.04, (majority / split, expected)


@pytest.mark.parametrize("task", TASKS)
def test_sft_batch_packs_transcripts_and_masks_only_their_completions(tok, task):
    ids, pos, attn, loss_mask, segments = toy.sft_batch(tok, task, random.Random(0), 12)
    R, L = ids.shape
    assert pos.shape == loss_mask.shape == (R, L) and attn.shape == (R, 1, L, L) and R < 12   # packed
    assert sum(map(len, segments)) == 12
    for r, spans in enumerate(segments):
        row, m = ids[r].tolist(), loss_mask[r].tolist()
        for a, b in spans:
            assert pos[r, a:b].tolist() == list(range(b - a))            # each counts from 0
            block = attn[r, 0, a:b]
            assert bool(block[:, a:b].equal(torch.ones(b - a, b - a, dtype=torch.bool).tril()))  # causal, itself
            assert not block[:, :a].any() and not block[:, b:].any()      # and nothing else
            first = m.index(1, a)
            assert m[a:first] == [0] * (first - a) and m[first:b] == [1] * (b - first)   # one completion
            assert tok.decode(row[a:first]).endswith("<|im_start|>assistant\n")
            assert row[b - 1] == tok.eos_token_id                        # the stop token is learned
        end = spans[-1][1]
        assert row[end:] == [tok.pad_token_id] * (L - end) and not any(m[end:])   # no loss on padding


def test_packed_rows_give_each_transcript_its_own_logits(tok):
    ids, pos, attn, _, segments = toy.sft_batch(tok, "math", random.Random(1), 6)
    torch.manual_seed(0)
    model = toy.new_model(tok).eval()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, attention_mask=attn).logits
        r = next(r for r, spans in enumerate(segments) if len(spans) > 1)
        for a, b in segments[r]:
            alone = model(input_ids=ids[r:r + 1, a:b]).logits[0]
            assert torch.allclose(packed[r, a:b], alone, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Warm start and the model folder
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cache folder, model folder) of a tiny math warm start in a temporary cache."""
    cache = str(tmp_path_factory.mktemp("cache"))
    mp = pytest.MonkeyPatch()
    mp.setattr(toy, "CACHE", cache)
    try:   # the warm start runs on one thread itself (toy.one_thread)
        folder = toy.model_folder("math", TINY, quiet=True)
    finally:
        mp.undo()
    return cache, folder


def test_model_folder_loads_with_policies(built, tok):
    from transformers import Qwen3ForCausalLM
    cache, folder = built
    assert os.path.dirname(folder) == os.path.join(cache, "toy")
    assert os.path.basename(folder) == f"math-{toy._key('math', {**toy.WARM, **TINY})}"
    model, loaded = policies.load(folder)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.hidden_size == toy.MODEL["hidden_size"]
    assert model.config.vocab_size == len(loaded) == len(tok)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.2e6
    # the saved tokenizer is the built one: same ids, template, eos and pad
    msgs, target = toy.transcript(toy.problems("math", "train", n=1)[0], "math", "evaluator", random.Random(0))
    text = loaded.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert _ids(loaded, text + target) == _ids(tok, text + target)
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert policies.stop_ids(model, loaded) == sorted(_ids(tok, "<|im_end|><|endoftext|>"))
    # one thread: for a model this small, OpenMP threads waiting on a core that another
    # process keeps busy cost ~50x the work itself (measured: 4 s vs 0.06 s a step)
    with toy.one_thread():
        out = model.generate(**loaded(text, return_tensors="pt", add_special_tokens=False), max_new_tokens=3,
                             do_sample=False)
    assert out.shape[1] <= len(_ids(tok, text)) + 3


def test_model_folder_is_cached_and_keyed_by_every_setting(built, monkeypatch):
    cache, folder = built
    monkeypatch.setattr(toy, "CACHE", cache)
    config = os.path.join(folder, "config.json")
    mtime = os.path.getmtime(config)
    # only the finished folder is there: no .tmp build folder left behind (checked before any
    # further call, since a new build attempt clears its own stale .tmp first)
    assert _entries(cache) == [os.path.basename(folder)]

    def no_build(task, warm, quiet=False):
        raise RuntimeError(f"rebuild {task} {warm}")

    monkeypatch.setattr(toy, "warm_start", no_build)
    assert toy.model_folder("math", TINY, quiet=True) == folder   # a hit: no training
    assert os.path.getmtime(config) == mtime
    with pytest.raises(RuntimeError, match="rebuild"):
        toy.model_folder("math", {**TINY, "steps": 3}, quiet=True)   # other warm setting
    with pytest.raises(RuntimeError, match="rebuild"):
        toy.model_folder("code", TINY, quiet=True)                   # other task
    with pytest.raises(RuntimeError, match="rebuild"):
        toy.model_folder("math", TINY, force=True, quiet=True)       # forced
    monkeypatch.setitem(toy.SLIP, "math", toy.SLIP["math"] + 0.1)
    with pytest.raises(RuntimeError, match="rebuild"):
        toy.model_folder("math", TINY, quiet=True)                   # other transcript setting
    monkeypatch.undo()
    assert toy._key("math", {**toy.WARM, **TINY}) != toy._key("math", {**toy.WARM, **TINY, "lr": 1e-3})
    assert toy._key("math", {**toy.WARM, **TINY}) != toy._key("code", {**toy.WARM, **TINY})
    # failed rebuild attempts leave nothing behind and do not touch the cached folder
    assert _entries(cache) == [os.path.basename(folder)]
    assert os.path.isfile(config)


def _entries(cache):
    """What the toy cache holds, but for the lock files builders and readers share."""
    return sorted(n for n in os.listdir(os.path.join(cache, "toy")) if not n.endswith(".lock"))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ENV = {"OMP_NUM_THREADS": "1", "MARL_TOY_WARM": json.dumps(TINY), "PYTHONPATH": ROOT}

# a toy build whose publish pauses (PAUSE: after moving the old model aside) or dies (KILL: by
# SIGKILL at that point, or inside the delete of the old model)
BUILDER = """
import os, shutil, signal, sys, time
import toy
point = sys.argv[1]
real_replace, real_rmtree = os.replace, shutil.rmtree


def replace(a, b):
    real_replace(a, b)
    if ".old" in str(b):   # the complete model moved aside: the middle of the publish
        print("aside", flush=True)
        if point == "pause":
            time.sleep(3)
        elif point == "kill-aside":
            os.kill(os.getpid(), signal.SIGKILL)


def rmtree(path, *a, **k):
    if point == "kill-delete" and ".old" in str(path) and os.path.isdir(path):
        os.remove(os.path.join(path, "config.json"))   # halfway through deleting the old model
        os.kill(os.getpid(), signal.SIGKILL)
    real_rmtree(path, *a, **k)


os.replace, shutil.rmtree = replace, rmtree
print(toy.model_folder("math", force=point != "build", quiet=True), flush=True)
"""


def builder(cache, point):
    return subprocess.Popen([sys.executable, "-c", BUILDER, point], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **TINY_ENV, "MARL_CACHE": cache})


def test_processes_that_need_the_toy_model_at_once_build_it_once(tmp_path):
    cache = str(tmp_path)
    procs = [builder(cache, "build") for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    assert sum(err.count("toy: building") for _, err in outs) == 1
    assert len({out.strip() for out, _ in outs}) == 1 and _entries(cache) == [os.path.basename(outs[0][0].strip())]


@pytest.fixture(scope="module")
def one_build(tmp_path_factory):
    """A cache holding one whole tiny toy model, built by a builder process; tests copy it."""
    cache = str(tmp_path_factory.mktemp("one_build"))
    assert builder(cache, "build").wait(timeout=240) == 0
    return cache


def copy_of(cache, tmp_path):
    shutil.copytree(cache, tmp_path / "cache", ignore=shutil.ignore_patterns("*.lock"))
    return str(tmp_path / "cache")


def test_a_reader_in_the_middle_of_a_rebuild_loads_a_whole_model(one_build, tmp_path, monkeypatch):
    cache = copy_of(one_build, tmp_path)
    second = builder(cache, "pause")          # a forced rebuild, paused inside its publish
    assert second.stdout.readline().strip() == "aside"
    monkeypatch.setattr(toy, "CACHE", cache)
    monkeypatch.setenv("MARL_TOY_WARM", json.dumps(TINY))
    model, tok = policies.load("toy")          # waits for the publish, then loads the new model
    assert model.config.vocab_size == len(tok) and second.wait(timeout=60) == 0


@pytest.mark.parametrize("point", ["kill-aside", "kill-delete"])
def test_a_kill_inside_a_publish_leaves_a_cache_the_next_run_uses_or_rebuilds(one_build, tmp_path, monkeypatch, point):
    cache = copy_of(one_build, tmp_path)
    dying = builder(cache, point)
    assert dying.wait(timeout=240) == -signal.SIGKILL
    monkeypatch.setattr(toy, "CACHE", cache)
    monkeypatch.setenv("MARL_TOY_WARM", json.dumps(TINY))
    model, tok = policies.load("toy")
    assert model.config.vocab_size == len(tok)
    assert len(_entries(cache)) == 1 or point == "kill-delete"   # at most a deleted model's leftover


def test_model_folder_rejects_a_bad_task(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="math or code"):
        toy.model_folder("physics", TINY)
    assert not os.path.exists(tmp_path / "toy")


def test_cache_location_follows_marl_cache(tmp_path):
    env = {**os.environ, "MARL_CACHE": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", "import toy; print(toy.CACHE)"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path)


def test_make_clip_keeps_head_and_tail_within_the_budget():
    import rollout
    import toy
    tok = toy.build_tokenizer()
    text = "".join(str(i % 10) for i in range(300)) + "\\boxed{42}"
    clip = rollout.make_clip(tok, 40)
    short = clip(text)
    head, _, tail = short.partition("\n[... ")
    assert text.startswith(head) and tail.split("...]\n", 1)[1] and text.endswith(tail.split("...]\n", 1)[1])
    assert len(tok(head + tail.split("...]\n", 1)[1])["input_ids"]) == 40 and short.endswith("\\boxed{42}")
    assert clip("short") == "short" and rollout.make_clip(tok, None)(text) == text


def test_a_build_on_a_rank_other_than_0_writes_a_whole_model(tmp_path, monkeypatch):
    # under torchrun any rank may win the build lock; transformers' save_pretrained would write
    # no weights on rank 1, so the toy folder writes its files itself
    import transformers.distributed.mixin as mixin
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True, raising=False)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1, raising=False)
    monkeypatch.setattr(toy, "CACHE", str(tmp_path))
    folder = toy.model_folder("math", TINY, quiet=True)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    monkeypatch.undo()
    model, tok = policies.load(folder)
    assert model.config.vocab_size == len(tok) and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_the_build_is_the_same_model_with_one_and_two_threads(tmp_path):
    """The warm start runs on one thread whatever the caller's count, so two builds of one key,
    one under 1 thread and one under 2, write the same weights bit for bit."""
    warm = json.dumps({"steps": 6, "batch": 24})
    code = "import torch, sys, toy; torch.set_num_threads(int(sys.argv[1])); print(toy.model_folder('math', quiet=True))"
    builds = [subprocess.Popen([sys.executable, "-c", code, threads], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": threads, "MARL_TOY_WARM": warm,
                                    "PYTHONPATH": ROOT, "MARL_CACHE": str(tmp_path / threads)})
              for threads in ("1", "2")]   # side by side, each into a cache of its own
    digests = []
    for build, (out, err) in zip(builds, [build.communicate(timeout=300) for build in builds]):
        assert build.returncode == 0, err[-1500:]
        digests.append(runfolder.file_sha256(os.path.join(out.strip(), "model.safetensors")))
    assert digests[0] is not None and digests[0] == digests[1]


def test_the_warm_start_trains_on_one_thread(monkeypatch):
    seen = []
    monkeypatch.setattr(toy, "_warm_start", lambda *a: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        toy.warm_start("math", {**toy.WARM, **TINY})
        assert seen == [1] and torch.get_num_threads() == 2   # and the caller's count is back after
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------
# The shipped models (toy_models/): one toy world on every machine

def test_every_shipped_model_is_the_one_the_code_would_build():
    """The code's key for each shipped setting is the manifest's: a changed transcript, phrase or
    setting without a rebuild fails here, naming the command that rebuilds the model."""
    entries = toy.manifest()
    assert {"math", "code"} <= set(entries), "toy_models/ ships the default math and code models"
    for name, entry in entries.items():
        key = toy._key(entry["task"], entry["warm"])
        assert key == entry["key"], (f"toy_models/{name} is stale: the code's key is {key}, the shipped model's "
                                     f"{entry['key']}; rebuild it with `{toy.ship_command(entry)}` and commit it")
        assert toy.model_folder(entry["task"], entry["warm"]) == os.path.join(toy.SHIPPED, name)
        assert toy.ship_command(entry) == entry["command"]


def test_the_default_settings_load_the_shipped_models_without_a_warm_start(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "CACHE", str(tmp_path))     # an empty cache
    monkeypatch.setattr(toy, "warm_start", lambda *a, **k: pytest.fail("a warm start ran"))
    monkeypatch.delenv("MARL_TOY_WARM", raising=False)
    for task in TASKS:
        folder = toy.model_folder(task)
        assert folder == os.path.join(toy.SHIPPED, task)
        sha = runfolder.file_sha256(os.path.join(folder, "model.safetensors"))
        assert sha == toy.manifest()[task]["files"]["model.safetensors"]
    assert toy.model_folder("math", toy.settings(seed=1)) == os.path.join(toy.SHIPPED, "math-seed1")
    assert not os.path.exists(tmp_path / "toy")


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """toy_models/ copied into a temporary folder that toy.SHIPPED points to."""
    shutil.copytree(toy.SHIPPED, tmp_path / "toy_models", ignore=shutil.ignore_patterns("*.lock", ".*"))
    monkeypatch.setattr(toy, "SHIPPED", str(tmp_path / "toy_models"))
    return tmp_path / "toy_models"


@pytest.mark.parametrize("damage", ["edit", "delete"])
def test_a_damaged_shipped_file_is_refused_in_one_line(shipped_copy, damage):
    path = shipped_copy / "math" / ("model.safetensors" if damage == "edit" else "tokenizer.json")
    if damage == "edit":
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with pytest.raises(ValueError) as e:
        policies.load("toy")
    msg = str(e.value)
    assert "\n" not in msg and ("is not the shipped file" if damage == "edit" else "is missing") in msg
    assert "git checkout -- toy_models/math" in msg and "python toy.py --task math --ship" in msg


def test_ship_writes_a_model_and_its_manifest_entry_that_loading_then_takes(tmp_path, monkeypatch):
    """The build behind the shipped models, on a reduced warm start: shipped twice, the same
    files; then loaded with no build."""
    monkeypatch.setattr(toy, "SHIPPED", str(tmp_path / "ship"))
    monkeypatch.setattr(toy, "CACHE", str(tmp_path / "cache"))
    os.makedirs(toy.SHIPPED)
    folder = toy.ship("math", {**TINY, "seed": 3}, quiet=True)
    first = toy.file_digests(folder)
    assert os.path.basename(folder) == "math-seed3" and "model.safetensors" in first and toy.COMPLETE not in first
    entry = toy.manifest()["math-seed3"]
    assert entry["files"] == first and entry["key"] == toy._key("math", {**toy.WARM, **TINY, "seed": 3})
    assert entry["command"] == "python toy.py --task math --seed 3 --steps 2 --ship"
    assert toy.file_digests(toy.ship("math", {**TINY, "seed": 3}, quiet=True)) == first   # deterministic
    monkeypatch.setattr(toy, "warm_start", lambda *a, **k: pytest.fail("a warm start ran"))
    assert toy.model_folder("math", {**TINY, "seed": 3}) == folder
    model, tok = policies.load(folder)
    assert model.config.vocab_size == len(tok)


def test_a_forks_registrations_leave_the_toy_world_as_it_was(registries):
    """A new workflow with an instruction of its own and a new task kind: the toy key, vocabulary
    and model folder are what they were, and the new text is spelled in characters."""
    before = ({t: toy._key(t, toy.WARM) for t in TASKS}, toy.build_tokenizer().get_vocab(),
              {t: toy.model_folder(t) for t in TASKS})
    judge = "Read both answers and name the better one as \\boxed{1} or \\boxed{2}."
    wf.register("pair_judge", lambda episodes, llm, task: None,
                slots={"generator": ("generator0", "generator1"), "judge": ("judge",)}, kinds={"judge": "supervisory"},
                instructions={("judge", "math"): judge})
    taskkinds.register_task("parity_toy", lambda text, problem: 0.0, instructions={"generator": "Say odd or even."},
                            default="Answer in one word.", check=lambda record: None)
    assert judge in wf.phrases() and judge not in toy.phrases()
    tok = toy.build_tokenizer()
    assert (({t: toy._key(t, toy.WARM) for t in TASKS}, tok.get_vocab(), {t: toy.model_folder(t) for t in TASKS})
            == before)
    assert len(_ids(tok, judge)) == len(judge) - judge.count("\\boxed{") * (len("\\boxed{") - 1)


def test_a_forks_registrations_leave_a_default_toy_runs_samples_as_they_were(registries, tmp_path):
    """Two steps of the default run (Voting on the shipped math model), before and after a fork
    registers a workflow with an instruction of its own and a task kind: the same model, the
    same transcripts and rewards, token for token."""
    import train

    def run(name):
        out = tmp_path / name
        train.main(["--steps", "2", "--eval-problems", "8", "--problems-per-step", "2", "--group-size", "2",
                    "--samples-every", "1", "--quiet", "--out", str(out)])
        with open(out / "config.json") as f:
            sha = json.load(f)["provenance"]["model_sha256"]
        return sha, (out / "samples.jsonl").read_text(), (out / "eval.jsonl").read_text()
    before = run("before")
    wf.register("pair_judge", lambda episodes, llm, task: None,
                slots={"generator": ("generator0", "generator1"), "judge": ("judge",)}, kinds={"judge": "supervisory"},
                instructions={("judge", "math"): "Name the better of the two answers as \\boxed{1} or \\boxed{2}."})
    taskkinds.register_task("parity_run", lambda text, problem: 0.0, instructions={"generator": "Say odd or even."},
                            default="Answer in one word.", check=lambda record: None)
    after = run("after")
    assert before[0] == toy.manifest()["math"]["files"]["model.safetensors"]
    assert after == before and before[1].strip()
