"""Workflows: roles, prompts, output parsers, and each workflow as a function over a batch.

Four workflows, run stage by stage over a batch of episodes. A stage (`stage`) is ONE call
`llm(role, slots, messages_list, keys)` for every live episode together (a stage with no live
episode makes no call), and it keeps the books: each prompt carries the instruction of the role
it runs, each row's key is taken where its `Call` is appended to its episode, in order. A
workflow says only what differs (who runs, what each row is shown, what is graded) and sets
each episode's `final_text`.

| workflow       | stages (slots)                                          | graded text          |
|----------------|---------------------------------------------------------|----------------------|
| `single`       | generator                                               | the generator's      |
| `voting`       | generator0..2 (identical prompts) -> aggregator         | the chosen solution  |
| `eval_opt`     | generator -> (evaluator -> generator) x up to R rounds  | the last generator's |
| `orch_workers` | orchestrator -> 1-3 worker -> synthesizer               | the synthesizer's    |

Exact choices:
- Voting: `n_voters=3`; the aggregator answers `\\boxed{k}` (1-based). Fallbacks: the first lone
  digit 1-9 in its text that is a valid index, else 1.
- Eval-Opt: `max_rounds=None` means the task kind's rounds: 3 for math, 2 for code. The evaluator
  sees the problem and every attempt and feedback so far; `\\boxed{Correct}` (any case) stops
  the episode; `\\boxed{Incorrect}` or no verdict (a fallback) asks the generator for a new
  solution, shown the problem, all its attempts and all feedback. All Incorrect with 3 rounds
  is G E G E G E G.
- Orch-Workers: the orchestrator writes lines `STRATEGY k: ...`; distinct ones are kept, at
  most `max_strategies=3`. None parsed -> one worker with DIRECT_STRATEGY; duplicates dropped
  or extras cut -> also a fallback. Each worker gets exactly one strategy; the synthesizer sees
  every worker solution and writes the final answer itself.
- Every fallback taken adds 1 to `episode.fallbacks[role]`; a role whose output is parsed gets
  the key even at 0, so fallbacks / calls is that role's unparsable-output rate.
- Prompts: a system message holding one instruction and a user message. The instruction of a
  role on a task is the workflow's own when it registered one, else the task kind's for that
  role (taskkinds.py; math and code have one per role), else the kind's default, which only the
  roles the kind wrote it for (its `default_for`) may take. The user message is only headers
  (USER_PHRASES, and those a registration declares) and variable text (problem, solutions,
  feedback, strategy) joined by "\\n". `phrases()` lists every fixed string, and none holds
  another (taskkinds.check_phrases), so a tokenizer that knows them as whole tokens (the toy
  one) spends one token per fixed string. The orchestrator's instruction asks for
  "up to 3" strategies (the paper's value); `max_strategies` is the parser's cap. The code
  problem's text already carries its starter code or stdin/stdout format, so code prompts add
  nothing to it.
- Math roles that answer end with `\\boxed{}`; code roles answer in one ```python block.
- An earlier call's text embedded in a later prompt (solutions, attempts) goes through
  `llm.clip` first when the llm has one (rollout.py's bounds each to --max-embed-tokens), so a
  long solution shortens itself instead of pushing the problem out of the prompt; the graded
  text is never shortened.

No torch here: `llm` is any callable with the contract below (rollout.py builds the real one,
tests use a scripted fake). Run: `run_workflow("voting", episodes, llm, "math")`; tests:
`python -m pytest -q tests/test_workflows.py`.

A new workflow is one `register(name, fn, slots, kinds=..., instructions=..., headers=...,
params=...)` call: train.py's and eval.py's `--workflow` choices and parameter flags, sweep.py's
cells and axes, analysis.py's role groups and plots.py's colours all read the registry. What a
registration leaves unsaid or gets wrong is refused in one line, never filled in: at `register`
(a name taken or not lower-case letters, digits and _, a slot two roles share, an instruction
or kind for a role it does not declare, text that breaks the phrase rules or changes another
workflow's prompt, a parameter its function does not take or with another default) or at a
run's start (`check_run`, called by train.py's flags, eval.py and run_workflow: a parameter's
value, a role with no instruction written for it; and a dry run of the workflow with an llm
that writes nothing, which checks every stage's role, slots, row keys and instruction, the
fixed text of every prompt, that every call is in its episode and that every episode has its
graded answer, before anything is sampled). The same checks hold for every stage of a real run
(`Broken`: one line).
"""
import inspect
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import taskkinds
from rewards import last_boxed


@dataclass
class Call:
    """One single-turn chat completion made by one role; becomes one training sample."""
    role: str                     # role type: 'generator', 'aggregator', 'evaluator', ...
    slot: str                     # position in the workflow: 'generator0', 'worker', ...
    messages: list                # chat messages [{'role': 'system'|'user', 'content': str}]
    text: str = ""                # the completion as decoded text (what the workflow read)
    prompt_ids: list = field(default_factory=list)      # token ids of the rendered prompt
    completion_ids: list = field(default_factory=list)  # sampled ids, stop token included
    logprobs: list = field(default_factory=list)        # sampler logprob of each completion id
    finished: bool = True         # False: cut at the length limit before a stop token
    prompt_cut: bool = False      # True: its prompt kept only its last --max-prompt-tokens ids
    reward: float | None = None   # what this call is paid, when not its episode's reward (`pay`)


@dataclass
class Episode:
    """One rollout of a workflow on one problem."""
    problem: dict                 # task record: id, prompt, answer|tests, source
    rollout: int = 0              # index among the G rollouts of this problem
    calls: list = field(default_factory=list)           # every Call, in the order made
    final_text: str | None = None   # the text that is graded; the workflow sets it (run_workflow checks)
    reward: float = 0.0           # 0/1 reward of final_text, paid to every call (but see `pay`)
    fallbacks: dict = field(default_factory=dict)       # role -> parser fallbacks taken
    stream: tuple = ()            # what its draws are for, e.g. ("train", step): see `stage`

    @property
    def problem_id(self) -> str:
        return str(self.problem["id"])


@dataclass(frozen=True)
class Param:
    """A setting of a workflow: the keyword `name` of its function, an int, float or str within
    `range` (both ends allowed), set by train.py's and eval.py's flag --FLAG (FLAG: the keyword
    with dashes unless given; config.json keeps it as `dest`) and swept by sweep.py's --axis
    FLAG=V1,V2. `default` is the function's, shown in --help (None: the help says what unset means)."""
    name: str
    type: type
    default: object
    range: tuple
    help: str
    flag: str = ""

    def __post_init__(self):
        object.__setattr__(self, "flag", self.flag or self.name.replace("_", "-"))

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")


# llm(role, slots, messages_list, keys=keys) -> one Call per (slot, messages), in order, text
# filled in; keys[i] names row i, so that its random draws depend on it alone: a workflow calls
# it through `stage`, which builds each prompt and names each row (_check_stage refuses a bare
# call without keys or with another role's instruction).
LLM = Callable[..., list]


# The registry, filled by `register` at the end of this file: a fork adds a workflow with one
# `register(...)` call, and train.py, eval.py and sweep.py read their choices from here.
WORKFLOWS: dict[str, Callable] = {}
# Role types of each workflow: under `isolated` sharing each role type owns one adapter.
ROLES: dict[str, tuple[str, ...]] = {}
# Each role's slots (positions in the workflow), {role: (slot, ...)}, as a function of the
# parameters' values (slot_table): GRPO groups samples by (problem, slot), so no slot is two
# roles'. Voting with n_voters=n gives the generator generator0..generator{n-1}.
SLOTS: dict[str, Callable[..., dict]] = {}
# Parameters of each workflow (Param), the keywords of its function that flags set.
PARAMS: dict[str, tuple] = {}
# User-message headers a workflow declares beside USER_PHRASES (fixed text, so phrases).
HEADERS: dict[str, tuple[str, ...]] = {}
# Names registered again on purpose (register(..., replace=True)): a run of one says so.
REPLACED: set = set()
# What each role type does, for the analysis (analysis.py): "solution" roles write a solution
# that can be graded, "supervisory" roles judge or choose among solutions others wrote (the
# paper's evaluator and aggregator), "planning" roles direct others without solving (the
# orchestrator: it neither writes nor judges a solution, so it is in neither group of the
# paper's supervisor / generator gradient ratio).
ROLE_KINDS: dict[str, str] = {"generator": "solution", "worker": "solution", "synthesizer": "solution",
                              "aggregator": "supervisory", "evaluator": "supervisory",
                              "orchestrator": "planning"}
KINDS = ("solution", "supervisory", "planning")

# ---------------------------------------------------------------------------------------
# Fixed prompt text. Nothing else fixed may appear in a prompt: see phrases() below.

# headers that introduce variable text in a user message
PROBLEM = "Problem:"
ATTEMPT = "Attempt:"
FEEDBACK = "Feedback:"
STRATEGY = "Strategy:"
# numbered headers are listed one by one so each is a single phrase; 9 because the
# aggregator's fallback reads one lone digit
SOLUTION_HEADERS = tuple(f"Solution {k}:" for k in range(1, 10))
# the worker's strategy when the orchestrator gave no parsable one
DIRECT_STRATEGY = "Solve the problem directly."
# every fixed string a user message may hold
USER_PHRASES = (PROBLEM, ATTEMPT, FEEDBACK, STRATEGY, *SOLUTION_HEADERS, DIRECT_STRATEGY)

# Each role's system instruction on each task comes from the task kind (taskkinds.py): the
# instructions it names, else its default; a workflow may register instructions of its own
# for a role on a task (ROLE_INSTRUCTIONS), and those come first. The dict is keyed by (role,
# task), not by workflow: an entry is that role's prompt in every workflow, so `register`
# refuses one that would change an instruction a (role, task) already has.
ROLE_INSTRUCTIONS: dict[tuple[str, str], str] = {}


def instruction(role: str, task: str) -> str:
    """The system instruction of `role` on `task`."""
    return ROLE_INSTRUCTIONS.get((role, task)) or taskkinds.get(task).instruction(role)


def phrases(kinds: tuple | None = None, registered: bool = True) -> tuple[str, ...]:
    """Every fixed string any prompt contains, each once: USER_PHRASES, then the task
    kinds' instructions role by role (each role's for every kind in turn), their revision
    turns' and defaults, then (`registered`) the workflows' own instructions and headers.
    `kinds`: only these task kinds (default: every registered one). None holds another or a newline
    (taskkinds.check_phrases, at registration and at a run's start); the toy tokenizer makes
    the built-in ones one token each (toy.phrases)."""
    kinds = [taskkinds.TASK_KINDS[k] for k in kinds] if kinds is not None else list(taskkinds.TASK_KINDS.values())
    roles = dict.fromkeys(role for k in kinds for role in k.instructions)
    told = [k.instructions[role] for role in roles for k in kinds if role in k.instructions]
    own = [*(k.revision() for k in kinds), *(k.default for k in kinds),
           *((*ROLE_INSTRUCTIONS.values(), *(h for hs in HEADERS.values() for h in hs)) if registered else ())]
    return tuple(dict.fromkeys((*USER_PHRASES, *told, *own)))


PARSED = ("supervisory", "planning")   # role kinds whose output a parser reads in a fixed format


def check_run(workflow: str, task: str, params: dict | None = None) -> None:
    """A ValueError in one line unless `workflow` may run on `task` with these parameter values
    (None: its defaults), before anything is sampled: its slot table holds (slot_table); every
    role runs on an instruction written for it (_check_instruction_of); the task kind's strings
    keep the phrase rules beside the headers and the workflows' instructions (register_task
    could check them against the other kinds only); and a dry run of the workflow (_dry_run)
    checks each stage and the fixed text of each prompt. train.py's flags, eval.py and
    run_workflow call it first."""
    if workflow not in WORKFLOWS:
        raise ValueError(f"unknown workflow {workflow!r}; choose one of {sorted(WORKFLOWS)}")
    kind, params = taskkinds.get(task), dict(params or {})
    _check_values(workflow, params)
    table = slot_table(workflow, **params)
    for role in ROLES[workflow]:
        _check_instruction_of(workflow, role, kind)
    taskkinds.check_phrases(kind.phrases(), phrases(), f"task kind {task!r}")
    _dry_run(workflow, task, table, params)


def _check_values(workflow: str, params: dict) -> None:
    """Each value is a parameter of the workflow's (PARAMS), of its type and within its range
    (None: unset), as train.py's flags check them: the workflow function need not."""
    declared = {p.name: p for p in PARAMS[workflow]}
    for name, value in params.items():
        p = declared.get(name)
        if p is None:
            raise ValueError(f"workflow {workflow!r} has no parameter {name!r} (its parameters: "
                             f"{', '.join(declared) or 'none'})")
        typed = isinstance(value, p.type) or (p.type is float and isinstance(value, int))
        if value is not None and not (typed and not isinstance(value, bool) and p.range[0] <= value <= p.range[1]):
            raise ValueError(f"workflow {workflow!r}: {name} must be a {p.type.__name__} in "
                             f"{p.range[0]}..{p.range[1]}, got {value!r}")


def _check_instruction_of(workflow: str, role: str, kind) -> None:
    """`role` has an instruction of its own on the kind (the workflow's registered one, or the
    kind's for that role), or is a role the kind's default was written for (`default_for`) and
    not one whose output is parsed. Else it would be asked another role's question (math's
    default is the generator's "Solve the math problem..."): a parser would fall back on every
    call, and under --credit own a solution role would be paid the grade of an answer it was
    never meant to write."""
    if _own_instruction(role, kind.name) is not None:
        return
    if ROLE_KINDS[role] in PARSED:
        raise ValueError(f"workflow {workflow!r} on task {kind.name!r}: the {role}'s output is parsed (a "
                         f"{ROLE_KINDS[role]} role), but it has no instruction of its own on {kind.name}, only the "
                         f"task kind's default, written for another role; give it one: {_fix(workflow, role, kind.name)}")
    if role not in kind.default_for:
        raise ValueError(f"workflow {workflow!r} on task {kind.name!r}: the {role} has no instruction of its own on "
                         f"{kind.name}, only the task kind's default, written for "
                         f"{' and '.join(kind.default_for) or 'no role'}; give it one: {_fix(workflow, role, kind.name)}")


def unwritten(workflow: str, task: str) -> str | None:
    """Why `workflow` cannot run on `task` for want of an instruction written for one of its
    roles (check_run's first refusal of that kind, in one line), or None: sweep.py leaves such a
    cell of a default matrix out, where a run named on the command line is refused."""
    try:
        for role in ROLES[workflow]:
            _check_instruction_of(workflow, role, taskkinds.get(task))
    except ValueError as e:
        return str(e)
    return None


def replaced(workflow: str, task: str) -> list[str]:
    """A line for the workflow and the task kind of a run when a registration replaced the one
    of that name on purpose (replace=True): the run's start says so."""
    return ([f"note: workflow {workflow!r} is a replacement registered with replace=True"] * (workflow in REPLACED)
            + [f"note: task kind {task!r} is a replacement registered with replace=True"] * (task in taskkinds.REPLACED))


def _own_instruction(role: str, task: str) -> str | None:
    """The instruction `role` has on `task` of its own: a workflow's registered one, else the
    task kind's for that role; None when it would get only the kind's default."""
    kind = taskkinds.TASK_KINDS.get(task)
    return ROLE_INSTRUCTIONS.get((role, task)) or (kind.instructions.get(role) if kind else None)


def _fix(workflow: str, role: str, task: str) -> str:
    """The registration that gives `role` its instruction on `task`: the task kind's, for a role
    some kind names (a built-in role on a new kind); the workflow's, for a role of its own."""
    if any(role in k.instructions for k in taskkinds.TASK_KINDS.values()):
        return f"register_task({task!r}, ..., instructions={{{role!r}: ...}})"
    return f"register({workflow!r}, ..., instructions={{({role!r}, {task!r}): ...}})"


def prompt(role: str, task: str, problem: dict, parts: tuple = (), revise: bool = False) -> list[dict]:
    """The messages of one call: `role`'s instruction on `task` (the kind's revision turn when
    `revise`) as the system message; the user message is PROBLEM, the problem's text, then
    `parts` (phrases and variable text, nothing else), joined by "\\n"."""
    system = taskkinds.get(task).revision() if revise else instruction(role, task)
    user = "\n".join([PROBLEM, problem["prompt"], *parts])
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _numbered(texts: list[str]) -> list[str]:
    if len(texts) > len(SOLUTION_HEADERS):
        raise ValueError(f"at most {len(SOLUTION_HEADERS)} numbered solutions, got {len(texts)}")
    out = []
    for header, text in zip(SOLUTION_HEADERS, texts):
        out += [header, text]
    return out


def _conversation(history: list[str]) -> list[str]:
    # Eval-Opt history alternates attempt, feedback, attempt, ... in the order written
    out = []
    for i, text in enumerate(history):
        out += [ATTEMPT if i % 2 == 0 else FEEDBACK, text]
    return out


# ---------------------------------------------------------------------------------------
# Each built-in role's prompt, as the workflows below build it through `stage` and as toy.py's
# warm-start transcripts build it: problem is a task record; its "prompt" is the text every role sees.

def generator_messages(problem: dict, task: str, history: list[str] = ()) -> list[dict]:
    """First answer (empty history), or an Eval-Opt revision given every attempt and feedback."""
    return prompt("generator", task, problem, _conversation(history), revise=bool(history))


def aggregator_messages(problem: dict, task: str, solutions: list[str]) -> list[dict]:
    return prompt("aggregator", task, problem, _numbered(solutions))


def evaluator_messages(problem: dict, task: str, history: list[str]) -> list[dict]:
    """history ends with the attempt to judge."""
    return prompt("evaluator", task, problem, _conversation(history))


def orchestrator_messages(problem: dict, task: str) -> list[dict]:
    return prompt("orchestrator", task, problem)


def worker_messages(problem: dict, task: str, strategy: str) -> list[dict]:
    return prompt("worker", task, problem, (STRATEGY, strategy))


def synthesizer_messages(problem: dict, task: str, solutions: list[str]) -> list[dict]:
    return prompt("synthesizer", task, problem, _numbered(solutions))


# ---------------------------------------------------------------------------------------
# Output parsers: each returns (value, fallback_taken).

_LONE_DIGIT = re.compile(r"(?<!\d)[1-9](?!\d)")
_INT = re.compile(r"\s*(\d+)\s*")
_TEXT_WRAP = re.compile(r"\s*\\text\w*\s*\{(.*)\}\s*", re.DOTALL)   # \boxed{\text{Correct}}
_STRATEGY_LINE = re.compile(r"^[ \t]*STRATEGY[ \t]*\d*[ \t]*:(.*)$", re.MULTILINE | re.IGNORECASE)


def parse_choice(text: str, n: int) -> tuple[int, bool]:
    """Aggregator's 1-based pick among n solutions: the last \\boxed{k} if 1 <= k <= n, else the
    first lone digit 1-9 that is a valid index, else 1."""
    boxed = last_boxed(text)
    m = _INT.fullmatch(boxed) if boxed is not None else None
    if m and 1 <= int(m.group(1)) <= n:
        return int(m.group(1)), False
    for d in _LONE_DIGIT.finditer(text):
        if int(d.group()) <= n:
            return int(d.group()), True
    return 1, True


def parse_verdict(text: str) -> tuple[bool, bool]:
    """Evaluator's verdict from its last \\boxed{}: Correct/Incorrect in any case. Anything else
    counts as Incorrect (so the generator gets another turn) and as a fallback."""
    boxed = last_boxed(text)
    if boxed is not None:
        m = _TEXT_WRAP.fullmatch(boxed)
        verdict = (m.group(1) if m else boxed).strip().lower()
        if verdict in ("correct", "incorrect"):
            return verdict == "correct", False
    return False, True


def parse_strategies(text: str, max_strategies: int = 3) -> tuple[list[str], bool]:
    """Orchestrator's strategies from lines `STRATEGY k: ...` (k optional, any case): distinct
    ones (whitespace and case ignored) in order, at most max_strategies. A fallback when none
    parse ([DIRECT_STRATEGY]) or when empty, duplicate or extra lines were dropped."""
    lines = [s.strip() for s in _STRATEGY_LINE.findall(text)]
    kept, seen = [], set()
    for s in filter(None, lines):     # a `STRATEGY k:` line with no text is dropped
        key = " ".join(s.lower().split())
        if key not in seen:
            seen.add(key)
            kept.append(s)
    if not kept:
        return [DIRECT_STRATEGY], True
    kept = kept[:max_strategies]
    return kept, len(kept) != len(lines)


def _count(episode: Episode, role: str, taken: bool) -> None:
    episode.fallbacks[role] = episode.fallbacks.get(role, 0) + int(taken)


# ---------------------------------------------------------------------------------------
# Workflows: fn(episodes, llm, task, **params) -> None; its stages append the calls, and it
# sets each episode's final_text.

def stage(llm: LLM, task: str, role: str, owners: list, parts: list | None = None, slots: list | None = None,
          revise: bool = False) -> list[Call]:
    """One stage = one llm call for every row together; no call when there is no row. Row i is
    owners[i]'s (an Episode), its prompt `prompt(role, task, its problem, parts[i], revise)`
    (so a role's prompt carries its own instruction), its slot slots[i] (default: the role's
    name); its Call is appended to owners[i], in row order, and returned. The row's key is its
    stream, problem id, rollout and the index its call takes in the episode: taken here, where
    the call is appended, no two calls of an episode share one, whatever else shares the stage."""
    parts, slots = _rows(task, role, owners, parts, slots)
    if not owners:
        return []
    keys, before = [], Counter()
    for ep in owners:
        keys.append((*ep.stream, ep.problem_id, ep.rollout, len(ep.calls) + before[id(ep)]))
        before[id(ep)] += 1
    calls = llm(role, slots, [prompt(role, task, ep.problem, p, revise) for ep, p in zip(owners, parts)], keys=keys)
    if len(calls) != len(owners):
        raise RuntimeError(f"llm returned {len(calls)} calls for {len(owners)} {role} prompts")
    for ep, call in zip(owners, calls):
        ep.calls.append(call)
    return calls


def _rows(task: str, role: str, owners: list, parts: list | None, slots: list | None) -> tuple[list, list]:
    """A stage's parts and slots, one per row (defaults: none shown beyond the problem; the
    role's own slot), after checking what it was given (Broken for the arguments of another
    signature, such as an older stage's, so that the dry run refuses them)."""
    if not (isinstance(task, str) and isinstance(role, str) and all(isinstance(ep, Episode) for ep in owners)):
        raise Broken(f"stage(llm, task, role, owners, parts=None, slots=None, revise=False): owners are Episodes, "
                     f"got task={taskkinds.shortened(task)}, role={taskkinds.shortened(role)}")
    parts, slots = parts or [()] * len(owners), slots or [role] * len(owners)
    if not len(parts) == len(slots) == len(owners):
        raise Broken(f"stage of the {role}: {len(owners)} owners, {len(parts)} parts, {len(slots)} slots; "
                     "give one of each per row")
    return parts, slots


def _clipper(llm: LLM) -> Callable[[str], str]:
    """How an earlier call's text is shortened before it is embedded in a later prompt (the
    solutions an aggregator or synthesizer reads, the attempts an evaluator reads): `llm.clip`
    when the llm has one (rollout.py's keeps the head and tail of a long text, so the
    instruction and the problem are never cut), else unchanged."""
    return getattr(llm, "clip", None) or (lambda text: text)


def single(episodes: list[Episode], llm: LLM, task: str) -> None:
    for ep, call in zip(episodes, stage(llm, task, "generator", episodes)):
        ep.final_text = call.text


def voting(episodes: list[Episode], llm: LLM, task: str, n_voters: int = 3) -> None:
    n, clip = n_voters, _clipper(llm)
    # all voters of all episodes in one stage; identical prompts, so the sampler can share prefill
    gen = stage(llm, task, "generator", [ep for ep in episodes for _ in range(n)],
                slots=[f"generator{i}" for i in range(n)] * len(episodes))
    agg = stage(llm, task, "aggregator", episodes, [_numbered([clip(c.text) for c in gen[i * n:(i + 1) * n]])
                                                    for i in range(len(episodes))])
    for i, (ep, call) in enumerate(zip(episodes, agg)):
        k, fallback = parse_choice(call.text, n)
        _count(ep, "aggregator", fallback)
        ep.final_text = gen[i * n + k - 1].text     # the chosen solution, in full, is graded


def eval_opt(episodes: list[Episode], llm: LLM, task: str, max_rounds: int | None = None) -> None:
    rounds = taskkinds.get(task).rounds if max_rounds is None else max_rounds
    history = [[] for _ in episodes]          # per episode: attempt, feedback, attempt, ...
    live, clip = list(range(len(episodes))), _clipper(llm)    # episodes not yet judged Correct

    def shown():                              # every attempt and feedback so far, of each live one
        return [_conversation([clip(t) for t in history[i]]) for i in live]
    for r in range(rounds + 1):
        # the first answers, then the revisions (the kind's revision turn)
        for i, call in zip(live, stage(llm, task, "generator", [episodes[i] for i in live], shown(), revise=r > 0)):
            history[i].append(call.text)
            episodes[i].final_text = call.text    # the last generator answer is graded
        if r == rounds:
            break
        judged = stage(llm, task, "evaluator", [episodes[i] for i in live], shown())
        for i, call in zip(list(live), judged):
            correct, fallback = parse_verdict(call.text)
            _count(episodes[i], "evaluator", fallback)
            if correct:
                live.remove(i)
            else:
                history[i].append(call.text)


def orch_workers(episodes: list[Episode], llm: LLM, task: str, max_strategies: int = 3) -> None:
    plans = []
    for ep, call in zip(episodes, stage(llm, task, "orchestrator", episodes)):
        strategies, fallback = parse_strategies(call.text, max_strategies)
        _count(ep, "orchestrator", fallback)
        plans.append(strategies)
    # every worker of every episode in one stage, one strategy each
    owners = [i for i, plan in enumerate(plans) for _ in plan]
    work = stage(llm, task, "worker", [episodes[i] for i in owners], [(STRATEGY, s) for plan in plans for s in plan])
    solutions, clip = [[] for _ in episodes], _clipper(llm)
    for i, call in zip(owners, work):
        solutions[i].append(clip(call.text))
    for ep, call in zip(episodes, stage(llm, task, "synthesizer", episodes, [_numbered(s) for s in solutions])):
        ep.final_text = call.text             # the synthesizer's own answer is graded


# ---------------------------------------------------------------------------------------
# Credit: what each call is paid, once every episode's final text is graded.

CREDITS = ("final", "own")   # train.py --credit


def pay(episodes: list[Episode], credit: str, grade: Callable[[list, list], list]) -> None:
    """Under `final` (the paper) every call is paid its episode's reward and nothing changes.
    Under `own`, every call of a solution role (ROLE_KINDS: a voter, a worker, each Eval-Opt
    attempt, the synthesizer) is paid the grade of its own text, `grade(texts, problems)`, in
    Call.reward; supervisory and planning roles keep the episode's reward. So a voter that was
    right is paid 1 even when the aggregator picked a wrong answer, and the reverse."""
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {CREDITS}, got {credit!r}")
    if credit == "final":
        return
    own = [(ep, c) for ep in episodes for c in ep.calls if ROLE_KINDS.get(c.role) == "solution"]
    for (_, c), r in zip(own, grade([c.text for _, c in own], [ep.problem for ep, _ in own])):
        c.reward = float(r)


def register(name: str, fn: Callable, slots, kinds: dict | None = None, instructions: dict | None = None,
             headers: tuple = (), params: tuple = (), replace: bool = False) -> None:
    """Add a workflow: `fn(episodes, llm, task, **params)`; its slots per role type, {role: (slot,
    ...)} or a function of the parameters' values that gives them (the role types: one adapter
    each under isolated; the slots: the advantage groups); for new role types their kinds
    (ROLE_KINDS); system instructions of its own {(role, task): text}; the user-message headers
    it adds to USER_PHRASES; and its parameters (Param: flags of train.py and eval.py, axes of
    sweep.py). Nothing is registered when a check fails (taskkinds.Refused: one line, even
    uncaught as the module is imported): a name that exists (unless `replace`, which a run of it
    then reports), a bad slot table (_slot_table), a role with no kind or another kind than it
    has, an instruction for a (role, task) that has one of its own with another text
    (ROLE_INSTRUCTIONS is every workflow's: a new role name gives a prompt of its own), text
    that breaks the phrase rules (taskkinds.check_phrases), a bad parameter."""
    kinds, instructions, headers = dict(kinds or {}), dict(instructions or {}), tuple(headers)
    with taskkinds.refusing():
        taskkinds.check_name("workflow", name)
        if name in WORKFLOWS and not replace:
            raise ValueError(f"workflow {name!r} exists; choose another name, or pass replace=True to "
                             f"replace it on purpose")
        table = _slot_table(name, slots() if callable(slots) else slots)
        stray = next((role for role, _ in [*kinds.items(), *instructions] if role not in table), None)
        if stray is not None:
            raise ValueError(f"workflow {name!r}: its kinds or instructions name the role {stray!r}, which its slots "
                             f"do not declare ({', '.join(table)}); declare it or drop the entry")
        resolved = {role: _kind_of(name, role, kinds.get(role)) for role in table}
        for key, text in instructions.items():
            _check_instruction(name, key, text)
        taskkinds.check_phrases([*headers, *instructions.values()], phrases(), f"workflow {name!r}")
        keywords = _keywords(name, fn)
        for p in params:
            _check_param(name, p, keywords)
    if name in WORKFLOWS:
        REPLACED.add(name)
    WORKFLOWS[name], ROLES[name], PARAMS[name], HEADERS[name] = fn, tuple(table), tuple(params), headers
    SLOTS[name] = slots if callable(slots) else (lambda **_: table)
    ROLE_KINDS.update(resolved)
    ROLE_INSTRUCTIONS.update(instructions)


def _slot_table(workflow: str, given) -> dict:
    """{role: (slot, ...)} from `given` ({role: a slot or slots}); a ValueError in one line for
    another shape, a role with no slot, or a slot two roles share (GRPO groups rows by
    (problem, slot), so their advantages would mix)."""
    if not isinstance(given, dict) or not given:
        raise ValueError(f"workflow {workflow!r}: slots are {{role: (slot, ...)}}, one entry per role, got "
                         f"{taskkinds.shortened(repr(given))}")
    table, owner = {}, {}
    for role, names in given.items():
        names = (names,) if isinstance(names, str) else tuple(names)
        if not (isinstance(role, str) and role and names and all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"workflow {workflow!r}: role {role!r} needs one slot name or more, got {names!r}")
        for slot in names:
            if owner.setdefault(slot, role) != role:
                raise ValueError(f"workflow {workflow!r}: slot {slot!r} is both the {owner[slot]}'s and the {role}'s; "
                                 f"advantages are grouped by (problem, slot), so their rows would share a group: "
                                 f"give the {role} slots of its own")
        table[role] = tuple(dict.fromkeys(names))
    return table


def _kind_of(workflow: str, role: str, kind: str | None) -> str:
    """The kind of `role`: the one it has (ROLE_KINDS is every workflow's, so no other), else
    the one declared."""
    have = ROLE_KINDS.get(role)
    if have is not None and kind not in (None, have):
        raise ValueError(f"workflow {workflow!r}: role {role!r} is {have} in every workflow, not {kind}; "
                         f"a role of another kind needs a new name")
    if (have or kind) not in KINDS:
        raise ValueError(f"workflow {workflow!r}: role {role!r} needs a kind, one of {KINDS}")
    return have or kind


def _check_instruction(workflow: str, key, text) -> None:
    """One of register's instructions: keyed (role, task), and no other text for a (role, task)
    that already has an instruction of its own (a task kind's, or another registration's)."""
    if not (isinstance(key, tuple) and len(key) == 2):
        raise ValueError(f"workflow {workflow!r}: instructions are {{(role, task): text}}, got the key {key!r}")
    role, task = key
    own = _own_instruction(role, task)
    if own is not None and own != text:
        raise ValueError(f"workflow {workflow!r}: the {role} on {task} already has the instruction "
                         f"{taskkinds.shortened(own)}, which every workflow's {role} reads; a prompt of its own "
                         f"needs a new role name (e.g. {workflow}_{role}, with its kind)")


def _keywords(workflow: str, fn: Callable) -> dict | None:
    """{keyword: default} of `fn` beyond (episodes, llm, task), after checking it takes those
    three; None when it takes **params (any keyword)."""
    try:
        sig = inspect.signature(fn)
        sig.bind(None, None, None)
    except (TypeError, ValueError):
        raise ValueError(f"workflow {workflow!r}: its function must take (episodes, llm, task, **params), got "
                         f"{taskkinds.shortened(repr(fn))}") from None
    named = list(sig.parameters.values())[3:]
    if any(q.kind is q.VAR_KEYWORD for q in named):
        return None
    return {q.name: q.default for q in named if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)}


def _check_param(workflow: str, p: Param, keywords: dict | None) -> None:
    """A parameter's type, range and flag, and (`keywords`: the function's) that the function
    takes it with the default the Param states: else its flag would set nothing, or --help
    would show another default than the run's."""
    if keywords is not None and p.name not in keywords:
        raise ValueError(f"workflow {workflow!r}: parameter {p.name!r} is not a keyword of its function, so its "
                         f"flag would set nothing; name one of {', '.join(keywords) or 'none (add it to the function)'}")
    if keywords is not None and keywords[p.name] is not inspect.Parameter.empty and keywords[p.name] != p.default:
        raise ValueError(f"workflow {workflow!r}: parameter {p.name!r} states the default {p.default!r}, but its "
                         f"function's is {keywords[p.name]!r}; give the Param the function's default")
    if p.type not in (int, float, str):
        raise ValueError(f"workflow {workflow!r}: parameter {p.name!r} must be an int, float or str")
    if p.default is not None and not p.range[0] <= p.default <= p.range[1]:
        raise ValueError(f"workflow {workflow!r}: parameter {p.name!r} default {p.default} is outside {p.range}")
    for other, q in params_by_dest().get(p.dest, {}).items():
        if other != workflow and q.type is not p.type:
            raise ValueError(f"workflow {workflow!r}: --{p.flag} is a {q.type.__name__} parameter of {other}")


def params_by_dest() -> dict:
    """{config key: {workflow: Param}}: each flag once, with every workflow that has it."""
    out = {}
    for workflow, params in PARAMS.items():
        for p in params:
            out.setdefault(p.dest, {})[workflow] = p
    return out


def slot_table(name: str, **params) -> dict:
    """{role: (slot, ...)} of workflow `name` with these parameter values (its defaults for the
    rest), checked as register checks a fixed table, and naming the roles it registered."""
    table = _slot_table(name, SLOTS[name](**params))
    if set(table) != set(ROLES[name]):
        raise ValueError(f"workflow {name!r} with {params}: its slots name the roles {sorted(table)}, not its "
                         f"roles {sorted(ROLES[name])}")
    return table


def slots_of(name: str, **params) -> tuple[str, ...]:
    """The slots workflow `name` fills with these parameter values, every role's in turn."""
    return tuple(s for names in slot_table(name, **params).values() for s in names)


def _voting_slots(n_voters: int = 3) -> dict:
    return {"generator": tuple(f"generator{i}" for i in range(n_voters)), "aggregator": ("aggregator",)}


register("single", single, {"generator": ("generator",)})
register("voting", voting, _voting_slots,
         params=(Param("n_voters", int, 3, (1, len(SOLUTION_HEADERS)), "generators that answer the same prompt"),))
register("eval_opt", eval_opt, {"generator": ("generator",), "evaluator": ("evaluator",)},
         params=(Param("max_rounds", int, None, (0, 9), "most evaluator rounds (default: the task kind's, 3 for "
                       "math and 2 for code, the paper's)", flag="eval-rounds"),))
register("orch_workers", orch_workers, {"orchestrator": ("orchestrator",), "worker": ("worker",),
                                        "synthesizer": ("synthesizer",)},
         params=(Param("max_strategies", int, 3, (1, len(SOLUTION_HEADERS)), "most strategies, so workers, an "
                       "episode runs", flag="max-workers"),))


def run_workflow(name: str, episodes: list[Episode], llm: LLM, task: str, **params) -> None:
    """Run workflow `name` on the batch in place, with its parameters' values (PARAMS: voting
    n_voters=3, eval_opt max_rounds=None, orch_workers max_strategies=3), once `check_run`
    passes; every stage is checked again as it comes (_check_stage), before its llm call, and
    the books once it returns (_check_books). What breaks the contract here, on a branch the dry
    run did not take, is `Broken`: one line, and train.py keeps nothing of a fresh run."""
    check_run(name, task, params)    # also: an unknown workflow or task
    checked, before = _checked(name, task, slot_table(name, **params), llm), sum(len(ep.calls) for ep in episodes)
    WORKFLOWS[name](episodes, checked, task, **params)
    _check_books(name, episodes, checked.rows, before)


class Broken(taskkinds.Refused):
    """A workflow that broke its contract as it ran: a stage refused (_check_stage) or its books
    wrong (_check_books). The dry run turns it into a refusal before any rollout; uncaught, it is
    one line (taskkinds.Refused)."""


def _checked(workflow: str, task: str, table: dict, llm: LLM) -> LLM:
    """`llm` as the workflow sees it: each stage checked before its call, its rows counted."""
    def checked(role, slots, messages_list, keys=None):
        _check_stage(workflow, task, table, role, slots, messages_list, keys)
        checked.rows += len(slots)
        return llm(role, slots, messages_list, keys=keys)
    checked.rows = 0
    if hasattr(llm, "clip"):
        checked.clip = llm.clip
    return checked


def _check_stage(workflow: str, task: str, table: dict, role: str, slots: list, messages_list: list, keys) -> None:
    """A stage's role and slots are its registration's, its rows have keys and its prompts the
    role's own instruction (all of which `stage` gives; a bare llm call need not): a call of an
    undeclared role would fail in the policy's routing, one in another role's slot would share
    its advantage group, unkeyed rows would draw by the order of calls (which a resumed run or
    another rank does not repeat), and another role's instruction would leave its own unused."""
    fix = "make it through stage(llm, task, role, owners, ...)"
    if role not in table:
        raise Broken(f"workflow {workflow!r} calls the role {role!r}, which its registration does not declare (it "
                     f"declares {', '.join(table)}); add it: register({workflow!r}, ..., slots={{..., {role!r}: (...)}})")
    stray = next((s for s in slots if s not in table[role]), None)
    if stray is not None:
        whose = next((f", the {r}'s" for r, names in table.items() if stray in names), ", which it does not declare")
        raise Broken(f"workflow {workflow!r} calls the {role} in slot {stray!r}{whose}; a role calls only in its own "
                     f"slots ({', '.join(table[role])}): declare them in register({workflow!r}, ..., "
                     f"slots={{{role!r}: (...)}})")
    if keys is None:
        raise Broken(f"workflow {workflow!r} calls llm({role!r}, ...) without row keys, so its draws would follow the "
                     f"order of calls, which a resumed run or another rank does not repeat; {fix}")
    own = {instruction(role, task)} | ({taskkinds.get(task).revision()} if ROLE_KINDS[role] == "solution" else set())
    systems = [m[0].get("content") if m and isinstance(m[0], dict) else m for m in messages_list]
    other = next((text for text in systems if text not in own), None)
    if other is not None:
        raise Broken(f"workflow {workflow!r} calls the {role} with the system message {taskkinds.shortened(other)}, "
                     f"not the {role}'s instruction on {task}; {fix}, which builds every prompt from its role")


def _check_books(workflow: str, episodes: list[Episode], rows: int, before: int) -> None:
    """Once the workflow returns: every call it made is in its episode (once), every episode has
    its graded answer, no call carries a reward of the workflow's own, and no episode is graded on
    another episode's text. A call held by no episode would never be trained (its role would
    vanish from the metrics); an episode with no final_text would be graded as empty; a reward set
    here would skip the reward's checks and --credit; another episode's answer (an index slip)
    would pay every call of this one for a text it never wrote."""
    held = sum(len(ep.calls) for ep in episodes) - before
    if held != rows:
        raise Broken(f"workflow {workflow!r} made {rows} llm calls, but its episodes hold {held} new ones; make every "
                     f"call through stage(llm, task, role, owners, ...), which appends each to its episode, and "
                     f"append none yourself")
    missing = [ep.final_text for ep in episodes if not isinstance(ep.final_text, str)]
    if missing:
        got = "" if all(m is None for m in missing) else f" (a str; one is a {type(missing[0]).__name__})"
        raise Broken(f"workflow {workflow!r} left {len(missing)} of {len(episodes)} episodes without a graded "
                     f"answer{got}; set each episode's final_text (e.g. ep.final_text = call.text of the call that "
                     f"answers)")
    paid = next((c for ep in episodes for c in ep.calls if c.reward is not None), None)
    if paid is not None:
        raise Broken(f"workflow {workflow!r} set the reward of a {paid.role} call "
                     f"({taskkinds.shortened(paid.reward)}); "
                     f"calls are paid once graded (their episode's reward, or under --credit own their own text's "
                     f"grade: workflows.pay), so leave Call.reward unset and grade in a task kind's reward")
    _check_own_answers(workflow, episodes)


def _check_own_answers(workflow: str, episodes: list[Episode]) -> None:
    """No episode's (non-empty) final_text is the text of another episode's call and of none of
    its own: an index slip that grades every call of an episode on a text it never wrote."""
    writers = {}
    for i, ep in enumerate(episodes):
        for c in ep.calls:
            writers.setdefault(c.text, set()).add(i)
    for i, ep in enumerate(episodes):
        wrote = writers.get(ep.final_text, set())
        if ep.final_text and wrote and i not in wrote:
            raise Broken(f"workflow {workflow!r} graded episode {i} (problem {ep.problem.get('id')!r}, rollout "
                         f"{ep.rollout}) on the text of a call of episode {min(wrote)}, and of none of its own; set "
                         f"each episode's final_text from its own calls (an index slip?)")


def _dry_run(workflow: str, task: str, table: dict, params: dict) -> None:
    """Run the workflow on two episodes of an empty problem with an llm that writes nothing:
    each stage is checked (_check_stage), and its books once it returns (_check_books); what its
    prompts hold is fixed text alone, every line of which must be a phrase (an instruction, a
    header) or keep the phrase rules and be declared (_check_fixed). A workflow that fails on
    empty answers ends its dry run there, unchecked beyond; run_workflow still checks each of its
    stages as it comes, and its books. One that returns without calling a role it declares says
    so once (_note_uncalled)."""
    fixed, called = {}, set()

    def llm(role, slots, messages_list, keys=None):
        called.add(role)
        for messages in messages_list:
            for m in messages:
                lines = str(m.get("content", "")).split("\n") if isinstance(m, dict) else []
                for line in filter(None, map(str.strip, lines)):
                    fixed.setdefault((role, m.get("role") == "system"), {})[line] = None
        return [Call(role=role, slot=slot, messages=messages) for slot, messages in zip(slots, messages_list)]
    problem, checked = {"id": "dry-run", "prompt": "", "source": "dry-run"}, _checked(workflow, task, table, llm)
    episodes = [Episode(problem, g, stream=("dry-run",)) for g in range(2)]
    try:
        WORKFLOWS[workflow](episodes, checked, task, **params)
        _check_books(workflow, episodes, checked.rows, 0)
    except Broken as e:
        raise ValueError(str(e)) from None
    except Exception:   # noqa: BLE001 -- the workflow's own limits on empty answers are not a refusal
        called = None
    _check_fixed(workflow, task, fixed)
    if called is not None:
        _note_uncalled(workflow, [role for role in table if role not in called])


def _note_uncalled(workflow: str, roles: list) -> None:
    """A role declared and never called trains nothing: under isolated its adapter gets no rows
    (with one role left called, the run is Shared's). Said once: the dry run is every step's."""
    if roles:
        taskkinds.note_once(("uncalled", workflow), f"note: workflow {workflow!r} declares "
                            f"{', '.join(map(repr, roles))} but its dry run (empty answers) never called "
                            f"{'it' if len(roles) == 1 else 'them'}: a role no run calls trains nothing, and under "
                            f"--sharing isolated its adapter gets no rows")


def _check_fixed(workflow: str, task: str, fixed: dict) -> None:
    """The fixed text of the dry run's prompts, {(role, system?): lines}: none breaks the phrase
    rules against phrases() (so a fork's header that holds one, say "Critique of Solution 1:",
    is refused), and each is a phrase: an instruction (system) or a header (user)."""
    known = phrases()
    for (role, system), lines in fixed.items():
        taskkinds.check_phrases(list(lines), known, f"workflow {workflow!r}, the {role}'s prompt")
        new = next((line for line in lines if line not in known), None)
        if new is not None:
            where = f"instructions={{({role!r}, {task!r}): ...}}" if system else f"headers=({new!r}, ...)"
            raise ValueError(f"workflow {workflow!r}: the {role}'s {'system' if system else 'user'} message holds the "
                             f"fixed text {taskkinds.shortened(new)}, which no registration declares; declare it: "
                             f"register({workflow!r}, ..., {where})")
