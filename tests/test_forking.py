"""A fork's changes, each registered in this file alone: a task kind (taskkinds.register_task)
and a workflow with a parameter of its own (workflows.register). Everything that names task
kinds and workflows reads the registries, so these tests reach train.py's flags and --help,
sweep.py's cells and eval.py's flags in-process: the `registries` fixture undoes each
registration after its test. CPU, offline, no model: `python -m pytest -q tests/test_forking.py`."""
import json

import pytest

import eval as ev
import flags
import sweep
import taskkinds
import tasks
import train
import workflows
from conftest import refused
from test_workflows import FakeLLM

# ----------------------------------------------------------------------------- a task kind

SAY = "Say whether the number is odd or even, in one word."
PICK = "Read the answers and reply with the one word most likely right."


def parity_reward(text, problem):
    """1 when the whole text is the answer word: "odd" is right, "odd, I think" is not."""
    return float(text.strip().lower() == problem["answer"])


def check_parity(record):
    if record.get("answer") not in ("odd", "even"):
        raise ValueError(f"'answer' must be 'odd' or 'even', got {record.get('answer')!r}")


@pytest.fixture
def parity(registries):
    return taskkinds.register_task("parity", parity_reward, instructions={"generator": SAY}, default=PICK,
                                   check=check_parity, max_new_tokens=8, rounds=1)


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
    assert systems == {"generator": SAY, "aggregator": PICK}   # a role the kind does not name gets its default
    episodes = [workflows.Episode(problem=parity_problem(3, "odd"))]
    llm = FakeLLM(generator=["even", "odd"], evaluator="no \\boxed{Incorrect}")
    workflows.run_workflow("eval_opt", episodes, llm, "parity")          # the kind's rounds: 1
    assert [c.role for c in episodes[0].calls] == ["generator", "evaluator", "generator"]
    assert episodes[0].calls[-1].messages[0]["content"] == PICK        # the revision turn: the default
    assert {SAY, PICK} <= set(workflows.phrases())                     # new fixed strings (none of the toy world's)


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

JUDGE = "Pick the best of the numbered solutions. Reply with its number as \\boxed{k}."


def best_of_n(episodes, llm, task, n=2):
    """n generators answer, a judge picks one (\\boxed{k}); the pick is graded."""
    slots = [f"generator{i}" for i in range(n)]
    gens = workflows.stage(llm, "generator", slots * len(episodes),
                           [workflows.generator_messages(ep.problem, task) for ep in episodes for _ in slots],
                           [ep for ep in episodes for _ in slots])
    groups = [gens[i * n:(i + 1) * n] for i in range(len(episodes))]
    for ep, group in zip(episodes, groups):
        ep.calls += group
    msgs = [[{"role": "system", "content": workflows.instruction("judge", task)},
             {"role": "user", "content": "\n".join(c.text for c in group)}] for group in groups]
    for ep, group, judge in zip(episodes, groups, workflows.stage(llm, "judge", ["judge"] * len(episodes), msgs,
                                                                  episodes)):
        ep.calls.append(judge)
        k, _ = workflows.parse_choice(judge.text, n)
        ep.final_text = group[k - 1].text


@pytest.fixture
def best(registries):
    workflows.register("best_of_n", best_of_n, ("generator", "judge"),
                       lambda n=2: (*(f"generator{i}" for i in range(n)), "judge"), kinds={"judge": "supervisory"},
                       instructions={("judge", t): JUDGE for t in ("math", "code")},
                       params=(workflows.Param("n", int, 2, (2, 5), "candidates the judge picks from",
                                               flag="candidates"),))


def test_a_workflow_parameter_is_a_flag_of_train_py_and_eval_py(best, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    assert "best_of_n: candidates the judge picks from, 2-5 (default: 2)" in " ".join(capsys.readouterr().out.split())
    given = ["--workflow", "best_of_n", "--scale", "0.6b", "--out", str(tmp_path / "r")]
    assert flags.workflow_params(flags.parse_args([*given, "--candidates", "4"])) == {"n": 4}
    assert flags.workflow_params(flags.parse_args(given)) == {}       # unset: the function's default
    assert "--candidates must be in 2..5" in refused(capsys, [*given, "--candidates", "9"])
    line = refused(capsys, ["--workflow", "voting", "--candidates", "3", "--out", str(tmp_path / "r")])
    assert "--candidates is a setting of best_of_n; --workflow is voting" in line
    assert ev._parser().parse_args(["--workflow", "best_of_n", "--candidates", "3"]).candidates == 3


def test_a_workflow_parameter_sets_its_slots(best):
    episodes = [workflows.Episode(problem={"id": "m", "prompt": "1+1", "source": "x", "answer": "2"})]
    llm = FakeLLM(generator=["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"], judge="\\boxed{2}")
    workflows.run_workflow("best_of_n", episodes, llm, "math", n=4)
    assert [c.slot for c in episodes[0].calls] == [*(f"generator{i}" for i in range(4)), "judge"]
    assert episodes[0].final_text == "\\boxed{2}" and workflows.slots_of("best_of_n") == ("generator0", "generator1", "judge")


def test_a_workflow_parameter_is_a_sweep_axis_of_its_workflow_alone(best, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "best_of_n" in text and "candidates (best_of_n)" in text   # the choices and axes, from the registry
    out = tmp_path / "m"
    assert sweep.main(["--dry-run", "--workflows", "best_of_n", "single", "--tasks", "math", "--scale", "0.6b",
                       "--axis", "candidates=2,4", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "train.py" in line]
    names = [line.split("--out ")[1].split()[0].rsplit("/", 1)[1] for line in lines]
    assert sorted(names) == sorted(["best_of_n-math-shared-0.6b-candidates2-s0", "best_of_n-math-shared-0.6b-candidates4-s0",
                                    "best_of_n-math-isolated-0.6b-candidates2-s0",
                                    "best_of_n-math-isolated-0.6b-candidates4-s0", "single-math-shared-0.6b-s0"])
    assert all(("--candidates" in line) == ("best_of_n" in line) for line in lines)
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--workflows", "single", "--scale", "0.6b", "--axis", "candidates=3", "--out", str(out)])
    assert "--axis candidates: a parameter of best_of_n, which --workflows does not run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--workflows", "best_of_n", "--tasks", "math", "--scale", "0.6b",
                    "--axis", "candidates=7", "--out", str(out)])
    assert "train.py refuses its flags: --candidates must be in 2..5" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the toy world

def test_a_toy_role_with_no_warm_start_transcript_is_refused_in_one_line(best, tmp_path, capsys):
    line = refused(capsys, ["--workflow", "best_of_n", "--out", str(tmp_path / "r")])   # --scale toy
    assert "--workflow best_of_n: the toy world's warm start has no transcript of role 'judge'" in line
    with pytest.raises(SystemExit) as e:
        ev.main(["--workflow", "best_of_n", "--scale", "toy", "--quiet"])
    assert "no transcript of role 'judge'" in str(e.value.code) and "\n" not in str(e.value.code)
