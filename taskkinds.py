"""Task kinds: what a kind of problem is, one `register_task(...)` call each; math and code (the
paper's) and arith (sums a small real model can sometimes do, graded on the last number) are three.

A registration gives everything the rest of the code asks of a kind:
- `reward(text, problem) -> float`: the reward of the whole text of a graded answer, given the
  problem's record (math reads the text's last \\boxed{}, code runs its last python block);
- `instructions`: the system instruction of each role it names; `default`, the instruction of
  the roles it does not name that the default was written for (`default_for`: the built-in
  solution roles, SOLVERS, unless it says otherwise; any other role is refused at a run's start,
  workflows.check_run); and `revise` for Eval-Opt's revision turn (default: `default`);
  workflows.py builds every prompt from them;
- `max_new_tokens`: the response limit at real scales (the paper's 5120 math, 2048 code);
  `rounds`: Eval-Opt's evaluator rounds when its max_rounds is unset (3 math, 2 code);
- `data`: the data set a run takes by default, {"toy": name, "real": name} (a kind with no
  entry for a scale needs --data there);
- `check(record)`: raises ValueError(reason) for a record of this kind that lacks what the
  reward needs, beyond the id, prompt and source every record has (tasks.validate);
- `marker`: the field that marks a record of this kind when it has no "kind" field (`answer`
  math, `tests` code); a record may always name its kind with "kind": NAME;
- `key(text, problem)`, optional: pairs of one problem with equal keys get equal rewards, so a
  batch grades each (problem id, key) once (default: the whole text); `workers(pairs)`, optional:
  how many distinct pairs to grade at once, in threads (default 1);
- `parse(text)`, optional: what the reward reads of a text (math: its last \\boxed{}), None when
  it finds nothing; with it, a first batch paid all 0 says whether any answer parsed.

    score(texts, problems, task) -> list[float]     the batch entry point training calls once a step

Rewards are checked where they enter, in `score`: a reward that is not a number in [0, 1] (a
NaN, 10, -5, None) is refused in one line naming the kind and the record (Refused, before any
update uses it: eval counts > 0.5 as correct and the run folder says 0 or 1), and the first batch
a process grades of a kind says once, on stderr, when every answer in it was paid 0 and none
parsed (a kind whose instructions ask for another form than its reward reads trains on nothing).

Every instruction is fixed prompt text (workflows.phrases()) and keeps the phrase rules of
`check_phrases`: one line, and none holding another fixed string. `register_task` refuses a kind
that breaks them against the other kinds' strings (the user-message headers and the workflows'
own instructions live in workflows.py, which imports this module: `workflows.check_run` checks
the kind against them at a run's start), and a name that exists unless `replace=True` (then
REPLACED names it, and a run of it says so).

Everything that names task kinds reads TASK_KINDS: train.py's and eval.py's --task choices,
sweep.py's --tasks, tasks.py's validation and defaults, and workflows.py's instructions. The toy
world is closed: its tokenizer, key and models hold the built-in math and code kinds' phrases
alone (toy.phrases), so a new kind leaves them as they are and runs on a real model (README,
"Forking").
Run: `python -m pytest -q tests/test_rewards.py tests/test_forking.py`.
"""
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import numbers
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import rewards
import sandbox


def _text_and_id(text: str, problem: dict):
    return text, problem.get("id")


def _one_at_a_time(pairs: list) -> int:
    return 1


# The built-in workflows' solution roles: a kind's default is written for them unless it says
# otherwise (TaskKind.default_for).
SOLVERS = ("generator", "worker", "synthesizer")


@dataclass(frozen=True)
class TaskKind:
    """One kind of problem (see the module docstring for each field)."""
    name: str
    reward: Callable[[str, dict], float]
    instructions: dict            # role -> system instruction
    default: str                  # the instruction of the roles of default_for it does not name
    check: Callable[[dict], None]
    max_new_tokens: int = 2048
    data: dict = field(default_factory=dict)     # "toy" / "real" -> data set name
    revise: str | None = None     # Eval-Opt's revision turn; None: `default`
    rounds: int = 2
    marker: str | None = None
    key: Callable = _text_and_id
    workers: Callable[[list], int] = _one_at_a_time
    default_for: tuple = SOLVERS  # the roles `default` was written for
    parse: Callable[[str], object] | None = None   # what the reward reads of a text; None: nothing there

    def instruction(self, role: str) -> str:
        return self.instructions.get(role, self.default)

    def revision(self) -> str:
        return self.revise or self.default

    def phrases(self) -> tuple:
        """Its fixed prompt strings, each once: every role's instruction, the revision turn's, the default."""
        return tuple(dict.fromkeys((*self.instructions.values(), self.revision(), self.default)))


class Refused(ValueError):
    """A fork's mistake refused in one line: a registration (register_task, workflows.register),
    or what only a run shows (a reward out of [0, 1], a workflow that breaks its contract on a
    branch its dry run did not take: workflows.Broken; train.py ends a run on it in one line).
    Raised by a fork's module as it is imported, before any entry point's own error handling
    runs, it ends the process with its one line and where the registration is, not a traceback
    (_one_line)."""


@contextlib.contextmanager
def refusing():
    """A registration's checks: their ValueError becomes Refused."""
    try:
        yield
    except Refused:
        raise
    except ValueError as e:
        raise Refused(str(e)) from None


def _one_line(kind, value, tb, python=sys.excepthook):
    """Python's hook for an exception no one caught: a Refused one is printed as
    `error: WHY (FILE:LINE)`, the line of the module-level call that registered; any other as
    Python prints it. The exit status stays Python's 1."""
    if not isinstance(value, Refused):
        return python(kind, value, tb)
    calls = [f for f in traceback.extract_tb(tb) if f.name == "<module>"]
    where = f" ({os.path.basename(calls[-1].filename)}:{calls[-1].lineno})" if calls else ""
    print(f"error: {value}{where}", file=sys.stderr)


sys.excepthook = _one_line

# name -> TaskKind, in order of registration
TASK_KINDS: dict[str, TaskKind] = {}
# kinds registered again on purpose (register_task(..., replace=True)): a run of one says so
REPLACED: set = set()


def register_task(name: str, reward: Callable, instructions: dict, default: str, check: Callable,
                  replace: bool = False, **options) -> TaskKind:
    """Add a task kind; `options` are TaskKind's optional fields (max_new_tokens, data, revise,
    rounds, marker, key, workers, default_for). Its strings must keep the phrase rules
    (check_phrases) beside every other kind's; a name that exists is refused unless `replace`."""
    with refusing():
        check_name("task kind", name)
        if name in TASK_KINDS and not replace:
            raise ValueError(f"task kind {name!r} exists; choose another name, or pass replace=True to replace it "
                             f"on purpose")
        _check_fields(name, reward, check, instructions, options)
        others = [p for k in TASK_KINDS.values() if k.name != name for p in k.phrases()]
        check_phrases([*instructions.values(), *([options["revise"]] if options.get("revise") else []), default],
                      others, f"task kind {name!r}")
        kind = TaskKind(name, reward, dict(instructions), default, check, **options)
        taken = {k.marker: k.name for k in TASK_KINDS.values() if k.marker and k.name != name}
        if kind.marker in taken:
            raise ValueError(f"task kind {name!r}: records with {kind.marker!r} already mark {taken[kind.marker]}")
    if name in TASK_KINDS:
        REPLACED.add(name)
    TASK_KINDS[name] = kind
    return kind


def _check_fields(name: str, reward, check, instructions, options: dict) -> None:
    """What a registration declares is what the code will use: functions where it calls them, a
    data set per scale it knows ("toy", "real"), limits that are counts, role names as keys."""
    known = {f.name for f in dataclasses.fields(TaskKind)} - {"name", "reward", "instructions", "default", "check"}
    for option in options:
        if option not in known:
            raise ValueError(f"task kind {name!r}: no option {option!r}; the options are {', '.join(sorted(known))}")
    for field_name, fn in (("reward", reward), ("check", check), *((k, options[k]) for k in ("key", "workers", "parse")
                                                                   if options.get(k) is not None)):
        if not callable(fn):
            raise ValueError(f"task kind {name!r}: {field_name} must be a function, got {shortened(repr(fn))}")
    data = options.get("data", {})
    if not (isinstance(data, dict) and set(data) <= {"toy", "real"} and all(isinstance(v, str) for v in data.values())):
        raise ValueError(f"task kind {name!r}: data is {{'toy': NAME, 'real': NAME}} (either may be left out), got "
                         f"{shortened(repr(data))}")
    for field_name, low in (("max_new_tokens", 1), ("rounds", 0)):
        value = options.get(field_name, low)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            raise ValueError(f"task kind {name!r}: {field_name} must be an int >= {low}, got {value!r}")
    roles = [*instructions, *options.get("default_for", ())]
    if not (isinstance(instructions, dict) and all(isinstance(r, str) and r for r in roles)):
        raise ValueError(f"task kind {name!r}: instructions are {{role: text}} and default_for a tuple of role names")


def check_name(what: str, name) -> None:
    """A task kind's or a workflow's name: lower-case letters, digits and _, so that it is one
    word in a flag's choices and a run folder's name ("relay/v2" would make a folder in a folder)."""
    if not (isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_]*", name)):
        raise ValueError(f"{what} {name!r}: a name is lower-case letters, digits and _, starting with a letter")


def check_phrases(new: list, known, owner: str) -> None:
    """The phrase rules of fixed prompt text, the one place they are written: a ValueError in
    one line naming `owner` unless each string of `new` is one non-empty line with no spaces
    around it that, unless it equals a phrase of `known` (sharing a phrase is fine), neither holds
    one nor is held by one. The strings of `new` are checked in order, each then known to the
    next. Why: prompts are phrases and variable text joined by newlines, and a tokenizer that
    makes each phrase one token (the toy one) would split a phrase that holds another."""
    known = list(known)
    for text in new:
        if not isinstance(text, str) or not text or "\n" in text or text != text.strip():
            raise ValueError(f"{owner}: an instruction is one non-empty line with no spaces around it, "
                             f"got {shortened(text)}")
        clash = next((p for p in known if p != text and (p in text or text in p)), None)
        if clash is not None:
            inner, outer = (clash, text) if clash in text else (text, clash)
            raise ValueError(f"{owner}: the fixed prompt string {shortened(inner)} is inside {shortened(outer)}; "
                             "no phrase may hold another: reword the new one, or use the existing phrase whole")
        known.append(text)


def shortened(text, n: int = 40) -> str:
    """repr of `text`, cut to its first n characters and "..." when longer (for one-line errors)."""
    return repr(text[:n].rstrip() + "..." if isinstance(text, str) and len(text) > n else text)


def get(task: str) -> TaskKind:
    if task not in TASK_KINDS:
        raise ValueError(f"unknown task {task!r}; choose one of {tuple(TASK_KINDS)}")
    return TASK_KINDS[task]


def kind_of(record: dict) -> str:
    """The kind a record names ("kind": NAME), else the one whose marker field it holds; a
    ValueError says why there is none."""
    if "kind" in record:
        if record["kind"] not in TASK_KINDS:
            raise ValueError(f"'kind' {record['kind']!r} is not a task kind ({', '.join(TASK_KINDS)})")
        return record["kind"]
    marked = [k.name for k in TASK_KINDS.values() if k.marker and k.marker in record]
    if len(marked) != 1:
        markers = " or ".join(f"{k.marker!r} ({k.name})" for k in TASK_KINDS.values() if k.marker)
        raise ValueError(f"needs a 'kind' field ({', '.join(TASK_KINDS)}), or exactly one of {markers}")
    return marked[0]


def score(texts: list, problems: list, task: str) -> list[float]:
    """Rewards of a batch: texts[i] graded against problems[i] by the task kind's reward. Pairs
    of one problem (its id) with equal keys are graded once (so a key that leaves out the
    problem cannot pay one problem's grade to another); kind.workers(pairs) of the distinct
    pairs at a time (the code reward's sandbox workers and the math reward's sympy checks are
    processes, so threads overlap them)."""
    if len(texts) != len(problems):
        raise ValueError(f"score: {len(texts)} texts for {len(problems)} problems")
    kind = get(task)
    keys = [(p.get("id"), kind.key(t, p)) for t, p in zip(texts, problems)]
    first = {}
    for key, text, problem in zip(keys, texts, problems):
        first.setdefault(key, (text, problem))
    pairs = list(first.values())
    workers = kind.workers(pairs)
    if workers <= 1:
        results = [kind.reward(t, p) for t, p in pairs]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            results = list(ex.map(lambda pair: kind.reward(*pair), pairs))
    for (text, problem), r in zip(pairs, results):
        _check_reward(kind, problem, r)
    _note_partial(kind, [p for _, p in pairs], results)
    verdict = dict(zip(first, results))
    rewards = [float(verdict[k]) for k in keys]
    if task not in _LOOKED:
        _LOOKED.add(task)
        _note_all_zero(kind, texts, rewards)
    return rewards


_LOOKED: set = set()   # kinds whose first graded batch _note_all_zero has seen, in this process
ALL_ZERO_PARSED = 16   # parsed answers in a first batch paid 0 throughout that _note_all_zero reports
_NOTED: set = set()    # the keys note_once has printed for, in this process


def note_once(key, text: str) -> None:
    """`text` on stderr the first time this process is given `key` (a note that every step or
    batch would otherwise repeat)."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(text, file=sys.stderr)


def _check_reward(kind: TaskKind, problem: dict, r) -> None:
    """A reward is a number in [0, 1]: a NaN would write NaN weights at the first update, a 10 or
    a -5 would weigh one row over the rest and be counted correct or not by eval's > 0.5."""
    if not (isinstance(r, numbers.Real) and math.isfinite(r) and 0 <= r <= 1):
        raise Refused(f"task kind {kind.name!r}: the reward of record {problem.get('id')!r} is {shortened(r)}, "
                      f"not a number in [0, 1]; make {getattr(kind.reward, '__name__', 'its reward')} return one")


def _note_all_zero(kind: TaskKind, texts: list, rewards: list) -> None:
    """One line on stderr when a kind's first graded batch was paid 0 throughout and none of its
    answers parsed (`parse`; a kind without one: whether they parsed is not known), or when at
    least ALL_ZERO_PARSED of them parsed and still none was paid (a hard start, or a reward that
    compares unlike things: a parsed Fraction with the record's string)."""
    if any(rewards) or not texts:
        return
    parsed = None if kind.parse is None else sum(kind.parse(t) is not None for t in texts)
    check = "the instructions ask for what the reward reads"
    if parsed is None:
        why = "and it declares no parse=, so whether any parsed is not known"
    elif parsed == 0:
        why = "none of them parsed"
    elif parsed >= ALL_ZERO_PARSED:
        why = f"though {parsed} of them parsed"
        check = "the reward compares like with like (not a number with a string)"
    else:
        return
    print(f"note: task kind {kind.name!r}: every one of the {len(texts)} answers graded first was paid 0, {why}; "
          f"nothing is learned until some answer is paid: check that {check}", file=sys.stderr)


def _note_partial(kind: TaskKind, problems: list, rewards: list) -> None:
    """Once per kind: it pays partial credit, which accuracy counts as right above 0.5."""
    partial = next(((p, r) for p, r in zip(problems, rewards) if 0 < r < 1), None)
    if partial:
        note_once(("partial", kind.name), f"note: task kind {kind.name!r} pays partial credit ({float(partial[1]):g} "
                  f"for record {partial[0].get('id')!r}): training takes it as it is, but accuracy (eval.jsonl's "
                  f"acc, pass@k, the supervisors' skill) counts a reward above 0.5 as right")


# ---------------------------------------------------------------------------------------
# The two kinds of the paper. Their instructions are fixed prompt text (workflows.phrases):
# changing one changes the toy model's cache key. They name every built-in role, and their
# default is the generator's instruction, so a role of a fork's needs one of its own.

GENERATOR_MATH = "Solve the math problem step by step. Put the final answer in \\boxed{}."
GENERATOR_CODE = "Solve the programming problem in Python. Give your code in one ```python block."
REVISE_MATH = ("Your last attempt was judged wrong. Use the feedback to write a new full "
               "solution, with the final answer in \\boxed{}.")
REVISE_CODE = ("Your last attempt was judged wrong. Use the feedback to write new, corrected "
               "code in one ```python block.")
AGGREGATOR_MATH = ("Compare the numbered solutions and pick the one most likely correct. "
                   "Reply with its number as \\boxed{k}.")
AGGREGATOR_CODE = ("Compare the numbered solutions and pick the code most likely to pass all "
                   "tests. Reply with its number as \\boxed{k}.")
EVALUATOR_MATH = ("Check the last attempt. Give a short reason without revealing the answer, "
                  "then \\boxed{Correct} or \\boxed{Incorrect}.")
EVALUATOR_CODE = ("Check the code of the last attempt. Give a short reason without writing "
                  "code, then \\boxed{Correct} or \\boxed{Incorrect}.")
ORCHESTRATOR_MATH = ("Do not solve the problem. List up to 3 different strategies for it, one "
                     "per line, as STRATEGY k: <strategy>.")
ORCHESTRATOR_CODE = ("Do not write code. List up to 3 different strategies for the problem, one "
                     "per line, as STRATEGY k: <strategy>.")
WORKER_MATH = "Solve the math problem by following the given strategy. Put the final answer in \\boxed{}."
WORKER_CODE = ("Solve the programming problem by following the given strategy. Give your code "
               "in one ```python block.")
SYNTHESIZER_MATH = ("Read the candidate solutions, then write your own full solution. Put the "
                    "final answer in \\boxed{}.")
SYNTHESIZER_CODE = ("Read the candidate solutions, then write your own correct code. Give it in "
                    "one ```python block.")


def _math_reward(text: str, problem: dict) -> float:
    return rewards.math_reward(text, problem["answer"])


def _math_key(text: str, problem: dict):
    return rewards.last_boxed(text), problem.get("answer")


def _math_workers(pairs: list) -> int:
    """sympy's helpers when some pair may need them; else all are fast paths (equal strings,
    plain numbers), and threads would only add overhead."""
    hard = any(box is not None and rewards.needs_sympy(box, gold) for box, gold in (_math_key(*p) for p in pairs))
    return sandbox.helper_count("sympy") if hard else 1


def _check_math(record: dict) -> None:
    if "tests" in record:
        raise ValueError("a math record has an 'answer', not 'tests'")
    answer = record.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"'answer' must be a non-empty string, got {answer!r}")


def _code_reward(text: str, problem: dict) -> float:
    return rewards.code_reward(text, problem["tests"])


def _code_key(text: str, problem: dict):
    return rewards.last_code_block(text), json.dumps(problem.get("tests"), sort_keys=True)


def _code_workers(pairs: list) -> int:
    return sandbox.helper_count("sandbox")


def _check_code(record: dict) -> None:
    """The two kinds of test rewards.code_reward runs (rewards.py's docstring)."""
    if "answer" in record:
        raise ValueError("a code record has 'tests', not an 'answer'")
    tests = record.get("tests")
    if not isinstance(tests, dict):
        raise ValueError(f"'tests' must be a dict, got {type(tests).__name__}")
    if tests.get("kind") == "assert":
        _check_assert(tests)
    elif tests.get("kind") == "stdio":
        cases = tests.get("cases")
        if not isinstance(cases, list) or not cases:
            raise ValueError("stdio tests need a non-empty list 'cases'")
        for i, c in enumerate(cases):
            if not isinstance(c, dict) or not isinstance(c.get("stdin"), str) or not isinstance(c.get("stdout"), str):
                raise ValueError(f"stdio case {i} must be {{'stdin': str, 'stdout': str}}")
    else:
        raise ValueError(f"tests 'kind' must be 'assert' or 'stdio', got {tests.get('kind')!r}")


def _check_assert(tests: dict) -> None:
    if not isinstance(tests.get("test"), str) or not tests["test"].strip():
        raise ValueError("assert tests need a non-empty string 'test'")
    try:   # a test that is not Python would fail every program: nothing could be learned
        compile(tests["test"], "<test>", "exec")
    except SyntaxError as e:
        raise ValueError(f"the test is not valid Python ({e.msg}, line {e.lineno}): "
                         f"{tests['test'].strip()[:60]!r}") from None
    ep = tests.get("entry_point")
    if ep is not None and (not isinstance(ep, str) or not ep.isidentifier()):
        raise ValueError(f"'entry_point' must be a function name or None, got {ep!r}")
    if ep is None and re.search(r"^def check\s*\(", tests["test"], re.M):
        raise ValueError("a test that defines check(candidate) needs an 'entry_point'")


register_task(
    "math", _math_reward, check=_check_math, default=GENERATOR_MATH, revise=REVISE_MATH,
    instructions={"generator": GENERATOR_MATH, "aggregator": AGGREGATOR_MATH, "evaluator": EVALUATOR_MATH,
                  "orchestrator": ORCHESTRATOR_MATH, "worker": WORKER_MATH, "synthesizer": SYNTHESIZER_MATH},
    max_new_tokens=5120, rounds=3, data={"toy": "toy_math", "real": "dapo_math"}, marker="answer",
    key=_math_key, workers=_math_workers, default_for=("generator",), parse=rewards.last_boxed)
register_task(
    "code", _code_reward, check=_check_code, default=GENERATOR_CODE, revise=REVISE_CODE,
    instructions={"generator": GENERATOR_CODE, "aggregator": AGGREGATOR_CODE, "evaluator": EVALUATOR_CODE,
                  "orchestrator": ORCHESTRATOR_CODE, "worker": WORKER_CODE, "synthesizer": SYNTHESIZER_CODE},
    max_new_tokens=2048, rounds=2, data={"toy": "toy_code", "real": "deepcoder"}, marker="tests",
    key=_code_key, workers=_code_workers, default_for=("generator",), parse=rewards.last_code_block)


# ---------------------------------------------------------------------------------------
# arith: a kind registered the way a fork registers one (README, "Forking"), for the one real
# model that installs offline (--scale smollm2-135m): under math's \boxed{} rule it earns
# nothing, so GRPO would get no signal; graded on the last number it writes, it sometimes
# passes. Its data (tasks.py, `arith`) is generated offline. The supervisors' instructions are
# math's (shared phrases); the solution roles take the generator's. Not a toy kind: the toy
# world holds the math and code kinds' phrases alone (toy.BUILT_IN_KINDS).

GENERATOR_ARITH = "Solve the arithmetic problem. End your reply with the answer as a number."
# The cap leaves the untrained model's answers whole: SmolLM2-135M-Instruct's `single` answers
# on the test split (T 0.7) run long-tailed, half past 48 tokens and about 4% past 256 (a few
# ramble to 512), so 48 would grade half of step 0's answers as cut (0) and RL's first gain would
# be learning to stop; at 256 what is graded is mostly what the model would have said.
ARITH_MAX_NEW_TOKENS = 256


def _arith_reward(text: str, problem: dict) -> float:
    return rewards.number_reward(text, problem["answer"])


def _arith_key(text: str, problem: dict):
    return rewards.last_number(text), problem.get("answer")


def _check_arith(record: dict) -> None:
    answer = record.get("answer")
    if not isinstance(answer, str) or not re.fullmatch(r"-?\d+", answer.strip()):
        raise ValueError(f"'answer' must be an integer written as a string, got {answer!r}")


register_task(
    "arith", _arith_reward, check=_check_arith, default=GENERATOR_ARITH,
    instructions={"generator": GENERATOR_ARITH, "aggregator": AGGREGATOR_MATH, "evaluator": EVALUATOR_MATH,
                  "orchestrator": ORCHESTRATOR_MATH},
    max_new_tokens=ARITH_MAX_NEW_TOKENS, rounds=3, data={"real": "arith"}, key=_arith_key, parse=rewards.last_number)
