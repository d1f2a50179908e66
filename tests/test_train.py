"""train.py end to end on a tiny random model with the toy tokenizer: every workflow x sharing
mode x toy task for 2 steps, Ctrl-C + --resume equal to an uninterrupted run, and bad input
that must end in one clear line and a non-zero exit."""
import json
import os
import signal

import pytest
import torch

import eval as ev
import grpo
import runfolder
import toy
import train
import workflows


def argv(model_dir, out, *extra, task="math", steps=2):
    return ["--scale", model_dir, "--task", task, "--data", f"toy_{task}", "--steps", str(steps),
            "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "120",
            "--eval-problems", "3", "--eval-every", "1", "--save-every", "1", "--samples-every", "1",
            "--lora-rank", "2", "--lr", "1e-2", "--warmup-steps", "1", "--device", "cpu", "--quiet",
            "--out", str(out), *extra]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("task", ["math", "code"])
@pytest.mark.parametrize("sharing", ["shared", "isolated"])
@pytest.mark.parametrize("workflow", ["single", "voting", "eval_opt", "orch_workers"])
def test_two_steps_write_a_well_formed_run(model_dir, tmp_path, workflow, sharing, task):
    out = tmp_path / "run"
    train.main(argv(model_dir, out, "--workflow", workflow, "--sharing", sharing, task=task))
    roles = set(workflows.ROLES[workflow])

    config = json.load(open(out / "config.json"))
    assert (config["workflow"], config["sharing"], config["task"], config["steps"]) == (workflow, sharing, task, 2)

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0.0 <= m["reward"] <= 1.0
        assert set(m["roles"]) <= roles and "generator" in m["roles"] or "orchestrator" in m["roles"]
        for r, q in m["roles"].items():
            assert q["n"] > 0 and q["len"] > 0 and q["grad_norm"] >= 0 and 0 <= q["fallback_rate"] <= 1
        n_adapters = 1 if sharing == "shared" else len(roles)
        assert len(m["adapters"]) == n_adapters
        assert m["time"]["step"] > 0 and m["tokens_per_s"] > 0

    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2]
    for e in evals:
        assert e["n"] == 3 and 0.0 <= e["acc"] <= 1.0
        assert set(e["parse_fail"]) <= roles and set(e["len"]) == set(e["parse_fail"])

    samples = read_jsonl(out / "samples.jsonl")
    assert {s["step"] for s in samples} == {1, 2}
    assert {s["role"] for s in samples} <= roles
    assert all(isinstance(s["prompt"], str) and isinstance(s["completion"], str) for s in samples)

    for ck in ("ckpt-last", "ckpt-best"):
        names = os.listdir(out / ck)
        assert "state.pt" in names
        assert len([n for n in names if os.path.isdir(out / ck / n)]) == n_adapters
    assert torch.load(out / "ckpt-last" / "state.pt", weights_only=False)["step"] == 2
    assert (out / "done").exists()


def test_config_records_the_code_libraries_and_model_weights_the_run_came_from(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(argv(model_dir, out, steps=1))
    p = json.load(open(out / "config.json"))["provenance"]
    assert p["torch"] == torch.__version__ and p["python"].count(".") == 2
    assert p["model_sha256"] == runfolder.file_sha256(os.path.join(model_dir, "model.safetensors"))
    head = runfolder._git("rev-parse", "HEAD")   # None where the tests run outside a git checkout
    assert p["commit"] == head and (p["dirty"] is None) == (head is None)
    # a resume with another model (here: a changed provenance) keeps the first and appends, saying so
    cfg = json.load(open(out / "config.json"))
    cfg["provenance"]["model_sha256"] = "0" * 64
    json.dump(cfg, open(out / "config.json", "w"))
    capsys.readouterr()
    train.main(["--resume", str(out), "--steps", "2"])
    cfg = json.load(open(out / "config.json"))
    assert cfg["provenance"]["model_sha256"] == "0" * 64 and cfg["provenance_resumed"][0] == p
    assert "resuming with other code or another model" in capsys.readouterr().err
    assert not any(n.endswith(".tmp") for n in os.listdir(out))


def comparable(records):
    """Drop wall-clock fields: everything else must match exactly."""
    for r in records:
        r.pop("time", None)
        r.pop("tokens_per_s", None)
    return records


def interrupt_in_update(monkeypatch, at):
    """Send this process a SIGINT (a Ctrl-C) during the `at`-th call of grpo.update; return the
    list of calls made."""
    real_update, calls = grpo.update, []

    def update_then_interrupt(*a, **k):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGINT)
        return real_update(*a, **k)
    monkeypatch.setattr(grpo, "update", update_then_interrupt)
    return calls


def test_ctrl_c_then_resume_equals_an_uninterrupted_run(model_dir, tmp_path, monkeypatch):
    flags = ["--workflow", "voting", "--sharing", "isolated", "--save-every", "3", "--eval-every", "2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    train.main(argv(model_dir, full, *flags, steps=4))

    # Ctrl-C arrives during step 2: that step finishes, is checkpointed, and the run exits 130
    real_update, calls = grpo.update, interrupt_in_update(monkeypatch, at=2)
    with pytest.raises(SystemExit) as stopped:
        train.main(argv(model_dir, cut, *flags, steps=4))
    assert stopped.value.code == 130
    assert len(calls) == 2 and not (cut / "done").exists()
    assert [m["step"] for m in read_jsonl(cut / "metrics.jsonl")] == [1, 2]
    monkeypatch.setattr(grpo, "update", real_update)

    train.main(["--resume", str(cut), "--quiet"])
    assert (cut / "done").exists()
    for name in ("metrics", "eval"):
        assert comparable(read_jsonl(cut / f"{name}.jsonl")) == comparable(read_jsonl(full / f"{name}.jsonl")), name
    for a, b in [(full / "ckpt-last", cut / "ckpt-last")]:
        sa, sb = torch.load(a / "state.pt", weights_only=False), torch.load(b / "state.pt", weights_only=False)
        assert sa["step"] == sb["step"] == 4
        assert all(torch.equal(x, y) for x, y in zip(_adapter(a, "generator").values(), _adapter(b, "generator").values()))


def test_a_run_in_a_kv_budget_of_three_rows_equals_one_with_every_row_in_flight(model_dir, tmp_path, monkeypatch):
    # a row's draws are keyed by (seed, step, problem, rollout, call, position), so the cache
    # rows a small budget gives change nothing: the longest call fits 3 rows at a time
    import engine
    real, calls = engine._row_count, []

    def row_count(rows, need, bytes_per_token, kv_budget, max_rows):
        calls.append((rows, need, real(rows, need, bytes_per_token, kv_budget, max_rows)))
        return calls[-1][2]
    monkeypatch.setattr(engine, "_row_count", row_count)
    flags = ["--workflow", "voting", "--sharing", "isolated", "--samples-every", "1"]
    train.main(argv(model_dir, tmp_path / "all", *flags, steps=2))
    need = max(n for _, n, _ in calls)
    calls.clear()
    three = 3 * need * 256 / 2**30        # the tiny model's KV: 2 layers x K and V x 2 heads x 8 x 4 B
    train.main(argv(model_dir, tmp_path / "three", *flags, "--kv-budget-gb", repr(three), steps=2))
    assert any(rows > held == 3 for rows, _, held in calls)   # rows waited for a cache row
    for name in ("metrics", "eval", "samples"):
        assert comparable(read_jsonl(tmp_path / "three" / f"{name}.jsonl")) == \
            comparable(read_jsonl(tmp_path / "all" / f"{name}.jsonl")), name


# ----------------------------------------------------------------------------- bad input

def run_failing(capsys, args):
    with pytest.raises(SystemExit) as e:
        train.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code != 0
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_unknown_flag_values_are_refused(capsys, tmp_path, model_dir):
    assert "invalid choice" in run_failing(capsys, ["--workflow", "no-such-workflow-xyz"])
    assert "invalid choice" in run_failing(capsys, ["--sharing", "half"])
    assert "--group-size must be at least 1" in run_failing(capsys, argv(model_dir, tmp_path / "r", "--group-size", "0"))
    assert "ROLE=VALUE" in run_failing(capsys, argv(model_dir, tmp_path / "r", "--kl-coef-role", "generator=lots"))
    assert "not a role" in run_failing(capsys, argv(model_dir, tmp_path / "r", "--kl-coef-role", "critic=0.1"))


def test_a_scale_that_is_not_a_model_folder(capsys, tmp_path):
    line = run_failing(capsys, ["--scale", str(tmp_path), "--out", str(tmp_path / "r")])
    assert "not a model folder" in line
    line = run_failing(capsys, ["--scale", str(tmp_path / "missing"), "--out", str(tmp_path / "r")])
    assert "local model folder" in line


def test_a_hub_download_that_fails_offline_names_the_local_path_to_pass(capsys, tmp_path, monkeypatch):
    import transformers

    def offline(*a, **k):  # what from_pretrained raises when the hub cannot be reached
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cached files.")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    data = tmp_path / "local.jsonl"
    data.write_text('{"id": "a", "prompt": "1+1", "source": "x", "answer": "2"}\n')
    line = run_failing(capsys, ["--scale", "0.6b", "--data", str(data), "--out", str(tmp_path / "r"), "--device", "cpu",
                                "--steps", "2"])
    assert "Qwen/Qwen3-0.6B" in line and "--scale" in line and "local folder" in line


def test_a_task_file_with_bad_records(capsys, tmp_path, model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "1+1", "source": "x", "answer": "2"}\n{"id": "b", "prompt": 3}\n')
    line = run_failing(capsys, argv(model_dir, tmp_path / "r", "--data", str(bad)))
    assert "bad.jsonl" in line and "b" in line
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "prompt": "1+1", "source": "x", "answer": "2"}\nnot json\n')
    assert "broken.jsonl" in run_failing(capsys, argv(model_dir, tmp_path / "r", "--data", str(broken)))
    # a math file for a code run
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "a", "prompt": "1+1", "source": "x", "answer": "2"}\n')
    assert "math data set" in run_failing(capsys, argv(model_dir, tmp_path / "r", "--data", str(good), task="code"))


CODE_RECORD = '{"id": "%s", "prompt": "Write add(a, b).", "tests": {"kind": "assert", "test": "%s", "entry_point": "add"}}\n'
MATH_RECORD = '{"id": "%s", "prompt": "1+1", "answer": "2"}\n'


@pytest.mark.parametrize("case,text,task,expect", [
    ("a test that is not Python", CODE_RECORD % ("a", "assert add(2, 3) == "), "code", "not valid Python"),
    ("math and code in one file", MATH_RECORD % "m" + CODE_RECORD % ("c", "assert add(2, 3) == 5"), "math",
     "line 2 (id 'c') is a code record"),
    ("two problems with one id", MATH_RECORD % "p" + MATH_RECORD % "q" + MATH_RECORD % "p", "math",
     "id 'p' is also the id of line 1"),
])
def test_bad_data_is_refused_in_one_line_before_the_first_step(capsys, tmp_path, model_dir, case, text, task, expect):
    data = tmp_path / "data.jsonl"
    data.write_text(text)
    line = run_failing(capsys, argv(model_dir, tmp_path / "r", "--data", str(data), "--eval-data", str(data), task=task))
    assert expect in line and "data.jsonl" in line, case
    assert not (tmp_path / "r").exists()


def test_an_existing_run_folder_needs_resume(capsys, tmp_path, model_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    line = run_failing(capsys, argv(model_dir, out))
    assert "exists" in line and "--resume" in line
    line = run_failing(capsys, ["--resume", str(tmp_path / "nowhere")])
    assert "not a run folder" in line


def test_eval_cli_scores_a_trained_checkpoint(model_dir, tmp_path, capsys):
    import eval as ev
    out = tmp_path / "run"
    train.main(argv(model_dir, out, "--workflow", "voting", "--sharing", "isolated"))
    capsys.readouterr()
    ev.main(["--workflow", "voting", "--task", "math", "--scale", model_dir, "--checkpoint", str(out / "ckpt-last"),
             "--data", "toy_math", "--problems", "4", "--batch-size", "2", "--device", "cpu", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert res["problems"] == 4 and 0.0 <= res["pass@k"]["1"] <= 1.0
    assert set(res["quality"]["roles"]) == {"generator", "aggregator"}
    # the checkpoint's own length limit (6 new tokens) was used: no completion is longer
    assert res["quality"]["roles"]["generator"]["len_tokens"] <= 6
    assert res["cut"]["graded_cut"] <= res["episodes"] and set(res["cut"]["cut"]) <= {"generator", "aggregator"}
    ev.main(["--workflow", "voting", "--task", "math", "--scale", model_dir, "--checkpoint", str(out / "ckpt-last"),
             "--data", "toy_math", "--problems", "4", "--batch-size", "2", "--device", "cpu", "--quiet"])
    text = capsys.readouterr().out
    assert "cut at 6 tokens: " in text and "accuracy among the uncut" in text and "random_pick_acc" in text
    with pytest.raises(SystemExit, match="no such file"):
        ev.main(["--workflow", "single", "--task", "math", "--scale", model_dir, "--data", str(tmp_path / "x.jsonl")])


# ----------------------------------------------------------------------------- losing work

# the file operations of a save over an existing ckpt-last, in order (runfolder.save_checkpoint):
# state.pt in, old aside, new in, clear a leftover .old.del, old to .old.del, delete that
SAVE_OPS = 6


@pytest.mark.parametrize("op", range(SAVE_OPS + 1))
def test_a_kill_at_any_point_of_a_save_resumes_from_a_complete_checkpoint(model_dir, tmp_path, monkeypatch, capsys, op):
    flags = ["--workflow", "single", "--save-every", "2", "--eval-every", "0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    train.main(argv(model_dir, full, *flags, steps=3))
    real_replace, real_rmtree, calls = os.replace, runfolder.shutil.rmtree, []

    def crash_at(kind):
        def wrapped(*a, **k):
            if "ckpt-last" in " ".join(map(str, a)):
                calls.append(kind)
                # step 2's save makes 2 calls (state.pt in, new in); step 3's come after them
                if len(calls) == 2 + op + 1:
                    if kind == "rmtree" and os.path.isdir(a[0]):   # a kill halfway through a delete
                        os.remove(os.path.join(a[0], "state.pt"))
                    raise RuntimeError(f"killed at operation {op} of the save")
            return (real_replace if kind == "replace" else real_rmtree)(*a, **k)
        return wrapped
    monkeypatch.setattr(os, "replace", crash_at("replace"))
    monkeypatch.setattr(runfolder.shutil, "rmtree", crash_at("rmtree"))
    if op < SAVE_OPS:
        with pytest.raises(RuntimeError, match="killed at"):
            train.main(argv(model_dir, cut, *flags, steps=3))
    else:   # past the last operation: the save is whole
        train.main(argv(model_dir, cut, *flags, steps=3))
    monkeypatch.undo()
    assert [m["step"] for m in read_jsonl(cut / "metrics.jsonl")] == [1, 2, 3]
    capsys.readouterr()
    train.main(["--resume", str(cut), "--quiet"])
    assert "resumed" in capsys.readouterr().out
    assert (cut / "done").exists() and sorted(os.listdir(cut)) == sorted(os.listdir(full))
    assert torch.load(cut / "ckpt-last" / "state.pt", weights_only=False)["step"] == 3
    for name in ("metrics", "eval"):
        assert comparable(read_jsonl(cut / f"{name}.jsonl")) == comparable(read_jsonl(full / f"{name}.jsonl")), name


def test_a_torn_last_line_is_dropped_on_resume(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--workflow", "single", "--save-every", "1"]
    train.main(argv(model_dir, out, *flags, steps=2))
    os.remove(out / "done")
    with open(out / "metrics.jsonl", "a") as f:   # a kill in the middle of step 3's append
        f.write('{"step": 3, "reward": 0.5, "ro')
    capsys.readouterr()
    train.main(["--resume", str(out), "--steps", "3", "--quiet"])
    assert "dropped a torn line metrics.jsonl:3" in capsys.readouterr().err
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_ctrl_c_in_the_step_0_evaluation_leaves_a_clean_state(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ev, "eval_record", interrupted)
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out))
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert e.value.code == 130 and len(err) == 1 and "step-0 evaluation" in err[0]
    assert not out.exists()
    monkeypatch.undo()
    train.main(argv(model_dir, out, steps=1))   # the same command starts again
    assert (out / "done").exists()


# ----------------------------------------------------------------------------- seeds and best

def _adapter(folder, name="shared"):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, name, "adapter_model.safetensors"))


def test_a_fresh_toy_cache_and_a_cached_one_start_the_same_adapters(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(toy, "WARM", {**toy.WARM, "steps": 2, "batch": 4})
    flags = ["--scale", "toy", "--workflow", "single", "--steps", "1", "--problems-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2", "--lr", "0", "--lora-rank", "2",
             "--device", "cpu", "--quiet"]
    train.main(flags + ["--out", str(tmp_path / "fresh")])           # builds the toy model
    train.main(flags + ["--out", str(tmp_path / "cached")])          # loads it from the cache
    train.main(flags + ["--out", str(tmp_path / "seed1"), "--seed", "1"])
    a, b, c = (_adapter(tmp_path / n / "ckpt-last") for n in ("fresh", "cached", "seed1"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_best_counts_the_step_0_evaluation(model_dir, tmp_path, monkeypatch, capsys):
    accs = iter([0.5, 0.2, 0.1])
    real = ev.eval_record

    def fixed(*a, **k):
        rec = real(*a, **k)
        rec["acc"] = next(accs)
        return rec
    monkeypatch.setattr(ev, "eval_record", fixed)
    out = tmp_path / "run"
    train.main(argv(model_dir, out, "--workflow", "single"))
    assert torch.load(out / "ckpt-best" / "state.pt", weights_only=False)["step"] == 0
    assert "best eval 0.500" in capsys.readouterr().out


# ----------------------------------------------------------------------------- flags

def test_zero_means_never_for_samples_and_saves(model_dir, tmp_path):
    out = tmp_path / "run"
    train.main(argv(model_dir, out, "--workflow", "single", "--samples-every", "0", "--save-every", "0", steps=3))
    assert not (out / "samples.jsonl").exists()
    assert torch.load(out / "ckpt-last" / "state.pt", weights_only=False)["step"] == 3  # the final save


def test_resume_says_which_given_flags_are_ignored(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(argv(model_dir, out, "--workflow", "single", steps=1))
    capsys.readouterr()
    train.main(["--resume", str(out), "--lr", "5", "--steps", "2", "--workflow", "single", "--quiet",
                "--grad-checkpointing", "on"])   # a memory device, the same gradient: it may change
    err = capsys.readouterr().err
    ignored = [line for line in err.splitlines() if "ignored" in line]
    assert len(ignored) == 1 and "ignored: --lr 5.0 (saved 0.01)" in ignored[0]
    assert "--workflow" not in ignored[0] and "--steps" not in ignored[0] and "checkpointing" not in ignored[0]
    assert "--steps 2 (saved 1) changes the lr schedule" in err
    config = json.load(open(out / "config.json"))
    assert (config["lr"], config["grad_checkpointing"]) == (0.01, "on")
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_the_toy_model_refuses_real_data(capsys, tmp_path):
    line = run_failing(capsys, ["--scale", "toy", "--task", "code", "--data", "humaneval", "--out", str(tmp_path / "r")])
    assert "toy tasks" in line and "--scale" in line


def test_messages_name_the_fix(capsys, tmp_path, monkeypatch):
    line = run_failing(capsys, ["--scale", str(tmp_path / "missing"), "--out", str(tmp_path / "r")])
    assert "no such folder" in line
    import transformers

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co'")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    data = tmp_path / "local.jsonl"
    data.write_text('{"id": "a", "prompt": "1+1", "answer": "2"}\n')
    line = run_failing(capsys, ["--scale", "0.6b", "--data", str(data), "--out", str(tmp_path / "r"), "--device", "cpu",
                                "--steps", "2"])
    assert "hf download Qwen/Qwen3-0.6B" in line and "huggingface-cli" not in line



def coin_rewards(texts, problems, task, **kw):
    """A reward that depends only on the text (so a resumed run sees the same ones) and is 0
    or 1 about equally often, so a random tiny model gets non-zero advantages."""
    import hashlib
    return [float(hashlib.md5(t.encode()).digest()[0] % 2) for t in texts]


def test_coherence_damp_resumes_exactly(model_dir, tmp_path, monkeypatch):
    import taskkinds
    monkeypatch.setattr(taskkinds, "score", coin_rewards)
    flags = ["--workflow", "voting", "--sharing", "shared", "--save-every", "3", "--eval-every", "0",
             "--coherence-damp", "generator=0.5", "--coherence-damp", "aggregator=0.3", "--coherence-window", "2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    train.main(argv(model_dir, full, *flags, steps=4))
    real_update = grpo.update
    interrupt_in_update(monkeypatch, at=2)
    with pytest.raises(SystemExit):
        train.main(argv(model_dir, cut, *flags, steps=4))
    monkeypatch.setattr(grpo, "update", real_update)
    train.main(["--resume", str(cut), "--quiet"])
    metrics = comparable(read_jsonl(cut / "metrics.jsonl"))
    assert metrics == comparable(read_jsonl(full / "metrics.jsonl"))
    assert any("damp_scale" in m["roles"]["generator"] for m in metrics)
    assert "damp" in torch.load(cut / "ckpt-last" / "state.pt", weights_only=False)


def test_the_simple_sampler_runs_the_same_training_as_the_fast_one(model_dir, tmp_path, monkeypatch):
    """--sampler simple runs rollout.generate_simple, the plain sampler of the reading path;
    the draws are keyed by (seed, step, problem, rollout, call, position), so a run takes the
    same samples and the same steps as with the fast sampler."""
    import rollout
    calls = []
    real = rollout.generate_simple
    monkeypatch.setattr(rollout, "generate_simple", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs, used = {}, {}
    for sampler in ("fast", "simple"):
        out = tmp_path / sampler
        train.main(argv(model_dir, out, "--workflow", "voting", "--sampler", sampler))
        runs[sampler], used[sampler] = out, len(calls)
    assert used["fast"] == 0 and used["simple"] > 0          # each run took the sampler it asked for
    assert (runs["fast"] / "samples.jsonl").read_bytes() == (runs["simple"] / "samples.jsonl").read_bytes()
    assert (runs["fast"] / "eval.jsonl").read_bytes() == (runs["simple"] / "eval.jsonl").read_bytes()
    fast, simple = (read_jsonl(runs[s] / "metrics.jsonl") for s in ("fast", "simple"))
    for a, b in zip(fast, simple, strict=True):
        for rec in (a, b):
            rec.pop("time"), rec.pop("tokens_per_s")
        assert close(a, b), (a, b)


def close(a, b, path=""):
    """Equal records but for the sampler's own logprobs (logprob_gap and its kin), which two
    samplers round differently: those within 1e-5."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], f"{path}/{k}") for k in a)
    if isinstance(a, float) and "logprob_gap" in path.rsplit("/", 1)[-1]:
        return abs(a - b) <= 1e-5
    return a == b


def test_prompts_cut_at_the_limit_are_logged_per_role_and_said_once(model_dir, tmp_path, capsys):
    """A cut prompt keeps its end, so the role loses its instruction and problem first: every
    step logs the share per role, the evaluations the counts, and the first cut says so."""
    out = tmp_path / "run"
    train.main(argv(model_dir, out, "--workflow", "voting", "--max-prompt-tokens", "40"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "prompts cut at --max-prompt-tokens 40" in line]
    assert len(notes) == 1 and notes[0].startswith("note: step 1: ")
    assert "aggregator 100%" in notes[0] and "generator" not in notes[0]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["roles"]["aggregator"]["prompt_cut"] == 1.0 for m in metrics)
    assert all(e["prompt_cut"]["aggregator"] == e["calls"]["aggregator"] for e in read_jsonl(out / "eval.jsonl"))
    train.main(argv(model_dir, tmp_path / "whole", "--workflow", "voting", "--steps", "1"))
    assert "prompts cut" not in capsys.readouterr().err
    assert read_jsonl(tmp_path / "whole" / "metrics.jsonl")[0]["roles"]["aggregator"]["prompt_cut"] == 0.0
