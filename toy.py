"""The offline toy world: a tiny Qwen3, a character tokenizer, toy problems and a warm start.

It lets the whole method (every workflow, both sharing modes, the gradient diagnostics) run and
learn on a laptop CPU through exactly the code path of the real models:

- Tokenizer: one token per character (digits always single tokens), plus one token for every
  fixed prompt phrase of the built-in math and code kinds (`phrases()`, the toy's own list: a
  fork's registered text is spelled in characters and changes nothing here) and a few output
  words (`\\boxed{`, the verdicts, the python fence), so a prompt costs its variable text plus a
  handful of tokens. Saved in
  Hugging Face format with a Qwen-style chat template; `<|im_end|>` and `<|endoftext|>` both
  stop generation, as in Qwen3.
- Model: `Qwen3ForCausalLM` from a config (hidden 128, 4 layers, 4 heads / 2 kv heads,
  head_dim 32, MLP 384, tied embeddings: 0.8M parameters), saved with `save_pretrained` and
  loaded by `policies.load("toy")` through `from_pretrained` like a real checkpoint.
- Tasks (`problems(kind, split, n, seed)`):
  * math: `a o b o c` with digits 1-9 and o in + -, worked left to right one operation per
    line, then `\\boxed{answer}` (2,916 problems; few enough arithmetic facts that the tiny
    model learns most of them in the warm start);
  * code: "f(x): add 2, times 3" -> a one-line `def f(x): return (x+2)*3`, checked by assert
    tests through the real sandbox (sandbox.py).
  A problem is in the test split when an md5 of its text falls under TEST_SHARE: fixed,
  disjoint splits (609 math test problems, 20%; 2,134 code, 10%).
- Warm start (`model_folder(task)`): supervised training from scratch on procedurally written
  transcripts of every role, built with the workflows' own prompt builders, with deliberate
  imperfection so RL has room both ways: solutions slip (a step result off by 1-2, a wrong
  constant) with probability SLIP[task] per step, evaluators give the true verdict with probability
  JUDGE, aggregators (comparing 1-8 solutions, 3 half the time) and synthesizers follow the
  majority answer with probability PICK (else a random candidate), orchestrators write 1-3
  valid STRATEGY lines. With `check` L (train.py --toy-check), the supervisors write L tokens
  of check before their verdict (the candidates' answers, repeated): a knob of their share of
  each step's gradient. Transcripts are packed into rows (a block-diagonal mask keeps them
  apart), so no compute goes to padding. A model's settings are a key (`_key`: every constant,
  the vocabulary and a fingerprint of the transcripts).
- Shipped models (`toy_models/`, with MANIFEST.json: each one's settings, key, files' sha256
  and the command that built it): the default math and code models, and math from warm-start
  seeds 1 and 2 (train.py --toy-seed). `model_folder` returns the shipped model whose key is the
  settings', after checking every file against the manifest (a damaged or edited one is refused
  in one line); other settings are built on first use into `$MARL_CACHE/toy/` with a progress
  bar (a few minutes on one thread), once however many processes ask (a file lock).

Run `python toy.py --task math` to print the model's folder (building it if it is neither shipped
nor cached), `--force` to rebuild it into the cache, `--ship` to rebuild it into toy_models/.
"""
import argparse
import contextlib
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import sys
import time

import torch

import workflows as wf

CACHE = os.environ.get("MARL_CACHE", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache"))

# ------------------------------------------------------------------ settings (the cache key)
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
             rope_theta=10000.0, rms_norm_eps=1e-6)
MATH_TERMS = 3  # digits per toy math problem: two + / - steps
# probability that one step (math) or one operation (code) is written wrong; code is copying
# more than computing, so the model learns it almost exactly and it needs more slips to land
# in the same accuracy range as math
SLIP = {"math": 0.2, "code": 0.4}
JUDGE = 0.8    # probability that a warm-start evaluator gives the true verdict
PICK = 0.75    # probability that an aggregator / synthesizer follows the majority answer
WARM = dict(steps=520, batch=48, lr=3e-3, warmup=50, seed=0)
# length limits of a toy call (train.py's and eval.py's defaults at --scale toy). Warm-start
# prompts stay under ~120 tokens; solutions, verdicts and picks under ~40 tokens, but a plan
# of three STRATEGY lines can reach ~70, so its third line may be cut (still parsed).
MAX_NEW_TOKENS, MAX_PROMPT_TOKENS = 48, 400

BUILT_IN_KINDS = ("math", "code")   # the task kinds whose phrases the toy vocabulary holds
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["\\boxed{Correct}", "\\boxed{Incorrect}", "\\boxed{", "```python\n", "```", "def f(x):\n",
         "    return ", "STRATEGY ", "system\n", "user\n", "assistant\n", "Step ", " looks wrong.",
         "Every step checks out.", "Part ", "The code looks right."]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ------------------------------------------------------------------ tokenizer

def phrases() -> tuple:
    """The toy world's own prompt phrases, one token each: the user-message headers and the
    built-in math and code kinds' instructions (every role's, the revision turn's, the default).
    Closed: a fork's registered workflow, instruction or task kind is not among them (its text
    is spelled in characters), so it leaves the tokenizer, the key and the model as they are."""
    return wf.phrases(kinds=BUILT_IN_KINDS, registered=False)


def build_tokenizer():
    """A Hugging Face fast tokenizer: whole phrases and words first, then single characters."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL])
    # longest first, so that the added-token matcher prefers "\boxed{Correct}" over "\boxed{";
    # ties alphabetically, so the token ids never depend on the set's (hash-seeded) order
    words = sorted(set(phrases()) | set(WORDS), key=lambda w: (-len(w), w))
    tok.add_tokens([AddedToken(w, normalized=False) for w in words])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                unk_token="?")
    t.chat_template = TEMPLATE
    return t


# ------------------------------------------------------------------ problems

TEST_SHARE = {"math": 52, "code": 26}  # out of 256: ~20% of the 2,916 math, ~10% of the code problems


def _in_test(text: str, kind: str) -> bool:
    return hashlib.md5(text.encode()).digest()[0] < TEST_SHARE[kind]  # stable across runs


def _math_text(digits, ops) -> str:
    return str(digits[0]) + "".join(f"{o}{d}" for o, d in zip(ops, digits[1:]))


def _code_text(ops) -> str:
    names = {"+": "add", "-": "subtract", "*": "times"}
    return "f(x): " + ", ".join(f"{names[o]} {k}" for o, k in ops)


def _code_expr(ops) -> str:
    e = "x"
    for o, k in ops:
        e = f"({e})*{k}" if o == "*" and ("+" in e or "-" in e) else f"{e}{o}{k}"
    return e


def _code_tests(ops) -> dict:
    lines = ["def check(candidate):"]
    for x in (0, 1, 3, 7):
        lines.append(f"    assert candidate({x}) == {eval(_code_expr(ops), {'x': x})}")
    return {"kind": "assert", "test": "\n".join(lines) + "\n", "entry_point": "f"}


def problems(kind: str, split: str, n: int | None = None, seed: int = 0) -> list:
    """Toy problems as task records, shuffled with `seed`; the first n (all if None)."""
    if split not in ("train", "test"):
        raise ValueError(f"toy split must be train or test, got {split!r}")
    out = [{**p, "tests": dict(p["tests"])} if "tests" in p else dict(p) for p in _all_problems(kind, split)]
    random.Random(seed).shuffle(out)
    return out if n is None else out[:n]


@functools.lru_cache(maxsize=None)
def _all_problems(kind: str, split: str) -> tuple:
    out = []
    if kind == "math":
        for digits in itertools.product(range(1, 10), repeat=MATH_TERMS):
            for ops in itertools.product("+-", repeat=MATH_TERMS - 1):
                text = _math_text(digits, ops)
                if _in_test(text, "math") == (split == "test"):
                    out.append({"id": f"toy_math/{text}", "prompt": text, "source": "toy_math",
                                "answer": str(eval(text))})
    elif kind == "code":
        ops1 = [(o, k) for o in "+-*" for k in range(1, 10)]
        for n_ops in (2, 3):
            for i in range(len(ops1) ** n_ops):
                ops, j = [], i
                for _ in range(n_ops):
                    ops.append(ops1[j % len(ops1)])
                    j //= len(ops1)
                text = _code_text(ops)
                if _in_test(text, "code") == (split == "test"):
                    out.append({"id": f"toy_code/{text[6:]}", "prompt": text, "source": "toy_code",
                                "tests": _code_tests(ops), "ops": tuple(ops)})
    else:
        raise ValueError(f"toy kind must be math or code, got {kind!r}")
    return tuple(out)


# ------------------------------------------------------------------ transcripts with slips

def _slip_value(v: int, rng) -> int:
    return v + rng.choice([-2, -1, 1, 2])


def math_solution(text: str, rng, slip: float | None = None) -> str:
    """One operation per line, left to right; each result slips with prob `slip` and the next
    line goes on from the slipped value."""
    slip = SLIP["math"] if slip is None else slip
    v, lines = int(text[0]), []
    for o, d in zip(text[1::2], text[2::2]):
        right = v + int(d) if o == "+" else v - int(d)
        out = _slip_value(right, rng) if rng.random() < slip else right
        lines.append(f"{v}{o}{d}={out}")
        v = out
    return "\n".join(lines) + f"\n\\boxed{{{v}}}"


def code_solution(ops, rng, slip: float | None = None) -> str:
    slip = SLIP["code"] if slip is None else slip
    written = []
    for o, k in ops:
        if rng.random() < slip:
            if rng.random() < 0.5:
                k = max(1, min(9, k + rng.choice([-1, 1])))
            else:
                o = rng.choice([x for x in "+-*" if x != o])
        written.append((o, k))
    return f"```python\ndef f(x):\n    return {_code_expr(written)}\n```"


def _answer(text: str, task: str):
    if task == "math":
        return wf.last_boxed(text)
    import rewards
    return rewards.last_code_block(text)


def _is_right(problem, text, task) -> bool:
    if task == "math":
        return wf.last_boxed(text) == problem["answer"]
    return _answer(text, task) == _answer(code_solution(problem["ops"], random.Random(0), 0.0), task)


def _pick(problem, task, solutions, rng) -> int:
    """0-based index: the first solution whose answer is the most common, with prob PICK."""
    if rng.random() >= PICK:
        return rng.randrange(len(solutions))
    answers = [_answer(s, task) for s in solutions]
    counts = [answers.count(a) for a in answers]
    return counts.index(max(counts))


def _solve(problem, task, rng):
    if task == "math":
        return math_solution(problem["prompt"], rng)
    return code_solution(problem["ops"], rng)


STRATEGIES = {"math": ["go left to right", "one step per line", "check each step", "keep the signs"],
              "code": ["apply the steps in order", "mind the brackets", "test with x=1", "write one line"]}


def transcript(problem: dict, task: str, role: str, rng, check: int = 0) -> tuple[list, str]:
    """(chat messages, target completion) for one role, written procedurally. A supervisor
    (aggregator, evaluator) writes a check of `check` tokens before its verdict (check_text)."""
    if role == "generator":
        return wf.generator_messages(problem, task), _solve(problem, task, rng)
    if role == "reviser":  # an Eval-Opt generator turn: every earlier attempt was judged wrong
        history = []
        for _ in range(rng.randint(1, 2 if task == "code" else 3)):
            history += [_solve(problem, task, rng), _feedback(task, False, rng)]
        return wf.generator_messages(problem, task, history), _solve(problem, task, rng)
    if role == "evaluator":
        history = []
        for _ in range(rng.randint(0, 1 if task == "code" else 2)):
            history += [_solve(problem, task, rng), _feedback(task, False, rng)]
        attempt = _solve(problem, task, rng)
        reason, verdict = _verdict_text(problem, task, attempt, rng)
        return (wf.evaluator_messages(problem, task, history + [attempt]),
                reason + check_text([_answer(attempt, task)], check) + verdict)
    if role == "aggregator":
        sols = [_solve(problem, task, rng) for _ in range(_candidates(rng))]
        pick = f"\\boxed{{{_pick(problem, task, sols, rng) + 1}}}"
        return wf.aggregator_messages(problem, task, sols), check_text([_answer(s, task) for s in sols], check) + pick
    if role == "orchestrator":
        chosen = rng.sample(STRATEGIES[task], rng.randint(1, 3))
        return wf.orchestrator_messages(problem, task), "\n".join(
            f"STRATEGY {i + 1}: {s}" for i, s in enumerate(chosen))
    if role == "worker":
        return wf.worker_messages(problem, task, rng.choice(STRATEGIES[task])), _solve(problem, task, rng)
    if role == "synthesizer":
        sols = [_solve(problem, task, rng) for _ in range(rng.randint(1, 3))]
        return wf.synthesizer_messages(problem, task, sols), sols[_pick(problem, task, sols, rng)]
    raise ValueError(f"no toy transcript for role {role!r}")


def _feedback(task, right: bool, rng) -> str:
    return "".join(_reason_and_verdict(task, right, rng))


def _reason_and_verdict(task, right: bool, rng) -> tuple:
    if task == "math":
        reason = "Every step checks out." if right else f"Step {rng.randint(1, 2)} looks wrong."
    else:
        reason = "The code looks right." if right else f"Part {rng.randint(1, 3)} looks wrong."
    return reason, ("\\boxed{Correct}" if right else "\\boxed{Incorrect}")


def _verdict_text(problem, task, attempt, rng) -> tuple:
    """(reason, verdict) of an evaluator: the true verdict with probability JUDGE."""
    truth = _is_right(problem, attempt, task)
    return _reason_and_verdict(task, truth if rng.random() < JUDGE else not truth, rng)


def _candidates(rng) -> int:
    """Solutions an aggregator transcript compares: 3 (Voting's default) half the time, else 1-8,
    so the model can judge any --n-voters."""
    return 3 if rng.random() < 0.5 else rng.randint(1, 8)


def check_text(answers: list, length: int) -> str:
    """A supervisor's check before its verdict: the candidates' answers (one character a token
    in the toy tokenizer), space-separated and repeated to exactly `length` characters; "" when 0."""
    unit = " ".join(str(a) if a is not None else "?" for a in answers).replace("\n", " ") + " "
    return (unit * (length // len(unit) + 1))[:length] if length else ""


TRANSCRIPTS = 3  # bump when the transcripts or their batches change, so cached models are rebuilt
# Solutions (generator, reviser, worker, synthesizer) teach the arithmetic every role leans on,
# so they get most of the batches; verdicts, picks and plans are short and learned quickly.
ROLE_MIX = {"generator": 0.35, "reviser": 0.1, "evaluator": 0.12, "aggregator": 0.12,
            "orchestrator": 0.06, "worker": 0.1, "synthesizer": 0.15}


# The role whose calls each transcript of ROLE_MIX teaches: its own name, but for "reviser", the
# generator's Eval-Opt revision turn (a transcript of the generator, not a role).
TRANSCRIPT_ROLE = {"reviser": "generator"}


def learned_roles() -> set:
    """The roles the toy model learned: those some transcript of ROLE_MIX teaches."""
    return {TRANSCRIPT_ROLE.get(t, t) for t in ROLE_MIX}


def check_roles(workflow: str, roles) -> None:
    """A ValueError in one line for a role the warm start writes no transcript of: the toy
    model would start that role untrained, and its run would not say so."""
    learned = learned_roles()
    missing = [r for r in roles if r not in learned]
    if missing:
        raise ValueError(f"--workflow {workflow}: the toy world's warm start has no transcript of role "
                         f"{missing[0]!r}, so the toy model never learned it; write one in toy.transcript with a "
                         "weight in toy.ROLE_MIX (a new toy model), or run a real model (--scale)")


# ------------------------------------------------------------------ warm start

def _key(task: str, warm: dict) -> str:
    """The model's settings as 10 hex digits: every constant above, the toy vocabulary, and a
    fingerprint of the transcripts themselves (_fingerprint), so a changed prompt, phrase or
    transcript is a new key even when no constant moved."""
    blob = json.dumps([task, MODEL, MATH_TERMS, SLIP[task], JUDGE, PICK, warm, SPECIAL, WORDS, CHARS, TEMPLATE,
                       list(phrases()), STRATEGIES, ROLE_MIX, TRANSCRIPTS,
                       _fingerprint(task, warm.get("check", 0))], sort_keys=True)
    return hashlib.md5(blob.encode()).hexdigest()[:10]


def _fingerprint(task: str, check: int) -> str:
    """md5 of 8 transcripts of every role, drawn with a fixed seed: what the warm start would
    read, as text (a few milliseconds)."""
    rng, train = random.Random(0), _all_problems(task, "train")
    out = [transcript(train[rng.randrange(len(train))], task, role, rng, check) for role in ROLE_MIX for _ in range(8)]
    return hashlib.md5(json.dumps(out).encode()).hexdigest()


def settings(check: int = 0, seed: int = 0) -> dict:
    """The warm-start settings that train.py's --toy-check and --toy-seed change (unset at 0,
    so the default model's key does not depend on them)."""
    return {**({"check": check} if check else {}), **({"seed": seed} if seed else {})}


COMPLETE = "complete"   # the file a build writes last into its folder, before publishing it
HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "toy_models")      # the models the repository ships, with MANIFEST.json


def model_folder(task: str = "math", warm: dict | None = None, force: bool = False, quiet: bool = False) -> str:
    """Folder of the warm-started toy model for `task`: the shipped one (toy_models/) when its
    key is these settings', checked against its manifest, else one built into the cache on first
    use. Any number of processes may ask at once (torchrun ranks, sweep cells): one builds, under
    the folder's lock, while the others wait for it and then use its model. `MARL_TOY_WARM`
    (JSON, e.g. '{"steps": 2, "batch": 4}') overrides WARM, for tests and quick looks; it
    changes the key. `force`: rebuild into the cache even when a model is shipped or cached."""
    if task not in ("math", "code"):
        raise ValueError(f"toy task must be math or code, got {task!r}")
    warm = {**WARM, **json.loads(os.environ.get("MARL_TOY_WARM") or "{}"), **(warm or {})}
    key = _key(task, warm)
    name = shipped_name(key)
    if name is not None and not force:
        return check_shipped(name)
    folder = os.path.join(CACHE, "toy", f"{task}-{key}")
    if is_complete(folder) and not force:
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with locked(folder, exclusive=True):       # one builder; readers (policies.load) wait
        if force or not is_complete(folder):   # another process may have built it meanwhile
            print(f"toy: building the warm-started {task} model in {folder} (no shipped model has key {key})",
                  file=sys.stderr)
            build(task, warm, folder, quiet)
    return folder


# ------------------------------------------------------------------ the shipped models

def manifest() -> dict:
    """toy_models/MANIFEST.json: {name: {task, warm, key, sha256 of each file, built}}; {} if absent."""
    path = os.path.join(SHIPPED, "MANIFEST.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def shipped_name(key: str) -> str | None:
    """The shipped model whose settings' key is `key`, or None."""
    return next((name for name, entry in manifest().items() if entry["key"] == key), None)


def file_digests(folder: str) -> dict:
    """{file name: sha256} of every file in a model folder."""
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def check_shipped(name: str) -> str:
    """The folder of shipped model `name`, after checking every file against the manifest; a
    ValueError in one line for a missing, damaged or hand-edited file."""
    folder, entry = os.path.join(SHIPPED, name), manifest()[name]
    have = file_digests(folder) if os.path.isdir(folder) else {}
    shown = f"toy_models/{name}"
    for file, want in entry["files"].items():
        if have.get(file) != want:
            what = ("is missing" if file not in have else
                    f"is not the shipped file (sha256 {have[file][:12]}, the manifest's {want[:12]})")
            raise ValueError(f"toy model {shown}/{file} {what}: restore it with `git checkout -- {shown}` or rebuild "
                             f"it with `{ship_command(entry)}`")
    return folder


def ship_command(entry: dict) -> str:
    """The command that rebuilds a shipped model into toy_models/."""
    w = entry["warm"]
    return " ".join(["python toy.py --task", entry["task"], *(["--seed", str(w["seed"])] if w.get("seed") else []),
                     *(["--check", str(w["check"])] if w.get("check") else []),
                     *(["--steps", str(w["steps"])] if w["steps"] != WARM["steps"] else []), "--ship"])


def ship(task: str, warm: dict, quiet: bool = False) -> str:
    """Warm-start a model from scratch and write it into toy_models/NAME (NAME: the task, -seedS
    and -checkL where not 0), its files' sha256 and settings into the manifest; the folder."""
    warm = {**WARM, **warm}
    name = task + "".join(f"-{k}{warm[k]}" for k in ("seed", "check") if warm.get(k))
    tmp = os.path.join(SHIPPED, f".{name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(task, warm, tmp, quiet)
    os.remove(os.path.join(tmp, COMPLETE))     # a shipped folder is whole by its manifest
    folder = os.path.join(SHIPPED, name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    import transformers
    with locked(os.path.join(SHIPPED, "MANIFEST"), exclusive=True):   # two ships at once keep both entries
        _write_entry(name, task, warm, folder, transformers.__version__)
    return folder


def _write_entry(name, task, warm, folder, transformers_version):
    entries = manifest()
    entries[name] = {"task": task, "warm": warm, "key": _key(task, warm), "files": file_digests(folder),
                     "built": f"{_cpu()}, torch {torch.__version__}, transformers {transformers_version}, "
                              f"{time.strftime('%Y-%m-%d')}"}
    entries[name]["command"] = ship_command(entries[name])
    with open(os.path.join(SHIPPED, "MANIFEST.json"), "w") as f:
        json.dump(dict(sorted(entries.items())), f, indent=1)
        f.write("\n")


def _cpu() -> str:
    """The CPU's model name (a rebuild elsewhere may differ in the last bits: docs/REPRODUCING.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or platform.machine()


def reading(folder: str):
    """What a reader of `folder` holds while it loads: the shared lock of a cached model (a
    rebuild cannot replace it meanwhile); nothing for a shipped one, which no build replaces."""
    if os.path.dirname(os.path.abspath(folder)) == os.path.abspath(SHIPPED):
        return contextlib.nullcontext()
    return locked(folder, exclusive=False)


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMPLETE))


@contextlib.contextmanager
def locked(folder: str, exclusive: bool):
    """Hold FOLDER.lock: exclusive to build and publish, shared to read. Without fcntl (not
    POSIX) nothing is locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(task: str, warm: dict, folder: str, quiet: bool = False) -> None:
    """Warm-start into FOLDER.tmp-PID, then publish it whole: the complete model is moved aside,
    the new one moved in, the old one deleted. Killed at any point, the folder is either a
    complete model or absent (and the next caller rebuilds); leftovers carry other names."""
    tmp = clear_leftovers(folder)
    model, tok = warm_start(task, warm, quiet=quiet)
    save_model(model, tmp)
    tok.save_pretrained(tmp)
    publish(tmp, folder)


def clear_leftovers(folder: str) -> str:
    """Delete what a killed build of `folder` left (FOLDER.tmp*, FOLDER.old*; the caller holds
    the folder's exclusive lock) and return this process's folder to build into."""
    for stale in glob.glob(glob.escape(folder) + ".tmp*") + glob.glob(glob.escape(folder) + ".old*"):
        shutil.rmtree(stale, ignore_errors=True)
    return folder + f".tmp{os.getpid()}"


def publish(tmp: str, folder: str) -> None:
    """Mark the model written into `tmp` (clear_leftovers's folder) complete and move it to
    `folder` whole: a complete model there is moved aside first and deleted after. The caller
    holds `folder`'s exclusive lock."""
    old = folder + f".old{os.getpid()}"
    open(os.path.join(tmp, COMPLETE), "w").close()
    if os.path.isdir(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_model(model, folder: str) -> None:
    """The model as a Hugging Face folder (config, generation config, model.safetensors), written
    by whichever process builds it: transformers' save_pretrained writes nothing on a
    torch.distributed rank other than 0, and under torchrun the builder may be any rank."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    # the tied output matrix is the embedding: saved once, under the embedding's name, so the file's
    # bytes are a function of the weights alone (safetensors' own de-duplication picks a name by
    # set order, which changes with the process's hash seed)
    state = {k: v.contiguous() for k, v in sorted(model.state_dict().items())
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def new_model(tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen3Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=[im_end, eot],
                      pad_token_id=eot, **MODEL)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = [im_end, eot]
    model.generation_config.pad_token_id = eot
    return model


def sft_batch(tok, task, rng, n, check: int = 0):
    """n transcripts, each of a role drawn by ROLE_MIX, packed into rows: (ids (R, L), position
    ids (R, L), attention (R, 1, L, L) bool, loss mask (R, L), segments: per row the (start, end)
    of each transcript). A row holds several transcripts end to end, each attending only to
    itself (block-diagonal causal mask) and counting positions from 0, so no compute goes to
    padding; the loss covers each completion and its <|im_end|>. A prediction across two
    transcripts is never in the loss: every transcript starts with prompt tokens."""
    train = _all_problems(task, "train")
    roles, weights = zip(*ROLE_MIX.items())
    seqs = []
    for _ in range(n):
        msgs, target = transcript(rng.choice(train), task, rng.choices(roles, weights)[0], rng, check)
        p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        c_ids = tok(target + "<|im_end|>", add_special_tokens=False)["input_ids"]
        seqs.append((p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids)))
    L = max(len(ids) for ids, _ in seqs)
    rows = []   # first fit, longest first: rows of at most L tokens
    for k in sorted(range(n), key=lambda k: -len(seqs[k][0])):
        row = next((r for r in rows if sum(len(seqs[j][0]) for j in r) + len(seqs[k][0]) <= L), None)
        rows.append([k]) if row is None else row.append(k)
    R = len(rows)
    ids = torch.full((R, L), tok.pad_token_id)
    pos = torch.zeros((R, L), dtype=torch.long)
    seg = torch.full((R, L), -1)                    # which transcript a column holds, -1 padding
    loss_mask = torch.zeros((R, L))
    segments = []
    for r, row in enumerate(rows):
        at, spans = 0, []
        for k in row:
            t, m = seqs[k]
            ids[r, at:at + len(t)], loss_mask[r, at:at + len(t)] = torch.tensor(t), torch.tensor(m, dtype=torch.float)
            pos[r, at:at + len(t)], seg[r, at:at + len(t)] = torch.arange(len(t)), k
            spans.append((at, at + len(t)))
            at += len(t)
        segments.append(spans)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    attn = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)   # (R, L, L)
    attn |= torch.eye(L, dtype=torch.bool)        # a padding column attends to itself: no empty row
    return ids, pos, attn[:, None], loss_mask, segments


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread inside, as it was after. A float sum split over threads may
    be added in another order, and over 520 steps of training a last-bit difference can grow
    into other weights; on one thread the build does not depend on the caller's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_start(task: str, warm: dict, quiet: bool = False):
    """Train the toy model from scratch on role transcripts, on one thread (`one_thread`); return
    (model, tokenizer)."""
    with one_thread():
        return _warm_start(task, warm, quiet)


def _warm_start(task: str, warm: dict, quiet: bool):
    from tqdm import tqdm
    torch.manual_seed(warm["seed"])
    rng = random.Random(warm["seed"])
    tok = build_tokenizer()
    model = new_model(tok).train()
    opt = torch.optim.AdamW(model.parameters(), lr=warm["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm["warmup"]) * max(
        0.05, 0.5 * (1 + math.cos(math.pi * s / warm["steps"]))))
    bar = tqdm(range(warm["steps"]), desc=f"toy warm start ({task})", disable=quiet)
    for _ in bar:
        ids, pos, attn, m, _ = sft_batch(tok, task, rng, warm["batch"], warm.get("check", 0))
        logits = model(input_ids=ids, position_ids=pos, attention_mask=attn).logits[:, :-1]  # (R, L-1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval(), tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="math", choices=["math", "code"], help="toy task to warm-start for")
    ap.add_argument("--force", action="store_true", help="rebuild into the cache even if shipped or cached")
    ap.add_argument("--ship", action="store_true", help="rebuild from scratch into toy_models/ and its manifest "
                    "(what the repository ships; commit the folder and MANIFEST.json)")
    ap.add_argument("--steps", type=int, default=WARM["steps"], help="warm-start steps (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="warm-start seed, another toy model of the same settings "
                    "(train.py --toy-seed) (default: %(default)s)")
    ap.add_argument("--check", type=int, default=0, help="tokens of the supervisors' check (train.py --toy-check) "
                    "(default: %(default)s)")
    args = ap.parse_args()
    t0 = time.time()
    warm = {**settings(args.check, args.seed), **({"steps": args.steps} if args.steps != WARM["steps"] else {})}
    try:
        folder = ship(args.task, warm) if args.ship else model_folder(args.task, warm, force=args.force)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"toy model: {folder} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
