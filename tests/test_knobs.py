"""The knobs of the mechanisms' causes, each a train.py flag that sweep.py can put on an axis:
its effect on the workflow's topology or on the update, and its refusal of bad values."""
import json
import random

import pytest
import torch

import damping
import sweep
import toy
import train
from conftest import refused


def run(model_dir, out, *extra, steps=1):
    train.main(["--scale", model_dir, "--task", "math", "--data", "toy_math", "--steps", str(steps),
                "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "160",
                "--eval-problems", "2", "--eval-every", "0", "--lora-rank", "2", "--lr", "1e-2", "--warmup-steps", "1",
                "--device", "cpu", "--quiet", "--out", str(out), *extra])
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("n", [1, 5])
def test_n_voters_sets_the_same_role_agents_on_one_prompt(model_dir, tmp_path, monkeypatch, n):
    import taskkinds
    from test_train import coin_rewards
    monkeypatch.setattr(taskkinds, "score", coin_rewards)   # rewards that vary, so there are gradients
    m = run(model_dir, tmp_path / "r", "--workflow", "voting", "--sharing", "isolated", "--n-voters", str(n),
            "--group-size", "6")[0]
    assert set(m["slots"]) == {f"generator{k}" for k in range(n)} | {"aggregator"}
    assert m["roles"]["generator"]["n"] == n * m["roles"]["aggregator"]["n"] == n * 2 * 6
    assert ("coherence" in m) == (n > 1)   # one slot has nothing to align with


def test_eval_rounds_and_max_workers_bound_the_calls_of_an_episode(model_dir, tmp_path):
    m = run(model_dir, tmp_path / "e", "--workflow", "eval_opt", "--eval-rounds", "1")[0]
    assert m["roles"]["evaluator"]["n"] <= 4 and m["roles"]["generator"]["n"] <= 8   # 4 episodes, one round
    m = run(model_dir, tmp_path / "o", "--workflow", "orch_workers", "--max-workers", "1")[0]
    assert m["roles"]["worker"]["n"] == 4                                              # one worker an episode


@pytest.mark.parametrize("argv,message", [
    (["--n-voters", "0"], "--n-voters must be in 1..9"),
    (["--n-voters", "10"], "--n-voters must be in 1..9"),
    (["--workflow", "eval_opt", "--n-voters", "3"], "--n-voters is a setting of voting; --workflow is eval_opt"),
    (["--workflow", "eval_opt", "--eval-rounds", "-1"], "--eval-rounds must be in 0..9"),
    (["--workflow", "voting", "--max-workers", "2"], "--max-workers is a setting of orch_workers"),
    (["--toy-check", "-1"], "--toy-check must be in 0..64"),
    (["--toy-check", "40"], "raise it to at least 52"),
    (["--scale", "0.6b", "--toy-check", "8"], "--toy-check is a setting of the toy world"),
    (["--damp-placebo"], "--damp-placebo needs --coherence-damp"),
])
def test_bad_knob_values_are_refused_in_one_line(capsys, tmp_path, argv, message):
    assert message in refused(capsys, [*argv, "--out", str(tmp_path / "r")])


def test_a_supervisors_check_has_the_length_asked_and_keys_its_own_warm_start():
    problem = toy.problems("math", "train", 1)[0]
    for role in ("aggregator", "evaluator"):
        for length in (0, 8, 21):
            _, plain = toy.transcript(problem, "math", role, random.Random(5), 0)
            _, checked = toy.transcript(problem, "math", role, random.Random(5), length)
            verdict = plain[plain.index("\\boxed"):]
            assert checked.endswith(verdict) and len(checked) == len(plain) + length   # one token a character
    assert toy._key("math", {**toy.WARM, "check": 8}) != toy._key("math", toy.WARM)


def test_the_placebo_draws_damping_scales_with_no_coherence_signal():
    g = torch.tensor([1.0, -2.0, 0.5])
    real, placebo = damping.CoherenceDamp({"generator": 0.4}, 4), damping.PlaceboDamp({"generator": 0.4}, 4, seed=3)
    real_scales, applied = [], []
    for k in range(40):   # aligned for 20 steps, then reversed: cos -1, which damping answers with 1
        x = g if k < 20 else -g
        real_scales.append(real("generator", x.clone())[0])
        applied.append(placebo("generator", x.clone())[0])
    history = placebo.history["generator"]
    assert real_scales[:3] == pytest.approx([1.0, 0.6, 0.6]) and real_scales[20] == 1.0
    assert history[:3] == pytest.approx([1.0, 0.6, 0.6])         # what damping would apply ...
    assert all(s in history for s in applied)                     # ... is what the placebo applies, redrawn
    assert any(a != h for a, h in zip(applied, history))          # not at the step it belongs to
    restored = damping.PlaceboDamp({"generator": 0.4}, 4, seed=3)
    restored.load_state_dict(placebo.state_dict())
    assert restored.history == placebo.history and torch.equal(restored.ema["generator"], placebo.ema["generator"])
    assert restored("generator", g.clone()) == placebo("generator", g.clone())
    assert placebo("worker", g) == (1.0, None)


def test_a_placebo_run_logs_its_scales_and_resumes_exactly(model_dir, tmp_path, monkeypatch):
    import grpo
    from test_train import coin_rewards, comparable, interrupt_in_update

    import taskkinds
    monkeypatch.setattr(taskkinds, "score", coin_rewards)
    flags = ["--workflow", "voting", "--sharing", "shared", "--save-every", "2", "--coherence-damp", "generator=0.5",
             "--coherence-window", "2", "--damp-placebo"]
    full = comparable(run(model_dir, tmp_path / "full", *flags, steps=4))
    real = grpo.update
    interrupt_in_update(monkeypatch, at=3)
    with pytest.raises(SystemExit):
        run(model_dir, tmp_path / "cut", *flags, steps=4)
    monkeypatch.setattr(grpo, "update", real)
    train.main(["--resume", str(tmp_path / "cut"), "--quiet"])
    with open(tmp_path / "cut" / "metrics.jsonl") as f:
        assert comparable([json.loads(line) for line in f]) == full
    assert any("damp_scale" in m["roles"]["generator"] for m in full)


def test_an_axis_is_a_cell_a_value_named_by_flag_and_value(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sweep.main(["--dry-run", "--workflows", "voting", "--tasks", "math", "--sharings", "isolated",
                       "--axis", "n-voters=1,5", "--axis=--coherence-window=2", "--out", "m"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "train.py" in line]
    assert len(lines) == 2 and "-n-voters5-coherence-window2-s0" in lines[1] and "--n-voters 5" in lines[1]
    for bad, message in ((["--axis", "n-voters"], "expected FLAG=V1,V2"), (["--axis", "seed=1,2"], "none the sweep sets"),
                         (["--axis", "n-voters=1", "--", "--n-voters", "2"], "the sweep sets --n-voters")):
        with pytest.raises(SystemExit):
            sweep.main(["--dry-run", "--workflows", "voting", *bad])
        assert message in capsys.readouterr().err
