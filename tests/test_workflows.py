"""Tests of workflows.py with a scripted fake llm: stages, call counts per role and slot, prompt
contents, graded text, parser fallbacks, and that prompts are built only from the phrases
(workflows.phrases()) plus variable text. The built-in workflows and tasks are named here, so
that a fork's registrations leave these tests as they are. CPU, offline, no torch. Run: python -m pytest -q tests/test_workflows.py
"""
import functools
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import taskkinds as K
import workflows as W
from workflows import Call, Episode

ROOT = Path(__file__).resolve().parents[1]

MATH = [
    {"id": "m0", "prompt": "What is 2+3?", "source": "toy", "answer": "5"},
    {"id": "m1", "prompt": "What is 7*6?", "source": "toy", "answer": "42"},
    {"id": "m2", "prompt": "What is 9-4?", "source": "toy", "answer": "5"},
]
CODE = [
    {"id": "c0", "prompt": 'def add(a, b):\n    """Return a + b."""\n', "source": "toy",
     "tests": {"kind": "assert", "test": "assert add(1, 2) == 3", "entry_point": "add"}},
    {"id": "c1", "prompt": "Read n from stdin and print n * 2.\nInput: one integer.", "source": "toy",
     "tests": {"kind": "stdio", "cases": [{"stdin": "3\n", "stdout": "6\n"}]}},
]
PROBLEMS = {"math": MATH, "code": CODE}
from conftest import BUILT_IN, TASKS   # the built-in workflows and task kinds


class FakeLLM:
    """Scripted llm. replies[role] is a str (every call), a list (consumed in order) or
    fn(slot, messages) -> str. Records every stage as (role, slots, messages_list)."""

    def __init__(self, **replies):
        self.replies = {k: list(v) if isinstance(v, list) else v for k, v in replies.items()}
        self.log, self.keys = [], []

    def __call__(self, role, slots, messages_list, keys=None):
        assert len(slots) == len(messages_list) > 0, "a stage must not be empty"
        assert keys is not None and len(keys) == len(slots), "every row of a stage is named"
        self.log.append((role, list(slots), messages_list))
        self.keys.append(list(keys))
        calls = []
        for slot, msgs in zip(slots, messages_list):
            r = self.replies[role]
            text = r(slot, msgs) if callable(r) else r.pop(0) if isinstance(r, list) else r
            calls.append(Call(role=role, slot=slot, messages=msgs, text=text))
        return calls

    def stages(self):
        return [role for role, _, _ in self.log]


def episodes_for(task, n=None):
    return [Episode(problem=p, rollout=0) for p in PROBLEMS[task][:n]]


def user(msgs):
    return msgs[1]["content"]


def system(msgs):
    return msgs[0]["content"]


def problem_of(msgs, task):
    """The record whose text this prompt carries (problem texts are distinct, no one inside another)."""
    hits = [p for p in PROBLEMS[task] if p["prompt"] in user(msgs)]
    assert len(hits) == 1
    return hits[0]


def only_phrases_and(content, variables):
    """True when content == "\\n".join(parts) with each part a phrase or one of variables."""
    pieces = set(W.phrases()) | set(variables)

    @functools.lru_cache(maxsize=None)
    def ok(i):
        for p in pieces:
            if content.startswith(p, i):
                j = i + len(p)
                if j == len(content) or (content.startswith("\n", j) and ok(j + 1)):
                    return True
        return False

    return ok(0)


def slot_counts(episode):
    return Counter((c.role, c.slot) for c in episode.calls)


# ---------------------------------------------------------------------------------------
# phrases and prompt composition

def test_phrases_are_distinct_single_line_and_none_inside_another():
    assert len(set(W.phrases())) == len(W.phrases())
    for p in W.phrases():
        assert p and "\n" not in p and p == p.strip()
        for q in W.phrases():
            assert p == q or p not in q, f"{p!r} inside {q!r}: a whole-phrase tokenizer would split it"
    for p in W.phrases(kinds=TASKS, registered=False):   # the house's own prompts are short; a fork's may be longer
        assert p.count(". ") <= 1, f"instruction longer than two sentences: {p!r}"
    # every fixed string that ends up in a built-in prompt is listed: check_run's dry run finds
    # each one (what a prompt holds once the problem and the answers are empty) among phrases()
    for name in BUILT_IN:
        for task in TASKS:
            W.check_run(name, task)
    for kind in K.TASK_KINDS.values():
        assert {*kind.instructions.values(), kind.revision(), kind.default} <= set(W.phrases())
    assert {"Solution 1:", "Solution 2:", "Solution 3:"} <= set(W.phrases())


def test_registration_refuses_text_that_breaks_the_phrase_rules_in_one_line(registries):
    """taskkinds.check_phrases, applied by register and register_task: one line, and no fixed
    prompt string inside another, unless equal (a shared phrase); nothing is registered."""
    pick = lambda text: dict(instructions={("picker", "math"): text}, kinds={"picker": "supervisory"})  # noqa: E731
    cases = [(pick("Read the Problem: then pick one."), "'Problem:' is inside 'Read the Problem: then pick one.'"),
             (pick("Solve the math problem step by step."), "'Solve the math problem step by step.' is inside "
                                                             "'Solve the math problem step by step. Put..."),
             (pick("Pick one.\nThen stop."), "an instruction is one non-empty line with no spaces around it"),
             (pick(" Pick one."), "an instruction is one non-empty line")]
    for given, message in cases:
        with pytest.raises(ValueError) as e:
            W.register("picky", W.single, {"generator": "generator", "picker": "picker"}, **given)
        assert str(e.value).startswith("workflow 'picky': ") and message in str(e.value) and "\n" not in str(e.value)
        assert "picky" not in W.WORKFLOWS and "picker" not in W.ROLE_KINDS
    W.register("picky", W.single, {"generator": "generator", "picker": "picker"}, **pick(K.AGGREGATOR_MATH))
    assert W.instruction("picker", "math") == K.AGGREGATOR_MATH       # equal to a phrase: shared, fine
    with pytest.raises(ValueError, match=r"^task kind 'yes_no': the fixed prompt string 'Solve the math problem step "
                                         r"by step.' is inside 'Solve the math problem step by step. Put\.\.\.'"):
        K.register_task("yes_no", lambda text, problem: 0.0, default="Answer yes or no.", check=lambda record: None,
                        instructions={"generator": "Solve the math problem step by step."})
    with pytest.raises(ValueError, match="^task kind 'yes_no': the fixed prompt string 'Answer yes' is inside "
                                         "'Answer yes or no.'; no phrase may hold another"):   # within the kind too
        K.register_task("yes_no", lambda text, problem: 0.0, instructions={"generator": "Answer yes"},
                        default="Answer yes or no.", check=lambda record: None)
    assert "yes_no" not in K.TASK_KINDS


def test_an_instruction_of_a_role_on_a_task_is_never_silently_replaced(registries):
    """ROLE_INSTRUCTIONS is keyed by (role, task), so a workflow's instruction is that role's in
    every workflow: another text for a (role, task) that has one is refused; the same again is fine."""
    with pytest.raises(ValueError) as e:
        W.register("loud", W.voting, {"generator": "generator0", "aggregator": "aggregator"},
                   instructions={("aggregator", "math"): "Pick the best solution as \\boxed{k}."})
    assert str(e.value) == ("workflow 'loud': the aggregator on math already has the instruction 'Compare the "
                            "numbered solutions and pick...', which every workflow's aggregator reads; a prompt of "
                            "its own needs a new role name (e.g. loud_aggregator, with its kind)")
    assert "loud" not in W.WORKFLOWS and W.instruction("aggregator", "math") == K.AGGREGATOR_MATH
    judge = {("judge", "math"): "Name the better solution as \\boxed{1} or \\boxed{2}."}
    for name in ("first", "second"):      # another workflow with the same text: one prompt, shared
        W.register(name, W.single, {"generator": "generator", "judge": "judge"}, kinds={"judge": "supervisory"},
                   instructions=judge)
    with pytest.raises(ValueError, match="^workflow 'third': the judge on math already has the instruction 'Name the "):
        W.register("third", W.single, {"generator": "generator", "judge": "judge"}, instructions={("judge", "math"): "Pick."})
    with pytest.raises(ValueError, match="^workflow 'fourth': role 'judge' is supervisory in every workflow, not "
                                         "solution; a role of another kind needs a new name$"):
        W.register("fourth", W.single, {"generator": "generator", "judge": "judge"}, kinds={"judge": "solution"})


def test_code_and_math_instructions_ask_for_their_answer_format():
    for role in ("generator", "worker", "synthesizer"):
        assert "\\boxed{}" in W.instruction(role, "math")
        assert "```python" in W.instruction(role, "code")
    assert "\\boxed{}" in K.REVISE_MATH and "```python" in K.REVISE_CODE
    for task in TASKS:
        assert "\\boxed{k}" in W.instruction("aggregator", task)
        assert "\\boxed{Correct}" in W.instruction("evaluator", task)
        assert "STRATEGY k:" in W.instruction("orchestrator", task)


WORKFLOW_REPLIES = {
    "single": dict(generator="G says \\boxed{5}"),
    "voting": dict(generator=["A \\boxed{5}", "B \\boxed{6}", "C \\boxed{7}"] * 3, aggregator="pick \\boxed{2}"),
    "eval_opt": dict(generator=[f"try {i}" for i in range(20)], evaluator=[f"no {i} \\boxed{{Incorrect}}" for i in range(20)]),
    "orch_workers": dict(orchestrator="STRATEGY 1: count up\nSTRATEGY 2: draw it", worker=[f"w{i}" for i in range(20)],
                         synthesizer="final \\boxed{5}"),
}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_prompt_is_phrases_plus_variable_text(name, task):
    replies = WORKFLOW_REPLIES[name]
    llm = FakeLLM(**replies)
    eps = episodes_for(task)
    W.run_workflow(name, eps, llm, task)
    variables = [p["prompt"] for p in PROBLEMS[task]] + [c.text for ep in eps for c in ep.calls]
    variables += ["count up", "draw it"]        # the parsed strategies
    n_prompts = 0
    for role, slots, messages_list in llm.log:
        for msgs in messages_list:
            assert [m["role"] for m in msgs] == ["system", "user"]
            assert system(msgs) in W.phrases()
            assert only_phrases_and(user(msgs), variables), user(msgs)
            # the real content is there too: taking it out changes the prompt
            assert not only_phrases_and(user(msgs), []), user(msgs)
            n_prompts += 1
    assert n_prompts == sum(len(ep.calls) for ep in eps)
    # roles and slots are the design's
    assert {c.role for ep in eps for c in ep.calls} == set(W.ROLES[name])
    assert {c.slot for ep in eps for c in ep.calls} == set(W.slots_of(name))


def test_decomposition_check_catches_text_that_is_not_a_phrase():
    ok = "\n".join([W.PROBLEM, "What is 2+3?", W.SOLUTION_HEADERS[0], "A"])
    assert only_phrases_and(ok, ["What is 2+3?", "A"])
    assert not only_phrases_and(ok.replace("Solution 1:", "Solution 1: "), ["What is 2+3?", "A"])
    assert not only_phrases_and(ok.replace("Solution 1:", "Answer 1:"), ["What is 2+3?", "A"])


# ---------------------------------------------------------------------------------------
# single

@pytest.mark.parametrize("task", TASKS)
def test_single_one_generator_call_graded(task):
    llm = FakeLLM(generator=["x1", "x2"])
    eps = episodes_for(task, 2)
    W.run_workflow("single", eps, llm, task)
    assert llm.stages() == ["generator"] and llm.log[0][1] == ["generator", "generator"]
    assert [ep.final_text for ep in eps] == ["x1", "x2"]
    for ep in eps:
        assert slot_counts(ep) == {("generator", "generator"): 1}
        msgs = ep.calls[0].messages
        assert system(msgs) == W.instruction("generator", task)
        assert user(msgs) == f"{W.PROBLEM}\n{ep.problem['prompt']}"
    assert all(ep.fallbacks == {} for ep in eps)


# ---------------------------------------------------------------------------------------
# voting

@pytest.mark.parametrize("task", TASKS)
def test_voting_stages_slots_and_aggregator_prompt(task):
    eps = episodes_for(task, 2)
    gen = [f"{ep.problem['id']} sol{k}" for ep in eps for k in range(3)]
    llm = FakeLLM(generator=list(gen), aggregator=["I pick \\boxed{2}", "\\boxed{3} is best"])
    W.run_workflow("voting", eps, llm, task)
    # one generator stage with all 3 x 2 voters, then one aggregator stage
    assert llm.stages() == ["generator", "aggregator"]
    assert llm.log[0][1] == ["generator0", "generator1", "generator2"] * 2
    assert llm.log[1][1] == ["aggregator"] * 2
    # the 3 voters of an episode get the identical prompt
    first = llm.log[0][2]
    assert first[0] == first[1] == first[2] != first[3]
    for i, ep in enumerate(eps):
        assert slot_counts(ep) == {("generator", "generator0"): 1, ("generator", "generator1"): 1,
                                   ("generator", "generator2"): 1, ("aggregator", "aggregator"): 1}
        assert [c.slot for c in ep.calls] == ["generator0", "generator1", "generator2", "aggregator"]
        agg = ep.calls[-1].messages
        assert system(agg) == W.instruction("aggregator", task)
        sols = gen[3 * i:3 * i + 3]
        assert user(agg) == "\n".join([W.PROBLEM, ep.problem["prompt"], "Solution 1:", sols[0],
                                       "Solution 2:", sols[1], "Solution 3:", sols[2]])
        assert ep.fallbacks == {"aggregator": 0}
    # the chosen generator's full text is graded
    assert eps[0].final_text == gen[1] and eps[1].final_text == gen[5]


@pytest.mark.parametrize("reply, chosen, fallback", [
    ("\\boxed{3}", 3, False),
    ("Solution 2 looks right.", 2, True),             # no box: first lone digit
    ("\\boxed{5} no wait, 12 or 3", 3, True),         # out of range: 5 and 12 skipped, then 3
    ("\\boxed{0}", 1, True),                          # out of range, no other digit: 1
    ("they all look fine", 1, True),                  # nothing at all: 1
    ("\\boxed{two}", 1, True),                        # not a number, no digit: 1
])
def test_voting_aggregator_fallbacks(reply, chosen, fallback):
    eps = episodes_for("math", 1)
    llm = FakeLLM(generator=["s1", "s2", "s3"], aggregator=reply)
    W.voting(eps, llm, "math")
    assert eps[0].final_text == f"s{chosen}"
    assert eps[0].fallbacks == {"aggregator": int(fallback)}


def test_voting_n_voters_parameter():
    eps = episodes_for("math", 1)
    llm = FakeLLM(generator=[f"s{k}" for k in range(1, 6)], aggregator="\\boxed{5}")
    W.run_workflow("voting", eps, llm, "math", n_voters=5)
    assert llm.log[0][1] == [f"generator{k}" for k in range(5)]
    assert "Solution 5:\ns5" in user(eps[0].calls[-1].messages)
    assert eps[0].final_text == "s5"
    with pytest.raises(ValueError, match="n_voters"):
        W.run_workflow("voting", eps, FakeLLM(), "math", n_voters=10)


# ---------------------------------------------------------------------------------------
# eval_opt

def numbered(prefix, task="math"):
    """A reply fn that numbers its replies per problem: '<id> <prefix><k>'."""
    seen = Counter()

    def reply(slot, msgs):
        pid = problem_of(msgs, task)["id"]
        seen[pid] += 1
        return f"{pid} {prefix}{seen[pid]}"
    return reply


@pytest.mark.parametrize("task, rounds", [("math", 3), ("code", 2)])
def test_eval_opt_runs_to_the_cap_when_always_incorrect(task, rounds):
    eps = episodes_for(task, 2)
    llm = FakeLLM(generator=numbered("att", task), evaluator=lambda s, m: "Not right yet. \\boxed{Incorrect}")
    W.run_workflow("eval_opt", eps, llm, task)
    # G E G E ... G: rounds + 1 generator stages, rounds evaluator stages, one call each
    assert llm.stages() == ["generator"] + ["evaluator", "generator"] * rounds
    assert all(len(slots) == 2 for _, slots, _ in llm.log)
    for ep in eps:
        pid = ep.problem["id"]
        assert [c.role for c in ep.calls] == ["generator"] + ["evaluator", "generator"] * rounds
        assert slot_counts(ep) == {("generator", "generator"): rounds + 1, ("evaluator", "evaluator"): rounds}
        assert ep.final_text == f"{pid} att{rounds + 1}"          # the last attempt is graded
        assert ep.fallbacks == {"evaluator": 0}


def test_eval_opt_prompts_carry_the_whole_conversation():
    eps = episodes_for("math", 1)
    fb = ["too small \\boxed{Incorrect}", "sign error \\boxed{incorrect}", "still off \\boxed{Incorrect}"]
    llm = FakeLLM(generator=numbered("att"), evaluator=list(fb))
    W.eval_opt(eps, llm, "math")
    ep = eps[0]
    p = ep.problem["prompt"]
    a = [f"m0 att{k}" for k in range(1, 5)]
    gens = [c for c in ep.calls if c.role == "generator"]
    evals = [c for c in ep.calls if c.role == "evaluator"]
    assert system(gens[0].messages) == K.GENERATOR_MATH
    assert user(gens[0].messages) == f"{W.PROBLEM}\n{p}"
    for r in range(3):
        # the evaluator sees every attempt and every feedback so far, ending with the attempt to judge
        conv = [W.PROBLEM, p]
        for k in range(r):
            conv += [W.ATTEMPT, a[k], W.FEEDBACK, fb[k]]
        assert system(evals[r].messages) == K.EVALUATOR_MATH
        assert user(evals[r].messages) == "\n".join(conv + [W.ATTEMPT, a[r]])
        # the revising generator sees the same conversation, ending with the new feedback
        assert system(gens[r + 1].messages) == K.REVISE_MATH
        assert user(gens[r + 1].messages) == "\n".join(conv + [W.ATTEMPT, a[r], W.FEEDBACK, fb[r]])
    assert ep.final_text == a[3]


@pytest.mark.parametrize("task", TASKS)
def test_eval_opt_stops_early_on_correct(task):
    eps = episodes_for(task, 2)
    llm = FakeLLM(generator=["first A", "first B"], evaluator="Looks right. \\boxed{CORRECT}")
    W.run_workflow("eval_opt", eps, llm, task)
    assert llm.stages() == ["generator", "evaluator"]
    assert [ep.final_text for ep in eps] == ["first A", "first B"]
    assert all([c.role for c in ep.calls] == ["generator", "evaluator"] for ep in eps)


def test_eval_opt_mixed_batch_drops_finished_episodes():
    eps = episodes_for("math", 3)
    # m0 is right at once, m1 after one revision, m2 never
    verdicts = {"m0": ["\\boxed{Correct}"], "m1": ["\\boxed{Incorrect}", "\\boxed{Correct}"], "m2": []}

    def evaluator(slot, msgs):
        v = verdicts[problem_of(msgs, "math")["id"]]
        return v.pop(0) if v else "wrong \\boxed{Incorrect}"

    llm = FakeLLM(generator=numbered("att"), evaluator=evaluator)
    W.eval_opt(eps, llm, "math")
    # one call per stage; finished episodes leave later stages
    assert llm.stages() == ["generator", "evaluator", "generator", "evaluator", "generator",
                            "evaluator", "generator"]
    assert [len(slots) for _, slots, _ in llm.log] == [3, 3, 2, 2, 1, 1, 1]
    live = [[problem_of(m, "math")["id"] for m in ml] for _, _, ml in llm.log]
    assert live[2] == ["m1", "m2"] and live[4] == ["m2"]
    assert [ep.final_text for ep in eps] == ["m0 att1", "m1 att2", "m2 att4"]
    assert [len(ep.calls) for ep in eps] == [2, 4, 7]


def test_eval_opt_no_stage_without_live_episodes():
    eps = episodes_for("math", 2)
    llm = FakeLLM(generator=["a", "b", "c"], evaluator=["\\boxed{Correct}", "\\boxed{Incorrect}", "\\boxed{Correct}"])
    W.eval_opt(eps, llm, "math")
    # round 2 judges only episode 1, which is then Correct: no further generator stage
    assert llm.stages() == ["generator", "evaluator", "generator", "evaluator"]
    assert [ep.final_text for ep in eps] == ["a", "c"]
    llm = FakeLLM()
    W.eval_opt([], llm, "math")
    assert llm.log == []


def test_eval_opt_missing_verdict_is_incorrect_and_counted():
    eps = episodes_for("math", 1)
    llm = FakeLLM(generator=["a1", "a2", "a3"],
                  evaluator=["I am not sure.", "\\boxed{42}", "\\boxed{\\text{Correct}}"])
    W.eval_opt(eps, llm, "math")
    assert llm.stages() == ["generator", "evaluator"] * 3
    assert eps[0].final_text == "a3"
    assert eps[0].fallbacks == {"evaluator": 2}
    # the unparsable feedback is still shown to the generator
    assert "Feedback:\nI am not sure." in user(eps[0].calls[2].messages)


def test_eval_opt_max_rounds_parameter():
    eps = episodes_for("code", 1)
    llm = FakeLLM(generator=["a1", "a2", "a3", "a4", "a5"], evaluator="\\boxed{Incorrect}")
    W.run_workflow("eval_opt", eps, llm, "code", max_rounds=4)
    assert [c.role for c in eps[0].calls] == ["generator"] + ["evaluator", "generator"] * 4
    assert eps[0].final_text == "a5"
    llm = FakeLLM(generator=["only"])
    W.run_workflow("eval_opt", episodes_for("math", 1), llm, "math", max_rounds=0)
    assert llm.stages() == ["generator"]


# ---------------------------------------------------------------------------------------
# orch_workers

def orch_reply(plans):
    """Orchestrator reply fn: plans maps problem id -> reply text."""
    return lambda slot, msgs: plans[problem_of(msgs, "math")["id"]]


def test_orch_workers_stages_one_strategy_per_worker_and_synthesis():
    eps = episodes_for("math", 3)
    plans = {"m0": "STRATEGY 1: add\nSTRATEGY 2: count\nSTRATEGY 3: draw",
             "m1": "Here is my plan.\nSTRATEGY 1: multiply directly",
             "m2": "strategy 1: subtract\n  STRATEGY 2 : count down\n"}
    llm = FakeLLM(orchestrator=orch_reply(plans),
                  worker=lambda slot, msgs: "sol of " + user(msgs).split(W.STRATEGY + "\n")[1],
                  synthesizer=lambda slot, msgs: "final for " + problem_of(msgs, "math")["id"])
    W.run_workflow("orch_workers", eps, llm, "math")
    assert llm.stages() == ["orchestrator", "worker", "synthesizer"]
    assert [len(s) for _, s, _ in llm.log] == [3, 6, 3]          # all workers in ONE stage
    assert set(llm.log[1][1]) == {"worker"}
    expected = {"m0": ["add", "count", "draw"], "m1": ["multiply directly"], "m2": ["subtract", "count down"]}
    for ep in eps:
        strategies = expected[ep.problem["id"]]
        assert slot_counts(ep) == {("orchestrator", "orchestrator"): 1, ("worker", "worker"): len(strategies),
                                   ("synthesizer", "synthesizer"): 1}
        assert system(ep.calls[0].messages) == K.ORCHESTRATOR_MATH
        assert user(ep.calls[0].messages) == f"{W.PROBLEM}\n{ep.problem['prompt']}"
        workers = [c for c in ep.calls if c.role == "worker"]
        for c, s in zip(workers, strategies):
            # exactly one strategy, and no other
            assert user(c.messages) == "\n".join([W.PROBLEM, ep.problem["prompt"], W.STRATEGY, s])
            assert system(c.messages) == K.WORKER_MATH
        syn = ep.calls[-1]
        sols = [f"sol of {s}" for s in strategies]
        parts = [W.PROBLEM, ep.problem["prompt"]]
        for k, s in enumerate(sols):
            parts += [W.SOLUTION_HEADERS[k], s]
        assert user(syn.messages) == "\n".join(parts)
        assert system(syn.messages) == K.SYNTHESIZER_MATH
        assert ep.final_text == f"final for {ep.problem['id']}"      # the synthesizer's text is graded
        assert ep.fallbacks == {"orchestrator": 0}


@pytest.mark.parametrize("reply, strategies, fallback", [
    ("I would just compute it.", [W.DIRECT_STRATEGY], True),                       # no STRATEGY lines
    ("STRATEGY 1:\nSTRATEGY 2:   ", [W.DIRECT_STRATEGY], True),                     # lines without text
    ("STRATEGY 1: a\nSTRATEGY 2: b\nSTRATEGY 3: c\nSTRATEGY 4: d", ["a", "b", "c"], True),   # more than 3
    ("STRATEGY 1: add them\nSTRATEGY 2: Add  them\nSTRATEGY 3: guess", ["add them", "guess"], True),  # duplicate
    ("STRATEGY 1: a\nSTRATEGY 2: b", ["a", "b"], False),
])
@pytest.mark.parametrize("task", TASKS)
def test_orch_workers_strategy_fallbacks(reply, strategies, fallback, task):
    eps = episodes_for(task, 1)
    llm = FakeLLM(orchestrator=reply, worker=lambda s, m: "w", synthesizer="done")
    W.orch_workers(eps, llm, task)
    workers = [c for c in eps[0].calls if c.role == "worker"]
    assert [user(c.messages).split(W.STRATEGY + "\n")[1] for c in workers] == strategies
    assert all(system(c.messages) == W.instruction("worker", task) for c in workers)
    assert eps[0].fallbacks == {"orchestrator": int(fallback)}
    assert eps[0].final_text == "done"


def test_orch_workers_max_strategies_parameter():
    eps = episodes_for("math", 1)
    llm = FakeLLM(orchestrator="STRATEGY 1: a\nSTRATEGY 2: b\nSTRATEGY 3: c", worker="w", synthesizer="s")
    W.run_workflow("orch_workers", eps, llm, "math", max_strategies=2)
    assert len(llm.log[1][1]) == 2 and eps[0].fallbacks == {"orchestrator": 1}


# ---------------------------------------------------------------------------------------
# parsers directly, and the entry point

def test_parsers():
    assert W.parse_choice("\\boxed{ 2 }", 3) == (2, False)
    assert W.parse_choice("\\boxed{1} then \\boxed{3}", 3) == (3, False)   # the last box counts
    assert W.parse_choice("option 10 or 2", 3) == (2, True)                 # 10 is not a lone digit
    assert W.parse_verdict("\\boxed{Correct}") == (True, False)
    assert W.parse_verdict("\\boxed{ incorrect }") == (False, False)
    assert W.parse_verdict("\\boxed{Correct} ... \\boxed{Incorrect}") == (False, False)
    assert W.parse_verdict("Correct") == (False, True)
    assert W.parse_strategies("STRATEGY 1: x\r\nSTRATEGY 2: y\r\n") == (["x", "y"], False)
    assert W.parse_strategies("STRATEGY: x") == (["x"], False)


def test_run_workflow_validates_name_and_task():
    with pytest.raises(ValueError, match="unknown workflow 'no-such-workflow-xyz'"):
        W.run_workflow("no-such-workflow-xyz", episodes_for("math", 1), FakeLLM(), "math")
    with pytest.raises(ValueError, match="unknown task 'no-such-task-xyz'"):
        W.run_workflow("single", episodes_for("math", 1), FakeLLM(), "no-such-task-xyz")
    with pytest.raises(ValueError, match="unknown task"):
        W.generator_messages(MATH[0], "no-such-task-xyz")
    assert set(W.WORKFLOWS) == set(W.ROLES) == set(W.SLOTS) == set(W.PARAMS) >= set(BUILT_IN)


def test_slots_follow_the_parameters_and_a_call_in_an_undeclared_slot_is_refused(registries):
    eps = episodes_for("math", 1)
    llm = FakeLLM(generator=[f"s{k}" for k in range(8)], aggregator="\\boxed{8}")
    W.run_workflow("voting", eps, llm, "math", n_voters=8)
    assert {c.slot for c in eps[0].calls} == set(W.slots_of("voting", n_voters=8)) == {
        *(f"generator{k}" for k in range(8)), "aggregator"}

    def stray(episodes, llm, task):   # registered with one slot, calls in another
        for ep, call in zip(episodes, W.stage(llm, task, "generator", episodes, slots=["generator9"] * len(episodes))):
            ep.final_text = call.text
    W.register("stray", stray, {"generator": "generator"})
    llm = FakeLLM(generator="x")
    with pytest.raises(ValueError) as e:         # the dry run at the start: before any call
        W.run_workflow("stray", episodes_for("math", 1), llm, "math")
    assert str(e.value) == ("workflow 'stray' calls the generator in slot 'generator9', which it does not declare; a "
                            "role calls only in its own slots (generator): declare them in register('stray', ..., "
                            "slots={'generator': (...)})")
    assert llm.log == []


def test_llm_returning_the_wrong_number_of_calls_is_an_error():
    bad = lambda role, slots, msgs, keys=None: [Call(role=role, slot=slots[0], messages=msgs[0], text="x")]
    with pytest.raises(RuntimeError, match="1 calls for 2 generator prompts"):
        W.single(episodes_for("math", 2), bad, "math")


@pytest.mark.parametrize("name", BUILT_IN)
def test_empty_batch_makes_no_call(name):
    llm = FakeLLM()
    W.run_workflow(name, [], llm, "math")
    assert llm.log == []


def test_workflows_does_not_import_torch():
    code = "import sys, workflows; assert 'torch' not in sys.modules, 'workflows imported torch'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_embedded_texts_are_clipped_but_the_graded_text_is_not():
    long = "step\n" * 50 + "\\boxed{5}"
    clip = lambda text: text[:10] + "[cut]" + text[-9:]  # noqa: E731
    for name, replies in (("voting", dict(generator=long, aggregator="\\boxed{2}")),
                          ("orch_workers", dict(orchestrator="STRATEGY 1: add", worker=long, synthesizer=long)),
                          ("eval_opt", dict(generator=long, evaluator="no \\boxed{Incorrect}"))):
        llm = FakeLLM(**replies)
        llm.clip = clip
        eps = episodes_for("math", 1)
        W.run_workflow(name, eps, llm, "math")
        judged = [msgs for role, _, ms in llm.log if role in ("aggregator", "synthesizer", "evaluator") for msgs in ms]
        assert judged and all(long not in user(m) and clip(long) in user(m) for m in judged)
        assert eps[0].final_text == long and W.PROBLEM in user(judged[0]) and "What is 2+3?" in user(judged[0])
        revisions = [user(m) for role, slots, ms in llm.log if role == "generator" for m in ms if W.ATTEMPT in user(m)]
        assert all(long not in r for r in revisions)



@pytest.mark.parametrize("name", BUILT_IN)
def test_each_rows_key_is_the_index_its_call_takes_in_its_episode(name):
    """The stage keys a row where it appends its call: (stream, problem id, rollout, index), so
    no two calls of an episode share a key, and the keys are the ones the sampler always drew by
    (a resumed run, another rank and the kept runs draw the same numbers)."""
    eps = [Episode(problem=p, rollout=g, stream=("train", 7)) for p, g in ((MATH[0], 0), (MATH[0], 1), (MATH[1], 0))]
    llm = FakeLLM(**WORKFLOW_REPLIES[name])
    W.run_workflow(name, eps, llm, "math")
    keyed = {key: (role, slot, messages) for (role, slots, messages_list), keys in zip(llm.log, llm.keys)
             for slot, messages, key in zip(slots, messages_list, keys)}
    held = {("train", 7, ep.problem_id, ep.rollout, i): (c.role, c.slot, c.messages)
            for ep in eps for i, c in enumerate(ep.calls)}
    assert keyed == held and sum(map(len, llm.keys)) == len(held) >= len(eps)
