"""Tests of eval.py and sweep.py on synthetic run folders and scripted episodes (no model).

    python -m pytest -q tests/test_eval.py
"""
import json
import math
import os
import subprocess
import sys
import types

import pytest

import eval as ev
import rewards
import workflows
from workflows import Call, Episode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- synthetic runs

def write_run(root, name, accs, eval_every=5, done=True, config=None, metrics=None, torn=False):
    """A run folder as train.py writes it: config.json, eval.jsonl (acc per evaluation at steps
    0, eval_every, ...), metrics.jsonl (given records or one plain record per step), done."""
    folder = os.path.join(root, name)
    os.makedirs(folder)
    steps = eval_every * (len(accs) - 1)
    cfg = {"workflow": "voting", "task": "math", "data": "math", "scale": "toy", "sharing": "isolated",
           "seed": 0, "steps": steps, "eval_every": eval_every}
    cfg.update(config or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"step": i * eval_every, "acc": a, "n": 100}) + "\n")
        if torn:  # a run killed while writing leaves half a line
            f.write('{"step": 99, "ac')
    if metrics is None:
        metrics = [{"step": s, "reward": 0.5} for s in range(1, steps + 1)]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
    if done:
        open(os.path.join(folder, "done"), "w").close()
    return folder


def test_rising_curve_is_not_a_cliff(tmp_path):
    run = write_run(tmp_path, "rise", [0.20, 0.30, 0.45, 0.50, 0.50, 0.49])
    s = ev.analyse_run(run)
    assert s["cliff"] is False
    assert s["base_acc"] == pytest.approx(0.20)
    assert (s["peak_acc"], s["peak_step"]) == (pytest.approx(0.50), 15)  # earliest step at the max
    assert s["final_acc"] == pytest.approx(0.49) and s["final_step"] == 25
    assert s["gain_final"] == pytest.approx(0.29) and s["gain_peak"] == pytest.approx(0.30)
    assert s["finished"] is True


def test_peak_then_fall_is_a_cliff(tmp_path):
    run = write_run(tmp_path, "fall", [0.20, 0.40, 0.60, 0.30, 0.20, 0.10])
    s = ev.analyse_run(run, cliff_drop=10, cliff_window=3)
    assert s["cliff"] is True
    assert (s["peak_acc"], s["peak_step"]) == (pytest.approx(0.60), 10)
    assert s["tail_mean"] == pytest.approx(0.20)
    assert s["gain_final"] == pytest.approx(-0.10) and s["gain_peak"] == pytest.approx(0.40)
    # the same curve is not a cliff under a threshold larger than its 40-point drop
    assert ev.analyse_run(run, cliff_drop=45, cliff_window=3)["cliff"] is False


def test_cliff_threshold_edges():
    evs = lambda accs: [{"step": 5 * i, "acc": a} for i, a in enumerate(accs)]  # noqa: E731
    # a drop of exactly the threshold counts (0.5 - 0.4 is 0.0999... in floating point)
    assert ev.accuracy_summary(evs([0.3, 0.5, 0.4, 0.4, 0.4]), 10, 3)["cliff"] is True
    assert ev.accuracy_summary(evs([0.3, 0.5, 0.41, 0.41, 0.41]), 10, 3)["cliff"] is False
    # a peak inside the last window is not a terminal cliff: the drop must come after the peak
    assert ev.accuracy_summary(evs([0.2, 0.3, 0.5, 0.9, 0.1]), 10, 3)["cliff"] is False
    # fewer evaluations than the window: never a cliff; no evaluations at all: empty summary
    assert ev.accuracy_summary(evs([0.9, 0.1]), 10, 3)["cliff"] is False
    empty = ev.accuracy_summary([], 10, 3)
    assert empty["peak_acc"] is None and empty["cliff"] is False
    # no step-0 evaluation: no base, so no gains, but peak and final still known
    s = ev.accuracy_summary([{"step": 5, "acc": 0.3}, {"step": 10, "acc": 0.4}], 10, 3)
    assert s["base_acc"] is None and s["gain_final"] is None and s["final_acc"] == pytest.approx(0.4)


def test_interrupted_run_is_unfinished(tmp_path):
    run = write_run(tmp_path, "cut", [0.2, 0.3, 0.35], done=False, torn=True, config={"steps": 500})
    s = ev.analyse_run(run)
    assert s["finished"] is False
    assert s["n_evals"] == 3 and s["final_step"] == 10  # the torn line is skipped
    row = ev.run_rows([s])[0]
    assert row[ev.RUN_HEADERS.index("status")] == "unfinished (10/500)"
    # resumed from a checkpoint: steps logged twice count once, the later record wins
    with open(os.path.join(run, "eval.jsonl"), "a") as f:
        f.write("\n" + json.dumps({"step": 5, "acc": 0.5}) + "\n" + json.dumps({"step": 10, "acc": 0.1}) + "\n")
    s = ev.analyse_run(run)
    assert s["n_evals"] == 3 and s["peak_acc"] == pytest.approx(0.5) and s["final_acc"] == pytest.approx(0.1)
    # a folder with nothing in it yet is tolerated too
    os.makedirs(tmp_path / "empty")
    e = ev.analyse_run(str(tmp_path / "empty"))
    assert e["finished"] is False and e["peak_acc"] is None and e["workflow"] is None
    assert ev.run_rows([e])[0][ev.RUN_HEADERS.index("base")] == "-"


def _metric(step, roles, dominant=None, **extra):
    rec = {"step": step, "reward": 0.5, "roles": roles}
    if dominant:
        rec["dominant_role"] = dominant
    rec.update(extra)
    return rec


def test_mechanisms_from_metrics():
    metrics = []
    for s in range(1, 21):
        agg_share = 0.8 if s > 5 else 0.3  # the aggregator takes over after step 5
        roles = {"generator": {"grad_norm": 0.1, "grad_share": 1 - agg_share, "len": 20.0},
                 "aggregator": {"grad_norm": 0.6, "grad_share": agg_share, "len": 10.0 if s <= 2 else 50.0}}
        extra = {"coherence": {"generator": 0.9}, "slot_cos": {"generator": {"a|b": 0.8, "a|c": 0.6, "b|c": 0.7}}}
        if s == 7:  # any key may be missing in a step
            roles["aggregator"].pop("grad_norm")
            extra = {}
        # steps 1-5 name the dominant role, later ones leave it to be derived from the shares
        metrics.append(_metric(s, roles, dominant="generator" if s <= 5 else None, **extra))
    evals = [{"step": 0, "acc": 0.2, "code_block_rate": {"evaluator": 0.0}},
             {"step": 10, "acc": 0.3, "code_block_rate": {"evaluator": 0.5}},
             {"step": 20, "acc": 0.3, "code_block_rate": {"evaluator": 0.9}}]
    m = ev.mechanisms(metrics, evals)
    assert m["grad_norm"] == {"generator": pytest.approx(0.1), "aggregator": pytest.approx(0.6)}
    assert m["grad_ratio_sup_gen"] == pytest.approx(6.0)
    assert m["grad_share"]["aggregator"] == pytest.approx((5 * 0.3 + 15 * 0.8) / 20)
    assert m["dominant_role"] == "aggregator"
    assert m["dominant_frac"] == pytest.approx(15 / 20) and m["dominant_streak"] == 15
    assert m["dominant_counts"] == {"aggregator": 15, "generator": 5}
    assert m["coherence"]["generator"] == pytest.approx(0.9)
    assert m["slot_cos"]["generator"] == pytest.approx(0.7)
    assert m["len_drift"]["aggregator"] == (pytest.approx(10.0), pytest.approx(50.0))  # tenths: 2 steps each
    assert m["code_block_drift"]["evaluator"] == (pytest.approx(0.0), pytest.approx(0.9))
    row = ev.mechanism_rows([{"name": "r", "mechanisms": m}])[0]
    assert m["dominant_last"] == "aggregator"
    assert "aggregator (0.75, 15); last aggregator" in row and "6.00" in row
    # no metrics at all: empty, not an error
    e = ev.mechanisms([], [])
    assert e["dominant_role"] is None and e["grad_ratio_sup_gen"] is None and e["grad_norm"] == {}


def _run_with_metrics(root, name, accs):
    metrics = [_metric(s, {"generator": {"grad_norm": 0.1 + 0.01 * s, "grad_share": 0.4, "len": 20.0 + s},
                           "aggregator": {"grad_norm": 0.5, "grad_share": 0.6, "len": 30.0}},
                       dominant="aggregator") for s in range(1, 5 * (len(accs) - 1) + 1)]
    folder = write_run(root, name, accs, metrics=metrics)
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"step": 5 * i, "acc": a, "code_block_rate": {"aggregator": 0.1 * i}}) + "\n")
    return folder


def test_plots_written_and_not_empty(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    run = _run_with_metrics(tmp_path, "fall", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1])
    paths = ev.plot_run(run)
    assert sorted(os.path.basename(p) for p in paths) == sorted(ev.PLOT_NAMES)
    for p in paths:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 2000
    # a run with evaluations but no gradient metrics gets only its accuracy plot
    bare = write_run(tmp_path, "bare", [0.2, 0.3], metrics=[])
    assert [os.path.basename(p) for p in ev.plot_run(bare)] == ["acc.png"]


def test_report_lists_every_run(tmp_path):
    runs = [_run_with_metrics(tmp_path, "voting-math-isolated-s0", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1]),
            write_run(tmp_path, "voting-math-shared-s0", [0.2, 0.3, 0.4], config={"sharing": "shared"}),
            write_run(tmp_path, "single-code-shared-s0", [0.1, 0.2], done=False,
                      config={"workflow": "single", "task": "code", "data": "code", "sharing": "shared"})]
    report = str(tmp_path / "out" / "report.md")
    summaries = ev.analyse(runs, report=report, quiet=True)
    text = open(report).read()
    for s in summaries:
        assert f"| {s['name']} |" in text
    assert "CLIFF" in text and "unfinished" in text
    assert "| voting | math | toy | isolated | 1 |" in text  # the per-cell table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    # plots are linked relative to the report's folder and the links resolve
    links = [line[line.index("](") + 2:-1] for line in text.splitlines() if line.startswith("![")]
    assert len(links) == 3 + 1 + 1
    assert all(os.path.isfile(os.path.join(tmp_path, "out", p)) for p in links)


def test_cli_analysis_json_and_help(tmp_path):
    run = write_run(tmp_path, "fall", [0.2, 0.4, 0.6, 0.3, 0.2, 0.1])
    out = subprocess.run([sys.executable, "eval.py", "--runs", run, "--json", "--no-plots", "--cliff-drop", "30"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cliff_drop"] == 30 and data["runs"][0]["cliff"] is True and data["runs"][0]["peak_step"] == 10
    h = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--cliff-drop" in h.stdout and "peak comes before" in " ".join(h.stdout.split())


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
    """Stand-in for rewards.score: 1 when the last box equals the gold answer."""
    return [float(rewards.last_boxed(t) == p["answer"]) for t, p in zip(texts, problems)]


@pytest.fixture
def parsers(monkeypatch):
    """rewards.score replaced by a box check (the real one may not exist yet, and runs code);
    the role-output parsers are workflows' own."""
    monkeypatch.setattr(rewards, "score", _score_by_box, raising=False)


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
    def run_episodes(llm, workflow, problems, group_size, task, **wf_params):
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

    def llm(role, slots, messages_list):
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
