"""tracking.py offline: flattening, a TensorBoard event file read back with TensorBoard's own
reader, a W&B offline run folder (config, numbers, the id reused on resume), and the one-line
error when a package is missing."""
import glob
import json
import os
import struct
import sys

import pytest

import tracking

CONFIG = {"workflow": "voting", "lr": 1e-3, "steps": 2, "kl_coef_role": {}, "quiet": True, "data": None}
STEP1 = {"step": 1, "reward": 0.25, "lr": 1e-3, "roles": {"generator": {"grad_norm": 0.5, "n": 6},
                                                          "aggregator": {"grad_norm": 3.0, "n": 2}},
         "time": {"rollout": 1.5}, "truncated": True}
STEP2 = {"step": 2, "reward": 0.75, "lr": 5e-4, "roles": {"generator": {"grad_norm": 0.25, "n": 6},
                                                          "aggregator": {"grad_norm": 2.0, "n": 2}},
         "time": {"rollout": 1.25}, "truncated": False}
EVAL = {"step": 2, "acc": 0.5, "n": 4, "len": {"generator": 12.5, "aggregator": None}}


def expected(record, prefix=""):
    return tracking.flatten({k: v for k, v in record.items() if k != "step"}, prefix)


def test_flatten_keeps_numbers_under_slash_names():
    assert tracking.flatten(STEP1) == {"step": 1, "reward": 0.25, "lr": 1e-3, "roles/generator/grad_norm": 0.5,
                                       "roles/generator/n": 6, "roles/aggregator/grad_norm": 3.0,
                                       "roles/aggregator/n": 2, "time/rollout": 1.5, "truncated": 1}
    assert tracking.flatten({"acc": 0.5, "len": {"generator": 3, "x": None}, "note": "text", "ids": [1, 2]},
                            "eval") == {"eval/acc": 0.5, "eval/len/generator": 3}


def test_tensorboard_event_file_holds_the_logged_numbers(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a test requirement (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = str(tmp_path / "run")
    tr = tracking.open_tracker("tensorboard", run, CONFIG)
    tr.log(STEP1, 1)
    tr.log({**STEP2, "reward": 9.0}, 2)  # a step logged after the last checkpoint, then a stop
    tr.close()
    tr = tracking.open_tracker("tensorboard", run, CONFIG, resume_step=1)  # --resume from step 1
    tr.log(STEP2, 2)
    tr.log(EVAL, 2, prefix="eval")
    tr.close()

    acc = EventAccumulator(os.path.join(run, "tb"))
    acc.Reload()
    want = {}
    for step, record, prefix in [(1, STEP1, ""), (2, STEP2, ""), (2, EVAL, "eval")]:
        for name, value in expected(record, prefix).items():
            want.setdefault(name, []).append((step, value))
    assert set(acc.Tags()["scalars"]) == set(want)
    for name, points in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(name)]  # the step-2 reward 9.0 is purged
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], name
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n")) == CONFIG


def test_tensorboard_resume_without_a_checkpoint_starts_over(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a test requirement (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = str(tmp_path / "run")
    tr = tracking.open_tracker("tensorboard", run, CONFIG)
    tr.log({**EVAL, "acc": 0.0}, 0, prefix="eval")
    tr.log(STEP1, 1)
    tr.close()
    tr = tracking.open_tracker("tensorboard", run, CONFIG, resume_step=0)  # stopped before step 1's checkpoint
    tr.log({**EVAL, "acc": 0.0}, 0, prefix="eval")
    tr.close()
    acc = EventAccumulator(os.path.join(run, "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/acc")] == [(0, 0.0)]
    assert acc.Scalars("reward") == []  # the tag stays listed, its points are gone


def wandb_records(path):
    """Records of a .wandb file: W&B's log format (7-byte header, 32 KiB blocks of chunks with a
    7-byte crc/length/type header each), every record one wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            records.append(pb.Record.FromString(buf))
            buf = b""
    return records


def wandb_history(records):
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in r.history.item}
            rows[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_wandb_offline_run_folder_and_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is a test requirement (pip install wandb)")
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_CONFIG_DIR": tmp_path / "config", "WANDB_CACHE_DIR": tmp_path / "cache",
                       "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(var, str(value))
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    tr = tracking.open_tracker("wandb", str(run), CONFIG)
    tr.log(STEP1, 1)
    tr.close()
    run_id = (run / "wandb_id").read_text().strip()
    first = glob.glob(str(run / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(first) == 1  # W&B's files went into the run folder

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # and where $WANDB_DIR says
    tr = tracking.open_tracker("wandb", str(run), CONFIG, resume_step=1)
    tr.log(STEP2, 2)
    tr.log(EVAL, 2, prefix="eval")
    tr.close()
    assert (run / "wandb_id").read_text().strip() == run_id
    second = glob.glob(str(tmp_path / "elsewhere" / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(second) == 1

    for path, rows in [(first[0], {1: expected(STEP1)}), (second[0], {2: {**expected(STEP2), **expected(EVAL, "eval")}})]:
        records = wandb_records(path)
        (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert info.run_id == run_id and info.project == "marl-workflows" and info.display_name == "run"
        config = {u.key: json.loads(u.value_json) for u in info.config.update if u.key != "_wandb"}
        assert config == CONFIG
        assert wandb_history(records) == rows


@pytest.mark.parametrize("kind,module", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")])
def test_missing_package_is_one_clear_line(tmp_path, monkeypatch, kind, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(RuntimeError, match=f"^--log-to {kind} needs the {kind} package: pip install {kind}$"):
        tracking.open_tracker(kind, str(tmp_path), CONFIG)
    tracking.open_tracker("none", str(tmp_path), CONFIG).log(STEP1, 1)  # none needs neither
    with pytest.raises(ValueError, match="expected one of none, wandb, tensorboard"):
        tracking.open_tracker("mlflow", str(tmp_path), CONFIG)


def test_train_py_mirrors_its_metrics_to_tensorboard(tmp_path):
    """--log-to tensorboard through train.py: every metrics.jsonl and eval.jsonl number lands in
    RUN/tb, and a missing package is refused before anything loads."""
    pytest.importorskip("tensorboard")
    from conftest import save_tiny_toy_model
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import train
    model = save_tiny_toy_model(tmp_path / "model")
    out = tmp_path / "run"
    train.main(["--scale", model, "--data", "toy_math", "--workflow", "voting", "--steps", "2",
                "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2",
                "--lora-rank", "2", "--device", "cpu", "--quiet", "--log-to", "tensorboard", "--out", str(out)])
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward", "roles/generator/grad_norm", "roles/aggregator/len", "eval/acc"} <= tags
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [e.value for e in acc.Scalars("reward")] == pytest.approx([m["reward"] for m in metrics])


def test_a_tracker_that_cannot_start_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """W&B without an API key raises its own UsageError: train.py says so in one line and
    leaves nothing, so the same command runs once the key is set."""
    pytest.importorskip("wandb")
    import wandb
    from conftest import save_tiny_toy_model

    import train

    class UsageError(Exception):
        pass

    def no_key(*a, **k):
        raise UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
    monkeypatch.setattr(wandb, "init", no_key)
    model = save_tiny_toy_model(tmp_path / "model")
    out = tmp_path / "run"
    flags = ["--scale", model, "--data", "toy_math", "--workflow", "single", "--steps", "1", "--problems-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2", "--lora-rank", "2", "--device", "cpu",
             "--quiet", "--log-to", "wandb", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        train.main(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "W&B did not start (api_key not configured" in err[-1] and "WANDB_MODE=offline" in err[-1]
    assert not out.exists()
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train.main(flags)                                 # the same command now runs
    assert (out / "done").exists()
