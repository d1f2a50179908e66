"""A fork's changes, each registered in this file alone: a task kind (taskkinds.register_task)
and a workflow with a parameter of its own (workflows.register), the README's two examples
("Forking") taken from README.md as they are written there. Everything that names task kinds
and workflows reads the registries, so these tests reach train.py's flags and --help, sweep.py's
cells and eval.py's flags in-process: the `registries` fixture undoes each registration after
its test. What a registration leaves unsaid is refused in one line before any step. CPU,
offline; one test trains the README's workflow for 2 steps on a tiny random model:
`python -m pytest -q tests/test_forking.py`."""
import json
import os
import re

import pytest

import eval as ev
import flags
import sweep
import taskkinds
import tasks
import train
import workflows
from conftest import ROOT, refused
from test_workflows import FakeLLM, only_phrases_and


def readme_block(heading):
    """The first ```python block of README.md under the heading `### {heading}`."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index(f"\n### {heading}\n"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def registered_from_readme(heading, module):
    """Run the README's block as the last lines of `module` (workflows.py, taskkinds.py): in a
    copy of its namespace, so its private helpers are at hand and its registries (patched by
    the `registries` fixture) take the registration."""
    namespace = dict(vars(module))
    exec(readme_block(heading), namespace)
    return namespace


# ----------------------------------------------------------------------------- a task kind

SAY = "Say whether the number is odd or even, in one word."
CHOOSE = "Reply with the number of the answer most likely right as \\boxed{k}."
PICK = "Read the answers and reply with the one word most likely right."


def parity_reward(text, problem):
    """1 when the whole text is the answer word: "odd" is right, "odd, I think" is not."""
    return float(text.strip().lower() == problem["answer"])


def check_parity(record):
    if record.get("answer") not in ("odd", "even"):
        raise ValueError(f"'answer' must be 'odd' or 'even', got {record.get('answer')!r}")


@pytest.fixture
def parity(registries):
    return taskkinds.register_task("parity", parity_reward, instructions={"generator": SAY, "aggregator": CHOOSE},
                                   default=PICK, check=check_parity, max_new_tokens=8, rounds=1)


def parity_problem(i, answer):
    return {"id": f"p{i}", "prompt": f"Is {i} odd or even?", "source": "mine", "kind": "parity", "answer": answer}


def test_a_task_kind_rewards_the_whole_text_and_its_batch_grades_each_text_once(parity):
    p = parity_problem(7, "odd")
    texts = ["odd", "odd, I think", "\\boxed{odd}", " ODD ", "odd"]
    assert taskkinds.score(texts, [p] * 5, "parity") == [1.0, 0.0, 0.0, 1.0, 1.0]
    seen = []
    taskkinds.register_task("parity_seen", lambda t, q: seen.append(t) or parity_reward(t, q), instructions={},
                            default=PICK, check=check_parity)
    assert taskkinds.score(texts, [p] * 5, "parity_seen") == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert seen == texts[:4]   # the repeated text graded once; no two texts merged by an extracted answer


def test_workflows_run_on_a_registered_task_kind_with_its_instructions(parity):
    episodes = [workflows.Episode(problem=parity_problem(7, "odd")), workflows.Episode(problem=parity_problem(4, "even"))]
    llm = FakeLLM(generator=["odd", "even", "odd", "even", "odd", "odd"], aggregator="\\boxed{2}")
    workflows.run_workflow("voting", episodes, llm, "parity")
    assert [e.final_text for e in episodes] == ["even", "odd"]
    assert taskkinds.score([e.final_text for e in episodes], [e.problem for e in episodes], "parity") == [0.0, 0.0]
    systems = {c.role: c.messages[0]["content"] for e in episodes for c in e.calls}
    assert systems == {"generator": SAY, "aggregator": CHOOSE}
    episodes = [workflows.Episode(problem=parity_problem(3, "odd"))]
    llm = FakeLLM(orchestrator="STRATEGY 1: halve it", worker="odd", synthesizer="odd")
    with pytest.raises(ValueError, match="the orchestrator's output is parsed"):   # a run of it is refused...
        workflows.run_workflow("orch_workers", episodes, llm, "parity")
    assert llm.log == []
    workflows.orch_workers(episodes, llm, "parity")                  # ...the function itself still runs
    systems = {c.role: c.messages[0]["content"] for c in episodes[0].calls}
    assert systems == {"orchestrator": PICK, "worker": PICK, "synthesizer": PICK}   # roles it does not name: the default
    assert {SAY, CHOOSE, PICK} <= set(workflows.phrases())             # new fixed strings (none of the toy world's)


def test_a_parsed_role_left_on_the_default_is_refused_before_any_step(parity, tmp_path, capsys):
    """Eval-Opt's evaluator answers \\boxed{Correct}: on a kind that names no evaluator it would be
    asked the default (a solver's instruction) and its verdict would fall back on every call."""
    message = ("workflow 'eval_opt' on task 'parity': the evaluator's output is parsed (a supervisory role), but it "
               "has no instruction of its own on parity, only the task kind's default, written for another role; give "
               "it one: register_task('parity', ..., instructions={'evaluator': ...})")
    with pytest.raises(ValueError) as e:
        workflows.run_workflow("eval_opt", [workflows.Episode(problem=parity_problem(3, "odd"))], FakeLLM(), "parity")
    assert str(e.value) == message
    data = tmp_path / "parity.jsonl"
    data.write_text(json.dumps(parity_problem(1, "odd")) + "\n")
    given = ["--workflow", "eval_opt", "--task", "parity", "--scale", "0.6b", "--data", str(data)]
    assert refused(capsys, [*given, "--out", str(tmp_path / "r")]) == f"error: {message} (see python train.py --help)"
    with pytest.raises(SystemExit) as e:                               # eval.py: before the model loads
        ev.main([*given, "--quiet"])
    assert e.value.code == f"error: {message}"
    run = tmp_path / "saved"                                           # --resume: the registries may have changed
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"workflow": "eval_opt", "task": "parity", "scale": "0.6b"}))
    assert refused(capsys, ["--resume", str(run)]) == f"error: {message} (see python train.py --help)"


def test_a_task_kind_is_checked_against_the_headers_when_a_run_starts(registries):
    """register_task sees the other kinds only (taskkinds.py comes before workflows.py, whose
    headers these are): a kind's text that holds a header is refused at the run's start."""
    taskkinds.register_task("headed", parity_reward, instructions={"generator": "Read the Problem: and answer."},
                            default=PICK, check=check_parity)
    with pytest.raises(ValueError, match=r"^task kind 'headed': the fixed prompt string 'Problem:' is inside 'Read the "
                                         r"Problem: and answer.'; no phrase may hold another"):
        workflows.run_workflow("single", [workflows.Episode(problem=parity_problem(1, "odd"))], FakeLLM(), "headed")


def test_the_readmes_task_kind_registers_and_runs_voting(registries):
    registered_from_readme("Adding a task kind", taskkinds)
    problem = {"id": "n1", "prompt": "Is 17 odd or even?", "source": "mine", "kind": "word", "answer": "odd"}
    assert tasks.validate(problem)["kind"] == "word"
    episodes = [workflows.Episode(problem=problem)]
    workflows.run_workflow("voting", episodes, FakeLLM(generator=["It is even", "It is odd", "odd"],
                                                      aggregator="\\boxed{2}"), "word")
    assert taskkinds.score([episodes[0].final_text], [problem], "word") == [1.0]
    with pytest.raises(ValueError, match=r"register_task\('word', \.\.\., instructions=\{'evaluator': \.\.\.\}\)$"):
        workflows.check_run("eval_opt", "word")                     # as the README says


def test_records_name_their_task_kind_and_its_check_validates_them(parity, tmp_path):
    assert tasks.validate(parity_problem(1, "odd"))["kind"] == "parity"
    with pytest.raises(ValueError, match=r"record 'p2': 'answer' must be 'odd' or 'even', got 'maybe'"):
        tasks.validate(parity_problem(2, "maybe"))
    with pytest.raises(ValueError, match="'kind' 'no-such-kind-xyz' is not a task kind"):
        tasks.validate({**parity_problem(3, "odd"), "kind": "no-such-kind-xyz"})
    path = tmp_path / "parity.jsonl"
    path.write_text("".join(json.dumps(parity_problem(i, "odd" if i % 2 else "even")) + "\n" for i in range(4)))
    assert tasks.task_kind(str(path)) == "parity" and len(tasks.load_task(str(path), "test")) == 4
    math_file = tmp_path / "math.jsonl"   # a record that names no kind is still math by its answer
    math_file.write_text(json.dumps({"id": "m", "prompt": "1+1", "answer": "2"}) + "\n")
    assert tasks.task_kind(str(math_file)) == "math"


def test_the_task_flags_offer_a_registered_kind(parity, tmp_path, capsys):
    data = tmp_path / "parity.jsonl"
    data.write_text(json.dumps(parity_problem(1, "odd")) + "\n")
    args = flags.parse_args(["--task", "parity", "--scale", "0.6b", "--data", str(data), "--out", str(tmp_path / "r")])
    assert (args.task, args.max_new_tokens) == ("parity", 8)
    line = refused(capsys, ["--task", "parity", "--scale", "0.6b", "--out", str(tmp_path / "r")])
    assert "--task parity has no default data set at real scales; pass --data" in line
    assert ev._parser().parse_args(["--task", "parity", "--workflow", "single"]).task == "parity"


# ----------------------------------------------------------------------------- a workflow with a parameter

@pytest.fixture
def debate(registries):
    """The README's debate (README, "Adding a workflow"), registered as the end of workflows.py."""
    return registered_from_readme("Adding a workflow", workflows)["debate"]


def test_the_readmes_debate_revises_on_the_others_answer_and_grades_the_judges_pick(debate):
    episodes = [workflows.Episode(problem={"id": f"m{i}", "prompt": f"What is {i}+1?", "source": "x", "answer": "2"})
                for i in range(2)]
    llm = FakeLLM(generator=[f"g{i}" for i in range(8)], judge=["\\boxed{2}", "no pick"])
    workflows.run_workflow("debate", episodes, llm, "math")         # rounds=1
    assert llm.stages() == ["generator", "generator", "judge"]
    assert [c.slot for c in episodes[0].calls] == ["generator0", "generator1", "generator0", "generator1", "judge"]
    revisions = [m[1]["content"].split("\n") for m in llm.log[1][2]]
    assert revisions[0] == ["Problem:", "What is 0+1?", "Solution 1:", "g0", "Solution 2:", "g1"]   # own first
    assert revisions[1] == ["Problem:", "What is 0+1?", "Solution 1:", "g1", "Solution 2:", "g0"]
    assert llm.log[2][2][1][1]["content"].split("\n")[2:] == ["Solution 1:", "g6", "Solution 2:", "g7"]
    assert [e.final_text for e in episodes] == ["g5", "g6"]              # the pick; no pick: a fallback to 1
    assert [e.fallbacks for e in episodes] == [{"judge": 0}, {"judge": 1}]
    texts = ["What is 0+1?", "What is 1+1?", *(f"g{i}" for i in range(8))]
    assert all(only_phrases_and(m[1]["content"], texts) for _, _, ms in llm.log for m in ms)
    assert llm.log[2][2][0][0]["content"] == workflows.instruction("judge", "math")
    for rounds, calls in ((0, 3), (3, 9)):
        episodes = [workflows.Episode(problem={"id": "m", "prompt": "1+1", "source": "x", "answer": "2"})]
        workflows.run_workflow("debate", episodes, FakeLLM(generator="g", judge="\\boxed{1}"), "math", rounds=rounds)
        assert len(episodes[0].calls) == calls


def test_a_workflow_parameter_is_a_flag_of_train_py_and_eval_py(debate, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "debate: revisions of each debater before the judge picks, 0-3 (default: 1)" in help_text
    given = ["--workflow", "debate", "--scale", "0.6b", "--out", str(tmp_path / "r")]
    assert flags.workflow_params(flags.parse_args([*given, "--debate-rounds", "2"])) == {"rounds": 2}
    assert flags.workflow_params(flags.parse_args(given)) == {}       # unset: the function's default
    assert "--debate-rounds must be in 0..3" in refused(capsys, [*given, "--debate-rounds", "9"])
    line = refused(capsys, ["--workflow", "voting", "--debate-rounds", "2", "--out", str(tmp_path / "r")])
    assert "--debate-rounds is a setting of debate; --workflow is voting" in line
    assert ev._parser().parse_args(["--workflow", "debate", "--debate-rounds", "3"]).debate_rounds == 3


def test_a_workflow_parameter_is_a_sweep_axis_of_its_workflow_alone(debate, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "debate" in text and "debate-rounds (debate)" in text   # the choices and axes, from the registry
    out = tmp_path / "m"
    assert sweep.main(["--dry-run", "--workflows", "debate", "single", "--tasks", "math", "--scale", "0.6b",
                       "--axis", "debate-rounds=0,2", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "train.py" in line]
    names = [line.split("--out ")[1].split()[0].rsplit("/", 1)[1] for line in lines]
    assert sorted(names) == sorted([*(f"debate-math-{sharing}-0.6b-debate-rounds{n}-s0"
                                      for sharing in ("shared", "isolated") for n in (0, 2)),
                                    "single-math-shared-0.6b-s0"])
    assert all(("--debate-rounds" in line) == ("debate-math" in line) for line in lines)
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--workflows", "single", "--scale", "0.6b", "--axis", "debate-rounds=1",
                    "--out", str(out)])
    assert "--axis debate-rounds: a parameter of debate, which --workflows does not run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--workflows", "debate", "--tasks", "math", "--scale", "0.6b",
                    "--axis", "debate-rounds=7", "--out", str(out)])
    assert "train.py refuses its flags: --debate-rounds must be in 0..3" in capsys.readouterr().err


def test_a_new_role_with_no_instruction_on_the_task_is_refused_in_one_line(debate, tmp_path, capsys):
    workflows.register("umpired", debate, {"generator": ("generator0", "generator1"), "umpire": "umpire"},
                       kinds={"umpire": "supervisory"})
    line = refused(capsys, ["--workflow", "umpired", "--scale", "0.6b", "--out", str(tmp_path / "r")])
    assert line == ("error: workflow 'umpired' on task 'math': the umpire's output is parsed (a supervisory role), but "
                    "it has no instruction of its own on math, only the task kind's default, written for another role; "
                    "give it one: register('umpired', ..., instructions={('umpire', 'math'): ...}) "
                    "(see python train.py --help)")


def test_the_readmes_debate_trains_for_two_steps(debate, model_dir, tmp_path):
    """A real-model scale (a random tiny Qwen3 with the toy tokenizer, as a model folder): the
    toy world refuses the judge, which its warm start never learned."""
    out = tmp_path / "run"
    train.main(["--scale", model_dir, "--workflow", "debate", "--sharing", "isolated", "--task", "math",
                "--data", "toy_math", "--steps", "2", "--problems-per-step", "2", "--group-size", "2",
                "--max-new-tokens", "6", "--max-prompt-tokens", "240", "--eval-problems", "3", "--eval-every", "1",
                "--lora-rank", "2", "--lr", "1e-2", "--warmup-steps", "1", "--device", "cpu", "--quiet",
                "--out", str(out)])
    with open(out / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(set(m["roles"]) == set(m["adapters"]) == {"generator", "judge"} for m in metrics)
    assert set(metrics[0]["slots"]) == {"generator0", "generator1", "judge"}
    s = ev.analyse([str(out)], plots=False)[0]
    assert s["workflow"] == "debate" and s["base_acc"] is not None


# ----------------------------------------------------------------------------- the toy world

def test_a_toy_role_with_no_warm_start_transcript_is_refused_in_one_line(debate, tmp_path, capsys):
    line = refused(capsys, ["--workflow", "debate", "--out", str(tmp_path / "r")])   # --scale toy
    assert "--workflow debate: the toy world's warm start has no transcript of role 'judge'" in line
    with pytest.raises(SystemExit) as e:
        ev.main(["--workflow", "debate", "--scale", "toy", "--quiet"])
    assert "no transcript of role 'judge'" in str(e.value.code) and "\n" not in str(e.value.code)
