"""What a fork can get wrong, each refused in one line before any rollout: the cases a forker
found by breaking a workflow of two generators, a critic on each and a judge that picks
(`critiqued` below), registered as the end of workflows.py would register it. Each case is the
registration a forker would write, then train.py's flags (exit 2, one line), eval.py's command
line or run_workflow. The `registries` fixture (conftest.py) gives scratch registries holding
the built-in world alone. CPU, offline, no model: `python -m pytest -q tests/test_fork_checks.py`."""
import os
import shutil
import subprocess
import sys

import pytest

import eval as ev
import flags
import sweep
import rewards
import taskkinds
import toy
import train
import workflows as W
from conftest import ROOT, refused
from test_workflows import FakeLLM, user

K_GEN = taskkinds.GENERATOR_MATH
CRITIC = "Point out the first mistake in the solution, or say it has none. End with \\boxed{ok} or \\boxed{wrong}."
JUDGE = "Read both solutions and their critiques, then pick one with \\boxed{1} or \\boxed{2}."
SLOTS = {"generator": ("generator0", "generator1"), "critic": ("critic0", "critic1"), "judge": ("judge",)}


def critiqued(critic="critic", critic_slots=("critic0", "critic1"), header=W.SOLUTION_HEADERS[0], call="stage",
              told="critic", graded=True):
    """The forker's workflow: two generators answer, a critic reads each answer under `header`
    (in `critic_slots`, as role `critic`), a judge picks one of the two. The knobs are the
    mistakes a forker made: `call` "bare" calls the llm itself, without keys, "keyed" with keys
    of its own (nothing appended either way), "late" bare only where the answers have tokens (a
    real run, never the dry run); `told`, whose instruction a bare call's prompt carries;
    `graded=False` never sets the episodes' final_text."""
    def fn(episodes, llm, task):
        owners = [ep for ep in episodes for _ in range(2)]
        answers = W.stage(llm, task, "generator", owners, slots=["generator0", "generator1"] * len(episodes))
        shown, slots = [(header, a.text) for a in answers], list(critic_slots) * len(episodes)
        bare = call in ("bare", "keyed") or (call == "late" and any(a.completion_ids for a in answers))
        if not bare:
            W.stage(llm, task, critic, owners, shown, slots)
        else:
            messages = [W.prompt(told, task, ep.problem, p) for ep, p in zip(owners, shown)]
            keys = {"keys": [("mine", i) for i in range(len(slots))]} if call == "keyed" else {}
            llm(critic, slots, messages, **keys)
        picks = W.stage(llm, task, "judge", episodes, [W._numbered([a.text for a in answers[2 * i:2 * i + 2]])
                                                       for i in range(len(episodes))])
        for i, (ep, pick) in enumerate(zip(episodes, picks)):
            k, fallback = W.parse_choice(pick.text, 2)
            W._count(ep, "judge", fallback)
            if graded:
                ep.final_text = answers[2 * i + k - 1].text
    return fn


def register(fn=None, slots=SLOTS, kinds=None, instructions=None, **options):
    W.register("critiqued", fn or critiqued(), slots,
               kinds=kinds or {"critic": "supervisory", "judge": "supervisory"},
               instructions=instructions or {("critic", "math"): CRITIC, ("judge", "math"): JUDGE}, **options)


def train_refuses(capsys, tmp_path, workflow="critiqued", scale="0.6b"):
    """train.py's one line (exit 2) for a run of `workflow` on math, and eval.py's, which must
    say the same before any model loads."""
    line = refused(capsys, ["--workflow", workflow, "--scale", scale, "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as e:
        ev.main(["--workflow", workflow, "--scale", scale, "--problems", "2", "--quiet"])
    assert e.value.code == line.replace(" (see python train.py --help)", "")
    return line


def test_a_complete_registration_runs(registries, tmp_path):
    register()
    episodes = [W.Episode(problem={"id": "m", "prompt": "1+1", "source": "x", "answer": "2"})]
    llm = FakeLLM(generator=["\\boxed{2}", "\\boxed{3}"], critic=["none \\boxed{ok}", "\\boxed{wrong}"],
                  judge="\\boxed{1}")
    W.run_workflow("critiqued", episodes, llm, "math")
    assert [(c.role, c.slot) for c in episodes[0].calls] == [
        ("generator", "generator0"), ("generator", "generator1"), ("critic", "critic0"), ("critic", "critic1"),
        ("judge", "judge")]
    assert episodes[0].final_text == "\\boxed{2}" and llm.log[1][2][0][0]["content"] == CRITIC
    args = flags.parse_args(["--workflow", "critiqued", "--scale", "0.6b", "--out", str(tmp_path / "r")])
    assert args.workflow == "critiqued"


# ----------------------------------------------------------------------------- every role has its own instruction

def test_a_role_declared_solution_without_an_instruction_is_refused(registries, tmp_path, capsys):
    """Declared "solution", the critic would be asked math's default, the generator's "Solve the
    math problem step by step..." (and paid a solution's grade under --credit own)."""
    register(kinds={"critic": "solution", "judge": "supervisory"}, instructions={("judge", "math"): JUDGE})
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued' on task 'math': the critic has no instruction of its own on math, only the "
        "task kind's default, written for generator; give it one: register('critiqued', ..., "
        "instructions={('critic', 'math'): ...}) (see python train.py --help)")


def test_a_kind_names_the_roles_its_default_was_written_for(registries):
    """A new kind's default goes to the built-in solvers it does not name (SOLVERS, unless it
    says default_for=...), never to a fork's role."""
    taskkinds.register_task("yes_no", lambda text, problem: 0.0, check=lambda r: None,
                            instructions={"generator": "Answer yes or no.",
                                          "orchestrator": "List up to 3 ways to decide, one per line, as STRATEGY k:"},
                            default="Read the candidates, then answer yes or no yourself.", default_for=("synthesizer",))
    with pytest.raises(ValueError, match=r"^workflow 'orch_workers' on task 'yes_no': the worker has no instruction of "
                                         r"its own on yes_no, only the task kind's default, written for synthesizer; "
                                         r"give it one: register_task\('yes_no', \.\.\., instructions=\{'worker'"):
        W.check_run("orch_workers", "yes_no")
    register(instructions={("critic", "yes_no"): CRITIC, ("judge", "yes_no"): JUDGE})
    W.check_run("critiqued", "yes_no")               # every role its own, or the generator the kind names


# ----------------------------------------------------------------------------- a name once

def test_a_name_that_exists_is_refused_unless_replaced_on_purpose(registries, tmp_path, capsys):
    key = toy._key("math", toy.WARM)
    with pytest.raises(ValueError) as e:
        W.register("voting", W.single, {"generator": "generator"})
    assert str(e.value) == "workflow 'voting' exists; choose another name, or pass replace=True to replace it on purpose"
    with pytest.raises(ValueError) as e:
        taskkinds.register_task("math", lambda text, problem: 0.0, instructions={}, default="Answer.",
                                check=lambda r: None)
    assert str(e.value) == ("task kind 'math' exists; choose another name, or pass replace=True to replace it on "
                            "purpose")
    assert W.WORKFLOWS["voting"] is W.voting and toy._key("math", toy.WARM) == key   # nothing moved
    W.register("voting", W.single, {"generator": "generator"}, replace=True)
    flags.parse_args(["--workflow", "voting", "--scale", "0.6b", "--out", str(tmp_path / "r")])
    assert "note: workflow 'voting' is a replacement registered with replace=True" in capsys.readouterr().err


def test_a_refused_registration_at_import_is_one_line(tmp_path):
    """A fork's registration runs as its module is imported, before any entry point handles
    errors: uncaught, taskkinds.Refused is one line naming the fix and the registration's line."""
    fork = tmp_path / "fork.py"
    fork.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom workflows import *\n\n"
                    "register('voting', single, {'generator': ('generator',)})\n")
    done = subprocess.run([sys.executable, str(fork)], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "error: workflow 'voting' exists; choose another name, or pass replace=True to replace it on purpose "
        "(fork.py:5)"]


# ----------------------------------------------------------------------------- the toy world's roles

def test_the_toy_check_knows_roles_not_transcripts(registries, tmp_path, capsys):
    assert toy.learned_roles() == {r for w in ("voting", "eval_opt", "orch_workers") for r in W.ROLES[w]}
    register(slots={"generator": ("generator0", "generator1"), "reviser": ("critic0", "critic1"), "judge": "judge"},
             fn=critiqued(critic="reviser"), kinds={"reviser": "solution", "judge": "supervisory"},
             instructions={("reviser", "math"): CRITIC, ("judge", "math"): JUDGE})
    line = train_refuses(capsys, tmp_path, scale="toy")
    assert line.startswith("error: --workflow critiqued: the toy world's warm start has no transcript of role 'reviser'")


# ----------------------------------------------------------------------------- roles and slots, as pairs

def test_a_slot_two_roles_share_is_refused_at_registration(registries):
    with pytest.raises(ValueError) as e:
        register(slots={"generator": ("generator0", "generator1"), "critic": ("generator0", "generator1"),
                        "judge": "judge"})
    assert str(e.value) == ("workflow 'critiqued': slot 'generator0' is both the generator's and the critic's; "
                            "advantages are grouped by (problem, slot), so their rows would share a group: give "
                            "the critic slots of its own")
    assert "critiqued" not in W.WORKFLOWS


def test_a_stage_in_another_roles_slots_is_refused_before_any_rollout(registries, tmp_path, capsys):
    register(fn=critiqued(critic_slots=("generator0", "generator1")))
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued' calls the critic in slot 'generator0', the generator's; a role calls only in "
        "its own slots (critic0, critic1): declare them in register('critiqued', ..., slots={'critic': (...)}) "
        "(see python train.py --help)")
    llm = FakeLLM(generator="g", critic="c", judge="\\boxed{1}")
    with pytest.raises(ValueError, match="calls the critic in slot 'generator0'"):
        W.run_workflow("critiqued", [W.Episode(problem={"id": "m", "prompt": "1+1"})], llm, "math")
    assert llm.log == []


def test_a_role_the_registration_lacks_is_refused_before_any_rollout(registries, tmp_path, capsys):
    register(slots={"generator": ("generator0", "generator1"), "judge": "judge"},
             kinds={"judge": "supervisory"}, instructions={("judge", "math"): JUDGE})
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued' calls the role 'critic', which its registration does not declare (it declares "
        "generator, judge); add it: register('critiqued', ..., slots={..., 'critic': (...)}) "
        "(see python train.py --help)")


def test_slots_that_depend_on_a_parameter_are_checked_with_the_runs_value(registries, tmp_path, capsys):
    def slots(critics: int = 2):
        return {"generator": ("generator0", "generator1"), "critic": tuple(f"critic{i}" for i in range(critics)),
                "judge": ("judge",) if critics < 3 else ("critic2",)}
    register(slots=slots, params=(W.Param("critics", int, 2, (1, 3), "critics"),),
             fn=lambda episodes, llm, task, critics=2: critiqued()(episodes, llm, task))
    W.check_run("critiqued", "math", {"critics": 2})
    line = refused(capsys, ["--workflow", "critiqued", "--scale", "0.6b", "--critics", "3", "--out", str(tmp_path)])
    assert line.startswith("error: workflow 'critiqued': slot 'critic2' is both the critic's and the judge's")


# ----------------------------------------------------------------------------- fixed text

def test_a_header_that_holds_a_phrase_is_refused(registries, tmp_path, capsys):
    register(fn=critiqued(header="Critique of Solution 1:"))
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued', the critic's prompt: the fixed prompt string 'Solution 1:' is inside "
        "'Critique of Solution 1:'; no phrase may hold another: reword the new one, or use the existing phrase "
        "whole (see python train.py --help)")


def test_a_new_header_is_declared_and_then_a_phrase(registries, tmp_path, capsys):
    register(fn=critiqued(header="Answer to check:"))
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued': the critic's user message holds the fixed text 'Answer to check:', which no "
        "registration declares; declare it: register('critiqued', ..., headers=('Answer to check:', ...)) "
        "(see python train.py --help)")
    register(fn=critiqued(header="Answer to check:"), headers=("Answer to check:",), replace=True)
    W.check_run("critiqued", "math")
    assert "Answer to check:" in W.phrases() and "Answer to check:" not in toy.phrases()
    with pytest.raises(ValueError, match="^workflow 'other': the fixed prompt string 'Problem:' is inside 'Problem: "):
        W.register("other", W.single, {"generator": "generator"}, headers=("Problem: again",))


# ----------------------------------------------------------------------------- row keys

def test_a_stage_called_without_row_keys_is_refused_before_any_rollout(registries, tmp_path, capsys):
    """A bare llm(role, slots, messages) would key its draws by the order of calls: a resumed
    run and every other rank would draw other numbers. rollout.make_llm's llm refuses it too
    (tests/test_sampler.py)."""
    register(fn=critiqued(call="bare"))
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued' calls llm('critic', ...) without row keys, so its draws would follow the order "
        "of calls, which a resumed run or another rank does not repeat; make it through stage(llm, task, role, "
        "owners, ...) (see python train.py --help)")


# ----------------------------------------------------------------------------- the books: the stage keeps them

MATH_PROBLEM = {"id": "m", "prompt": "1+1", "source": "x", "answer": "2"}


def test_a_stages_prompt_carries_its_roles_instruction_and_its_calls_are_appended(registries):
    """By construction: the stage builds each prompt from the role it runs and appends each call
    to its episode, keyed by the index it takes there; the workflow never touches either."""
    register()
    episodes = [W.Episode(problem=MATH_PROBLEM, rollout=g, stream=("train", 1)) for g in range(2)]
    llm = FakeLLM(generator="\\boxed{2}", critic="\\boxed{ok}", judge="\\boxed{1}")
    W.run_workflow("critiqued", episodes, llm, "math")
    assert [m[0]["content"] for _, _, ms in llm.log for m in ms[:1]] == [K_GEN, CRITIC, JUDGE]
    assert llm.keys[1] == [("train", 1, "m", g, k) for g in range(2) for k in (2, 3)]   # after the two answers
    assert [len(ep.calls) for ep in episodes] == [5, 5] and all(ep.final_text == "\\boxed{2}" for ep in episodes)


def test_an_episode_left_without_its_graded_answer_is_refused_before_any_rollout(registries, tmp_path, capsys):
    """Unset, final_text would be graded as empty: accuracy 0 with no word."""
    register(fn=critiqued(graded=False))
    message = ("workflow 'critiqued' left 2 of 2 episodes without a graded answer; set each episode's final_text "
               "(e.g. ep.final_text = call.text of the call that answers)")
    assert train_refuses(capsys, tmp_path) == f"error: {message} (see python train.py --help)"
    llm = FakeLLM(generator="g", critic="c", judge="\\boxed{1}")
    with pytest.raises(ValueError) as e:
        W.run_workflow("critiqued", [W.Episode(problem=MATH_PROBLEM)], llm, "math")
    assert str(e.value) == message and llm.log == []

    def a_call(episodes, llm, task):   # the Call itself, not its text
        for ep, call in zip(episodes, W.stage(llm, task, "generator", episodes)):
            ep.final_text = call
    W.register("a_call", a_call, {"generator": "generator"})
    with pytest.raises(ValueError, match=r"^workflow 'a_call' left 2 of 2 episodes without a graded answer \(a str; "
                                         r"one is a Call\); set each episode's final_text"):
        W.check_run("a_call", "math")


@pytest.mark.parametrize("call, told, message", [
    ("keyed", "critic", "workflow 'critiqued' made 10 llm calls, but its episodes hold 6 new ones; make every call "
                        "through stage(llm, task, role, owners, ...), which appends each to its episode, and append "
                        "none yourself"),
    ("keyed", "generator", "workflow 'critiqued' calls the critic with the system message 'Solve the math problem "
                           "step by step. Put...', not the critic's instruction on math; make it through stage(llm, task, role, "
                           "owners, ...), which builds every prompt from its role")])
def test_a_bare_call_that_skips_the_books_is_refused_before_any_rollout(registries, tmp_path, capsys, call, told,
                                                                         message):
    """A call no episode holds would never be trained (its role gone from the step line); one
    under another role's instruction would leave the critic's own unused."""
    register(fn=critiqued(call=call, told=told))
    assert train_refuses(capsys, tmp_path) == f"error: {message} (see python train.py --help)"


def test_a_call_appended_twice_or_a_stage_of_the_old_signature_is_refused(registries):
    def twice(episodes, llm, task):
        for ep, call in zip(episodes, W.stage(llm, task, "generator", episodes)):
            ep.calls.append(call)          # the old contract's bookkeeping, now the stage's
            ep.final_text = call.text

    def old(episodes, llm, task):
        W.stage(llm, "generator", ["generator"] * len(episodes),
                [W.generator_messages(ep.problem, task) for ep in episodes], episodes)
    W.register("twice", twice, {"generator": "generator"})
    W.register("old", old, {"generator": "generator"})
    with pytest.raises(ValueError, match=r"^workflow 'twice' made 2 llm calls, but its episodes hold 4 new ones"):
        W.check_run("twice", "math")
    with pytest.raises(ValueError, match=r"^stage\(llm, task, role, owners, parts=None, slots=None, revise=False\): "
                                         r"owners are Episodes, got task='generator'"):
        W.check_run("old", "math")


def test_a_call_the_workflow_pays_or_an_episode_graded_on_anothers_text_is_refused(registries, tmp_path, capsys):
    """A reward set in the workflow would skip the reward's checks and --credit; an index slip
    (episode i graded on episode i + 1's answer) would pay each call for a text it never wrote."""
    def pays(episodes, llm, task):     # a format penalty, paid by hand
        for ep, call in zip(episodes, W.stage(llm, task, "generator", episodes)):
            ep.final_text, call.reward = call.text, -1.0

    def slip(episodes, llm, task):
        answers = W.stage(llm, task, "generator", episodes)
        for i, ep in enumerate(episodes):
            ep.final_text = answers[(i + 1) % len(episodes)].text
    W.register("pays", pays, {"generator": "generator"})
    W.register("slip", slip, {"generator": "generator"})
    assert train_refuses(capsys, tmp_path, "pays") == (
        "error: workflow 'pays' set the reward of a generator call (-1.0); calls are paid once graded (their "
        "episode's reward, or under --credit own their own text's grade: workflows.pay), so leave Call.reward unset "
        "and grade in a task kind's reward (see python train.py --help)")
    W.check_run("slip", "math")        # the dry run's answers are all empty: only a real run shows it
    problems = [{**MATH_PROBLEM, "id": f"m{i}", "prompt": f"{i} + 1"} for i in range(3)]
    answer = FakeLLM(generator=lambda slot, messages: f"\\boxed{{{user(messages)}}}")
    with pytest.raises(ValueError) as e:
        W.run_workflow("slip", [W.Episode(problem=p) for p in problems], answer, "math")
    assert str(e.value) == ("workflow 'slip' graded episode 0 (problem 'm0', rollout 0) on the text of a call of "
                            "episode 1, and of none of its own; set each episode's final_text from its own calls (an "
                            "index slip?)")
    same = [W.Episode(problem=p) for p in problems]   # every answer alike: each is also its own
    W.run_workflow("slip", same, FakeLLM(generator="\\boxed{2}"), "math")
    assert [ep.final_text for ep in same] == ["\\boxed{2}"] * 3


def test_a_workflows_own_random_draws_repeat_with_the_seed_and_leave_the_global_generators_alone(registries):
    """A fork that shuffles its candidates with random.sample (or numpy's, or torch's global
    generator) draws the same under the same seed and step, so a run repeats and resumes."""
    import random

    import numpy as np
    import torch

    import rollout
    drawn = []

    def shuffles(episodes, llm, task):
        for ep, call in zip(episodes, W.stage(llm, task, "generator", episodes)):
            drawn.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
            ep.final_text = call.text
    W.register("shuffles", shuffles, {"generator": "generator"})
    problems = [{**MATH_PROBLEM, "id": f"m{i}"} for i in range(2)]
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()

    def draws(seed, step):
        llm, drawn[:] = FakeLLM(generator="\\boxed{2}"), []
        llm.seed = seed
        rollout.run_episodes(llm, "shuffles", problems, 2, "math", ("train", step))
        return list(drawn)
    first = draws(5, 1)
    assert len(first) == 2 + 4 and draws(5, 1) == first   # the dry run's 2 episodes, then 2 x 2
    assert draws(5, 2) != first and draws(6, 1) != first
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])


def test_a_role_declared_and_never_called_is_said_once(registries, monkeypatch, capsys):
    """Under isolated such a role's adapter trains on nothing, and the Shared-Isolated contrast
    the sweep builds for it means less than it seems."""
    monkeypatch.setattr(taskkinds, "_NOTED", set())

    def alone(episodes, llm, task):     # an aggregator declared, never asked
        for ep, call in zip(episodes, W.stage(llm, task, "generator", episodes)):
            ep.final_text = call.text
    W.register("alone", alone, {"generator": "generator", "aggregator": "aggregator"})
    W.check_run("alone", "math")
    W.check_run("alone", "math")
    W.check_run("voting", "math")
    assert capsys.readouterr().err.splitlines() == [
        "note: workflow 'alone' declares 'aggregator' but its dry run (empty answers) never called it: a role no run "
        "calls trains nothing, and under --sharing isolated its adapter gets no rows"]


def test_a_key_that_leaves_out_the_problem_grades_each_problem_apart(registries):
    """A coarser key= (the boxed answer alone) must not pay one problem's grade to another."""
    graded = []

    def exact(text, problem):
        graded.append(problem["id"])
        return float(rewards.last_boxed(text) == problem["answer"])
    taskkinds.register_task("boxed", exact, instructions={"generator": "Say it."}, default="Say it boxed.",
                            check=lambda r: None, key=lambda text, problem: rewards.last_boxed(text))
    problems = [{"id": "a", "answer": "2"}, {"id": "b", "answer": "3"}, {"id": "a", "answer": "2"}]
    assert taskkinds.score(["\\boxed{2}", "\\boxed{2}", "so \\boxed{2}"], problems, "boxed") == [1.0, 0.0, 1.0]
    assert graded == ["a", "b"]       # a's two texts share a key: graded once


def test_a_contract_broken_where_the_dry_run_did_not_go_ends_the_run_in_one_line_leaving_nothing(
        registries, model_dir, tmp_path, capsys):
    """A bare call on a branch only a real run takes (the answers have tokens): refused as it
    comes, one line, exit 2, and the run folder gone, so the same command runs again once the
    fork is fixed (not "run folder exists")."""
    register(fn=critiqued(call="late"))
    out = tmp_path / "run"
    argv = ["--scale", model_dir, "--workflow", "critiqued", "--data", "toy_math", "--steps", "2",
            "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--max-prompt-tokens", "240",
            "--lora-rank", "2", "--device", "cpu", "--quiet", "--out", str(out)]
    for eval_every in ("1", "0"):          # in the step-0 evaluation, then in the first step
        with pytest.raises(SystemExit) as e:
            train.main([*argv, "--eval-problems", "2", "--eval-every", eval_every])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert e.value.code == 2 and err == [
            "error: workflow 'critiqued' calls llm('critic', ...) without row keys, so its draws would follow the "
            "order of calls, which a resumed run or another rank does not repeat; make it through stage(llm, task, "
            "role, owners, ...)"]
        assert not out.exists()


# ----------------------------------------------------------------------------- names and parameters

def test_a_workflow_name_is_checked_as_a_task_kinds_is(registries):
    for name in ("relay/v2", "Relay", "2relay", "relay-v2", ""):
        with pytest.raises(ValueError) as e:
            W.register(name, W.single, {"generator": "generator"})
        assert str(e.value) == (f"workflow {name!r}: a name is lower-case letters, digits and _, starting with a "
                                "letter") and name not in W.WORKFLOWS


def test_what_a_registration_declares_is_checked_against_the_code(registries):
    """A Param its function does not take would set nothing; one with another default would make
    --help lie; kinds or instructions for a role it does not declare would never be read."""
    cases = [(dict(params=(W.Param("critics", int, 2, (1, 3), "critics"),)),
              "workflow 'critiqued': parameter 'critics' is not a keyword of its function, so its flag would set "
              "nothing; name one of none (add it to the function)"),
             (dict(fn=lambda episodes, llm, task, critics=3: None, params=(W.Param("critics", int, 2, (1, 3), "c"),)),
              "workflow 'critiqued': parameter 'critics' states the default 2, but its function's is 3; give the "
              "Param the function's default"),
             (dict(fn=lambda episodes, task: None), "workflow 'critiqued': its function must take (episodes, llm, "
                                                    "task, **params), got "),
             (dict(kinds={"critic": "supervisory", "judge": "supervisory", "umpire": "supervisory"}),
              "workflow 'critiqued': its kinds or instructions name the role 'umpire', which its slots do not declare "
              "(generator, critic, judge); declare it or drop the entry")]
    for given, message in cases:
        with pytest.raises(ValueError) as e:
            register(**given)
        assert str(e.value).startswith(message) and "\n" not in str(e.value) and "critiqued" not in W.WORKFLOWS
    W.register("voting2", W.voting, {"generator": tuple(f"generator{i}" for i in range(9)), "aggregator": "aggregator"},
               params=(W.Param("n_voters", int, 3, (1, 9), "voters"),))
    for value, message in ((12, "n_voters must be a int in 1..9, got 12"), ("3", "n_voters must be a int in 1..9")):
        with pytest.raises(ValueError, match=f"^workflow 'voting2': {message}"):
            W.check_run("voting2", "math", {"n_voters": value})
    with pytest.raises(ValueError, match="^workflow 'voting2' has no parameter 'voters' \\(its parameters: n_voters\\)"):
        W.check_run("voting2", "math", {"voters": 2})


def test_what_a_task_kind_declares_is_checked_at_registration(registries):
    base = dict(reward=lambda text, problem: 0.0, instructions={"generator": "Answer yes or no."},
                default="Answer yes or no, in one word.", check=lambda r: None)
    cases = [(dict(data={"gpu": "mine"}), "data is {'toy': NAME, 'real': NAME} (either may be left out)"),
             (dict(rounds=-1), "rounds must be an int >= 0, got -1"),
             (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
             (dict(round=2), "no option 'round'; the options are "),
             (dict(reward="1.0"), "reward must be a function"),
             (dict(parse=True), "parse must be a function")]
    for given, message in cases:
        with pytest.raises(ValueError) as e:
            taskkinds.register_task("yes_no", **{**base, **given})
        assert str(e.value).startswith(f"task kind 'yes_no': {message}") and "yes_no" not in taskkinds.TASK_KINDS


# ----------------------------------------------------------------------------- rewards, where they enter

def loud_kind(value):
    return taskkinds.register_task("loud", lambda text, problem: value, instructions={"generator": "Say it."},
                                   default="Say it loud.", check=lambda r: None, replace=True)


@pytest.mark.parametrize("value", [10.0, -5.0, float("nan"), float("inf"), None, "1"])
def test_a_reward_that_is_not_a_number_in_0_1_is_refused_naming_the_kind_and_record(registries, value):
    loud_kind(value)
    with pytest.raises(taskkinds.Refused) as e:
        taskkinds.score(["a", "b"], [{"id": "r7"}, {"id": "r8"}], "loud")
    assert str(e.value) == (f"task kind 'loud': the reward of record 'r7' is {value!r}, not a number in [0, 1]; "
                            "make <lambda> return one")


def test_partial_credit_is_taken_as_it_is_and_said_once_to_be_counted_right_above_one_half(
        registries, monkeypatch, capsys):
    monkeypatch.setattr(taskkinds, "_NOTED", set())
    loud_kind(0.4)
    for _ in range(2):
        assert taskkinds.score(["a", "b"], [{"id": "r7"}, {"id": "r8"}], "loud") == [0.4, 0.4]
    assert capsys.readouterr().err.splitlines() == [
        "note: task kind 'loud' pays partial credit (0.4 for record 'r7'): training takes it as it is, but accuracy "
        "(eval.jsonl's acc, pass@k, the supervisors' skill) counts a reward above 0.5 as right"]


def test_a_nan_reward_ends_the_run_in_one_line_before_any_update(registries, model_dir, tmp_path, capsys):
    loud_kind(float("nan"))
    data = tmp_path / "loud.jsonl"
    data.write_text("".join(f'{{"id": "l{i}", "prompt": "Say {i}", "kind": "loud"}}\n' for i in range(4)))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--scale", model_dir, "--task", "loud", "--data", str(data), "--steps", "2", "--problems-per-step",
                    "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0", "--lora-rank", "2",
                    "--device", "cpu", "--quiet", "--workflow", "single", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(err) == 1 and "task kind 'loud': the reward of record 'l" in err[0]
    assert not out.exists()


def test_a_first_batch_paid_nothing_with_nothing_parsed_says_so_once(registries, monkeypatch, capsys):
    monkeypatch.setattr(taskkinds, "_LOOKED", set())
    problems = [{"id": "m", "answer": "2"}] * 3
    assert taskkinds.score(["2", "two", "it is 2"], problems, "math") == [0.0, 0.0, 0.0]   # no \\boxed{} at all
    assert taskkinds.score(["2", "two", "it is 2"], problems, "math") == [0.0, 0.0, 0.0]
    assert capsys.readouterr().err.splitlines() == [
        "note: task kind 'math': every one of the 3 answers graded first was paid 0, none of them parsed; nothing is "
        "learned until some answer is paid: check that the instructions ask for what the reward reads"]
    monkeypatch.setattr(taskkinds, "_LOOKED", set())
    assert taskkinds.score(["\\boxed{3}", "x"], problems[:2], "math") == [0.0, 0.0]   # one parsed, wrong: a start
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(taskkinds, "_LOOKED", set())   # 16 parsed and none paid: a hard start, or a broken reward
    assert taskkinds.score(["\\boxed{3}"] * 16 + ["x"], problems[:1] * 17, "math") == [0.0] * 17
    assert capsys.readouterr().err.splitlines() == [
        "note: task kind 'math': every one of the 17 answers graded first was paid 0, though 16 of them parsed; "
        "nothing is learned until some answer is paid: check that the reward compares like with like (not a number "
        "with a string)"]


# ----------------------------------------------------------------------------- sweep.py

def test_the_default_sweep_leaves_out_what_the_toy_world_cannot_run(registries, tmp_path, capsys):
    register()
    taskkinds.register_task("yes_no", lambda text, problem: 0.0, instructions={"generator": "Answer yes or no."},
                            default="Answer yes or no, in one word.", check=lambda r: None)
    assert sweep.main(["--dry-run", "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr()
    left = [line for line in out.err.splitlines() if line.startswith("sweep: leaving out")]
    assert left == ["sweep: leaving out --workflow critiqued: the toy world's warm start has no transcript of role "
                    "'critic', so the toy model never learned it; write one in toy.transcript with a weight in "
                    "toy.ROLE_MIX (a new toy model), or run a real model (--scale)",
                    *(f"sweep: leaving out --task {kind}: the toy world has no data of it; name it in --tasks with a "
                      "real --scale" for kind in ("arith", "yes_no"))]
    assert "14 cells" in out.out and "critiqued" not in out.out


def test_a_sweep_at_a_real_scale_leaves_out_a_kind_with_no_data_there(registries, tmp_path, capsys):
    """As the toy scale does: one line, and the rest of the sweep runs; named in --tasks with its
    data after --, the kind runs."""
    taskkinds.register_task("yes_no", lambda text, problem: 0.0, instructions={"generator": "Answer yes or no."},
                            default="Answer yes or no, in one word.", check=lambda r: None)
    assert sweep.main(["--dry-run", "--scale", "0.6b", "--workflows", "single", "voting", "--sharings", "shared",
                       "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr()
    assert [line for line in out.err.splitlines() if line.startswith("sweep:")] == [
        "sweep: leaving out --task yes_no: it has no default data set at real scales; name it in --tasks and give "
        "its data to every cell: -- --data FILE"]
    assert "6 cells" in out.out and "voting-arith" in out.out and "yes_no" not in out.out
    data = tmp_path / "yes_no.jsonl"
    data.write_text('{"id": "y1", "prompt": "Is 2 even?", "kind": "yes_no", "answer": "yes"}\n')
    assert sweep.main(["--dry-run", "--scale", "0.6b", "--workflows", "single", "--tasks", "yes_no", "--sharings",
                       "shared", "--out", str(tmp_path / "m"), "--", "--data", str(data)]) == 0
    assert "single-yes_no-shared-0.6b" in capsys.readouterr().out


# ----------------------------------------------------------------------------- a fork's own suite

RELAY = """

DRAFT = "Write a first draft of the solution, step by step."
CRITIQUE = "List the steps of the draft that look wrong, one per line, without solving the problem."
FINISH = "Write the final solution, fixing what the critique found, in the form the problem asks for."


def relay(episodes, llm, task, critiques=1):
    shown = [("Draft:", call.text) for call in stage(llm, task, "drafter", episodes)]
    for _ in range(critiques):
        notes = stage(llm, task, "critic", episodes, shown)
        shown = [(*s, "Critique:", note.text) for s, note in zip(shown, notes)]
    for ep, call in zip(episodes, stage(llm, task, "finisher", episodes, shown)):
        ep.final_text = call.text


register("relay", relay, {"drafter": "drafter", "critic": "critic", "finisher": "finisher"},
         kinds={"drafter": "solution", "critic": "supervisory", "finisher": "solution"},
         instructions={(role, task): text for role, text in (("drafter", DRAFT), ("critic", CRITIQUE),
                                                             ("finisher", FINISH)) for task in ("math", "code")},
         headers=("Draft:", "Critique:"),
         params=(Param("critiques", int, 1, (1, 3), "critique rounds before the finisher writes",
                       flag="relay-critiques"),))
"""
COUNT = """

def count_reward(text, problem):
    return float(rewards.last_number(text) == int(problem["answer"]))


def check_count(record):
    if not str(record.get("answer", "")).isdigit():
        raise ValueError(f"'answer' must be a count, got {record.get('answer')!r}")


register_task("count", count_reward, check=check_count, parse=rewards.last_number, max_new_tokens=32,
              instructions={"generator": "Count what the question asks for. End with the count as a number."},
              default="Read the question, then give the count as a number.")
"""
# The subset of the suite a fork runs (FORK_SUITE): every file that reads the registries in its
# own process or runs an entry point that does (train.py's flags and --help, sweep.py, eval.py,
# the analysis and plots, the records' validation, the README's promises), with its own fork
# checks. Left out for time, as files whose tests train or sample for many steps, build toy
# models or need a package or a GPU, and read no registry beyond the built-in roles their runs
# name: test_train, test_toy, test_sampler, test_parallel, test_cudagraphs, test_grpo,
# test_policies, test_peft, test_tracking, test_runfolder, test_real_model, test_sandbox,
# test_gguf_models, test_intervals. The whole suite on a fork: FORK_SUITE=all.
FORK_SUITE = (("test_plots", "test_imports", "test_readme", "test_results", "test_workflows", "test_forking",
               "test_fork_checks", "test_arith"),
              ("test_eval", "test_sweep", "test_analysis", "test_tasks", "test_rewards", "test_knobs", "test_flags"))
# (in two halves of about equal minutes, run side by side: one thread each, on two cores)
# Left out of the subset too, for time (two thirds of its minutes): sweep.py's children's lives
# (a failing cell, Ctrl-C, a kill, a relative --out), which train the built-in cells they name
# and read no other registration.
FORK_SKIP = ("test_a_failing_cell_is_reported_the_others_finish_and_a_rerun_skips_them",
             "test_a_relative_out_from_another_folder_holds_runs_and_report",
             "test_ctrl_c_lets_the_cells_save_and_a_rerun_resumes_them", "test_a_second_ctrl_c_exits_at_once",
             "test_cells_do_not_outlive_a_killed_sweep")


def scratch_fork(tmp_path):
    """A copy of the repository with the README's two examples and a workflow and a task kind of
    names of their own appended to workflows.py and taskkinds.py, as a forker appends them."""
    from test_forking import readme_block
    copy = tmp_path / "fork"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".cache", "runs", "__pycache__", ".benchmarks"))
    with open(copy / "workflows.py", "a") as f:
        f.write("\n\n" + readme_block("Adding a workflow") + RELAY)
    with open(copy / "taskkinds.py", "a") as f:
        f.write("\n\n" + readme_block("Adding a task kind") + COUNT)
    return copy


def test_a_fork_with_the_readmes_examples_and_names_of_its_own_keeps_the_suite_green(tmp_path):
    """The fork's registrations take (its module imports), its sweep at a real scale leaves out
    the kinds with no data there in one line each, and the suite (FORK_SUITE, or all with
    FORK_SUITE=all) passes on it: every test reads the built-in world (conftest.built_in_world)."""
    copy = scratch_fork(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MARL_CACHE": os.environ.get("MARL_CACHE", os.path.join(ROOT, ".cache"))}
    check = ("import workflows, taskkinds; assert {'debate', 'relay'} <= set(workflows.WORKFLOWS); "
             "assert {'word', 'count'} <= set(taskkinds.TASK_KINDS)")
    subprocess.run([sys.executable, "-c", check], cwd=copy, env=env, check=True)
    swept = subprocess.run([sys.executable, "sweep.py", "--dry-run", "--scale", "0.6b", "--workflows", "relay",
                            "single", "--tasks", "math", "code", "--sharings", "shared"], cwd=copy, env=env,
                           capture_output=True, text=True)
    assert swept.returncode == 0 and "4 cells" in swept.stdout, swept.stderr
    swept = subprocess.run([sys.executable, "sweep.py", "--dry-run", "--scale", "0.6b", "--workflows", "single"],
                           cwd=copy, env=env, capture_output=True, text=True)
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in swept.stderr.splitlines()] == [
        "sweep: leaving out --task word", "sweep: leaving out --task count"], swept.stderr
    whole = os.environ.get("FORK_SUITE") == "all"
    halves = [[]] if whole else [[f"tests/{name}.py" for name in half] for half in FORK_SUITE]
    skip = [] if whole else [x for name in FORK_SKIP for x in ("--deselect", f"tests/test_sweep.py::{name}")]
    skip += ["--deselect", f"tests/test_fork_checks.py::{sys._getframe().f_code.co_name}"]
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files, *skip,
                              "--basetemp", str(tmp_path / f"half{i}")],
                             cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, files in enumerate(halves)]
    outs = [run.communicate()[0] for run in runs]
    for run, out in zip(runs, outs):
        assert run.returncode == 0, out[-5000:]
