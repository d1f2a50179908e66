"""The run folder under kills and resumes: which checkpoint a resume takes, logs truncated
without loss, and a finished run that goes on loses its `done` at once."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import runfolder
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def argv(model_dir, out, *extra, steps=2):
    return ["--scale", model_dir, "--task", "math", "--data", "toy_math", "--steps", str(steps),
            "--workflow", "single", "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
            "--max-prompt-tokens", "120", "--eval-problems", "3", "--eval-every", "1", "--save-every", "1",
            "--lora-rank", "2", "--lr", "1e-2", "--warmup-steps", "1", "--device", "cpu", "--quiet",
            "--out", str(out), *extra]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def set_step(folder, step, best=None):
    st = torch.load(folder / "state.pt", weights_only=False)
    st["step"] = step
    if best is not None:
        st["best"] = best
    torch.save(st, folder / "state.pt")


def test_a_kill_inside_a_ckpt_best_publish_leaves_every_later_resume_working(model_dir, tmp_path, capsys):
    # a first run saved bests at steps 3 and 4 and was killed with ckpt-last at step 2; its
    # resume saved ckpt-best again at step 3 over the step-4 folder and was killed inside the
    # delete of ckpt-best.old, before that folder's state.pt was gone
    out = tmp_path / "run"
    train.main(argv(model_dir, out, steps=2))
    os.remove(out / "done")
    for name, step in (("ckpt-best", 3), ("ckpt-best.old", 4)):
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(out / "ckpt-last", out / name)
        set_step(out / name, step, best=2.0)   # better than any real evaluation
    os.remove(out / "ckpt-best.old" / "shared" / "adapter_model.safetensors")   # half deleted
    capsys.readouterr()
    train.main(["--resume", str(out), "--steps", "4", "--quiet"])
    said = capsys.readouterr().out
    assert "ckpt-best is of step 3, after step 2 the run resumes from: removed" in said
    assert not (out / "ckpt-best.old").exists() and (out / "done").exists()
    best = torch.load(out / "ckpt-best" / "state.pt", weights_only=False)
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2, 3, 4]
    # the best is re-derived from the replay, not taken from the abandoned folders
    assert best["best"] == max(e["acc"] for e in evals if e["step"] > 2) and best["step"] > 2
    train.main(["--resume", str(out), "--steps", "5", "--quiet"])   # and the next resume works too
    assert torch.load(out / "ckpt-last" / "state.pt", weights_only=False)["step"] == 5


def test_resume_takes_ckpt_last_by_completeness_not_by_the_highest_step(tmp_path):
    out = tmp_path
    for name, step in (("ckpt-last", 4), ("ckpt-last.old", 9)):
        os.makedirs(out / name / "a")
        (out / name / "a" / "w.bin").write_bytes(b"x" * 10)
        torch.save({"step": step, "files": {os.path.join("a", "w.bin"): 10}}, out / name / "state.pt")
    assert runfolder.find_checkpoint(str(out)) == (str(out / "ckpt-last"), 4)
    assert not (out / "ckpt-last.old").exists()
    # an incomplete ckpt-last (a file short) loses to a complete .tmp
    (out / "ckpt-last" / "a" / "w.bin").write_bytes(b"x" * 3)
    os.makedirs(out / "ckpt-last.tmp" / "a")
    (out / "ckpt-last.tmp" / "a" / "w.bin").write_bytes(b"y" * 5)
    torch.save({"step": 6, "files": {os.path.join("a", "w.bin"): 5}}, out / "ckpt-last.tmp" / "state.pt")
    assert runfolder.find_checkpoint(str(out)) == (str(out / "ckpt-last"), 6)
    assert sorted(os.listdir(out)) == ["ckpt-last"]


# truncate_jsonl in a child that SIGKILLs itself halfway through writing the kept lines
DIES_MID_WRITE = """
import builtins, os, signal, sys
import runfolder
real_open = builtins.open


class Dying:
    def __init__(self, f):
        self.f = f

    def writelines(self, lines):
        lines = list(lines)
        for i, line in enumerate(lines):
            self.f.write(line)
            if i == len(lines) // 2:
                self.f.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.f, name)


builtins.open = lambda path, mode="r", *a, **k: Dying(real_open(path, mode, *a, **k)) if "w" in mode else real_open(path, mode, *a, **k)
runfolder.truncate_jsonl(sys.argv[1], int(sys.argv[2]))
"""


def test_a_kill_while_resume_truncates_the_logs_loses_no_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s // 30, "call": s % 30}) + "\n" for s in range(30, 6030)]   # 200 steps
    path.write_text("".join(lines))
    r = subprocess.run([sys.executable, "-c", DIES_MID_WRITE, str(path), "150"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == -signal.SIGKILL
    assert path.read_text().splitlines(keepends=True) == lines   # every line is still there
    runfolder.truncate_jsonl(str(path), 150)                      # and the next resume truncates
    assert path.read_text().splitlines(keepends=True) == [x for x in lines if json.loads(x)["step"] <= 150]


def test_a_finished_run_that_goes_on_loses_its_done_at_once(model_dir, tmp_path, monkeypatch):
    import grpo
    out = tmp_path / "run"
    train.main(argv(model_dir, out, steps=2))
    assert (out / "done").exists()
    real, calls = grpo.update, []

    def update_then_interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)
    monkeypatch.setattr(grpo, "update", update_then_interrupt)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(out), "--steps", "4", "--quiet"])   # extended, stopped at step 3
    assert e.value.code == 130 and not (out / "done").exists()
    monkeypatch.undo()
    train.main(["--resume", str(out), "--steps", "4", "--quiet"])
    assert (out / "done").exists() and [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
