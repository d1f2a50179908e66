"""What a fork can get wrong, each refused in one line before any rollout: the cases a forker
found by breaking a workflow of two generators, a critic on each and a judge that picks
(`critiqued` below), registered as the end of workflows.py would register it. Each case is the
registration a forker would write, then train.py's flags (exit 2, one line), eval.py's command
line or run_workflow. The `registries` fixture (conftest.py) gives scratch registries holding
the built-in world alone. CPU, offline, no model: `python -m pytest -q tests/test_fork_checks.py`."""
import os
import subprocess
import sys

import pytest

import eval as ev
import flags
import sweep
import taskkinds
import toy
import workflows as W
from conftest import ROOT, refused
from test_workflows import FakeLLM

CRITIC = "Point out the first mistake in the solution, or say it has none. End with \\boxed{ok} or \\boxed{wrong}."
JUDGE = "Read both solutions and their critiques, then pick one with \\boxed{1} or \\boxed{2}."
SLOTS = {"generator": ("generator0", "generator1"), "critic": ("critic0", "critic1"), "judge": ("judge",)}


def critiqued(critic="critic", critic_slots=("critic0", "critic1"), header=W.SOLUTION_HEADERS[0], keyed=True,
              graded=True):
    """The forker's workflow: two generators answer, a critic reads each answer under `header`
    (in `critic_slots`, as role `critic`), a judge picks one of the two. The knobs are the
    mistakes a forker made: `keyed=False` calls the llm bare (no keys, nothing appended),
    `graded=False` never sets the episodes' final_text."""
    def fn(episodes, llm, task):
        owners = [ep for ep in episodes for _ in range(2)]
        answers = W.stage(llm, task, "generator", owners, slots=["generator0", "generator1"] * len(episodes))
        shown = [(header, a.text) for a in answers]
        if keyed:
            W.stage(llm, task, critic, owners, shown, list(critic_slots) * len(episodes))
        else:
            llm(critic, list(critic_slots) * len(episodes), [W.prompt(critic, task, ep.problem, p)
                                                            for ep, p in zip(owners, shown)])
        picks = W.stage(llm, task, "judge", episodes, [W._numbered([a.text for a in answers[2 * i:2 * i + 2]])
                                                       for i in range(len(episodes))])
        for i, (ep, call) in enumerate(zip(episodes, picks)):
            k, fallback = W.parse_choice(call.text, 2)
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
    register(fn=critiqued(keyed=False))
    assert train_refuses(capsys, tmp_path) == (
        "error: workflow 'critiqued' calls llm('critic', ...) without row keys, so its draws would follow the order "
        "of calls, which a resumed run or another rank does not repeat; make it through stage(llm, task, role, "
        "owners, ...) (see python train.py --help)")


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
                    "sweep: leaving out --task yes_no: the toy world has no data of it; name it in --tasks with a "
                    "real --scale"]
    assert "14 cells" in out.out and "critiqued" not in out.out


# ----------------------------------------------------------------------------- a fork's own suite

FORK = '''
JUDGE_OWN = "Pick the stronger of the two final answers as \\\\boxed{1} or \\\\boxed{2}."
CRITIC_OWN = "Name the weakest step of the solution in one sentence."


def debate(episodes, llm, task):
    owners = [ep for ep in episodes for _ in range(2)]
    first = stage(llm, task, "generator", owners, slots=["generator0", "generator1"] * len(episodes))
    stage(llm, task, "critic", owners, [(SOLUTION_HEADERS[0], c.text) for c in first], ["critic0", "critic1"] * len(episodes))
    judged = stage(llm, task, "judge", episodes, [_numbered([c.text for c in first[2 * i:2 * i + 2]])
                                                  for i in range(len(episodes))])
    for i, (ep, call) in enumerate(zip(episodes, judged)):
        k, fallback = parse_choice(call.text, 2)
        _count(ep, "judge", fallback)
        ep.final_text = first[2 * i + k - 1].text


register("debate", debate, {"generator": ("generator0", "generator1"), "critic": ("critic0", "critic1"),
                            "judge": ("judge",)}, kinds={"critic": "solution", "judge": "supervisory"},
         instructions={("judge", "math"): JUDGE_OWN, ("judge", "code"): JUDGE_OWN,
                       ("critic", "math"): CRITIC_OWN, ("critic", "code"): CRITIC_OWN})
'''


def test_a_fork_with_a_debate_a_judge_and_a_critic_of_its_own_keeps_the_forking_tests_green():
    """The fork above, appended to workflows.py (here: run in its namespace, on the built-in
    registrations alone, before the tests import it), names its workflow, roles and instructions
    as the README's example and these tests do; test_forking.py and this file still pass, since
    they register into scratch registries (conftest.registries)."""
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]; import conftest, workflows; "
            f"conftest.keep_built_in(); exec({FORK!r}, vars(workflows)); "
            "assert workflows.ROLES['debate'] == ('generator', 'critic', 'judge'); import pytest; "
            "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', 'tests/test_forking.py', "
            "'tests/test_fork_checks.py', '-k', 'not keeps_the_forking_tests_green']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
