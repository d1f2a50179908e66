"""train.py's flags (flags.py): bad values refused in one line before anything loads, what 0
means, the defaults --help shows, and what --resume says it changes."""
import json
import os

import pytest
import torch

import flags
import train
from conftest import refused


@pytest.mark.parametrize("flag,value,message", [
    ("--lr", "-1", "--lr must be >= 0"),
    ("--lora-rank", "0", "--lora-rank must be at least 1"),
    ("--lora-alpha", "0", "--lora-alpha must be > 0"),
    ("--clip-low", "1.5", "--clip-low must be in [0, 1)"),
    ("--clip-high", "-0.1", "--clip-high >= 0"),
    ("--clip-c", "0.5", "--clip-c must be > 1"),
    ("--warmup-steps", "-1", "--warmup-steps must be >= 0"),
    ("--token-budget", "1", "--token-budget 1 holds no row at the length limits: at least 448"),
    ("--max-new-tokens", "0", "--max-new-tokens must be at least 1"),
    ("--mini-batch", "0", "--mini-batch must be at least 1"),
    ("--max-prompt-tokens", "-5", "--max-prompt-tokens must be >= 0"),
    ("--max-embed-tokens", "-1", "--max-embed-tokens must be >= 0"),
    ("--eval-problems", "-3", "--eval-problems must be >= 0"),
    ("--weight-decay", "-0.1", "--weight-decay must be >= 0"),
    ("--kl-coef-role", "generator=-1", "--kl-coef-role VALUE must be >= 0"),
    ("--device", "gpu", "--device gpu: expected cpu, cuda or cuda:N"),
    ("--lr-role", "generator=-1", "--lr-role VALUE must be >= 0"),
    ("--lr-role", "generator=fast", "--lr-role 'generator=fast': expected ROLE=VALUE with a number"),
    ("--lr-role", "critic=0", "--lr-role critic: not a role of voting"),
    ("--tis", "0.5", "--tis C needs C > 1 and --top-p 1"),
    ("--dtype", "float16", "--dtype float16: the update has no loss scaling"),
])
def test_values_that_cannot_be_meant_are_refused_in_one_line(capsys, tmp_path, flag, value, message):
    line = refused(capsys, [flag, value, "--out", str(tmp_path / "r")])
    assert message in line and line.endswith("(see python train.py --help)")
    assert not (tmp_path / "r").exists()


def test_lr_role_under_shared_is_refused_in_one_line(capsys, tmp_path):
    line = refused(capsys, ["--lr-role", "aggregator=0", "--out", str(tmp_path / "r")])   # shared is the default
    assert "--lr-role needs --sharing isolated" in line
    a = flags.parse_args(["--lr-role", "aggregator=0", "--sharing", "isolated", "--out", str(tmp_path / "r")])
    assert a.lr_role == {"aggregator": 0.0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_on_a_cpu_only_torch_is_one_line(capsys, tmp_path):
    assert "this torch has no CUDA device" in refused(capsys, ["--device", "cuda", "--out", str(tmp_path / "r")])


def test_a_cuda_index_the_machine_lacks_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(capsys, ["--device", "cuda:7", "--out", str(tmp_path / "r")])
    assert "--device cuda:7: this machine has 1 CUDA device(s), cuda:0 to cuda:0" in err


def test_full_copies_in_bfloat16_are_refused_in_one_line(capsys, tmp_path, monkeypatch):
    """A full copy trains its weights and AdamW states in the base's dtype: in bfloat16, the
    default on a GPU, most steps round away; a LoRA adapter keeps fp32 weights and states."""
    said = "--isolation full trains each copy and its AdamW states in the base's dtype"
    assert said in refused(capsys, ["--isolation", "full", "--dtype", "bfloat16", "--out", str(tmp_path / "r")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)        # the default device and dtype: cuda, bf16
    assert said in refused(capsys, ["--isolation", "full", "--out", str(tmp_path / "r")])
    assert flags.parse_args(["--isolation", "full", "--dtype", "float32", "--out", str(tmp_path / "r")]).dtype == "float32"
    assert flags.parse_args(["--dtype", "bfloat16", "--out", str(tmp_path / "r")]).isolation == "lora"
    assert not (tmp_path / "r").exists()


def test_tis_under_top_p_is_refused_in_one_line(capsys, tmp_path):
    """Under top-p the sampler's logprob is the nucleus's: the weight would be the mass kept, not a drift."""
    line = refused(capsys, ["--tis", "2", "--top-p", "0.9", "--out", str(tmp_path / "r")])
    assert "--top-p 1: under top-p the sampler's logprob is the nucleus's" in line and not (tmp_path / "r").exists()
    assert flags.hyper(flags.parse_args(["--tis", "2", "--out", str(tmp_path / "r")])).tis == 2.0


def test_zero_means_what_the_help_says(tmp_path):
    a = flags.parse_args(["--max-prompt-tokens", "0", "--max-embed-tokens", "0", "--eval-problems", "0",
                          "--out", str(tmp_path / "r")])
    assert (a.max_prompt_tokens, a.max_embed_tokens, a.eval_problems) == (None, None, 0)   # none, none, all
    d = flags.parse_args(["--out", str(tmp_path / "r")])
    assert (d.max_prompt_tokens, d.eval_problems, d.mini_batch) == (400, 512, 16 * 8)
    text = flags.build_parser().format_help()
    assert "0 for none" in text and "0 for all of the" in text and "0 for no" in text


def test_settings_that_fix_the_advantages_say_so_in_one_line(tmp_path, capsys):
    flags.parse_args(["--temperature", "0", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--temperature 0" in err and "every advantage is 0" in err
    flags.parse_args(["--group-size", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "every advantage is the raw reward (A = R)" in err
    flags.parse_args(["--out", str(tmp_path / "r")])
    assert capsys.readouterr().err == ""


def test_help_states_each_default_once():
    text = " ".join(flags.build_parser().format_help().split())
    assert "8 at --scale toy, 8 otherwise" not in text and "16384 at --scale toy, 16384" not in text
    assert "rollouts per problem (G) (default: 8)" in text
    assert "data set (toy_math, toy_code, arith, humaneval, gsm8k_test100, dapo_math, gsm8k, math500, mbpp, deepcoder)" in text


def test_full_isolation_has_its_own_default_lr(tmp_path):
    toy_lora = flags.parse_args(["--out", str(tmp_path / "a")])
    toy_full = flags.parse_args(["--isolation", "full", "--out", str(tmp_path / "b")])
    assert (toy_lora.lr, toy_full.lr) == (flags.LR["lora"][0], flags.LR["full"][0]) and toy_full.lr < toy_lora.lr
    assert f"{flags.LR['full'][0]:g} full" in flags.build_parser().format_help()


def test_resume_says_that_more_steps_change_the_schedule(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    os.makedirs(out)
    cfg = vars(flags.parse_args(["--scale", model_dir, "--data", "toy_math", "--steps", "2", "--out", str(out)]))
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f)
    capsys.readouterr()
    args = flags.parse_args(["--resume", str(out), "--steps", "5"])
    err = capsys.readouterr().err
    assert args.steps == 5 and "--steps 5 (saved 2) changes the lr schedule" in err
    flags.parse_args(["--resume", str(out)])
    assert "changes the lr schedule" not in capsys.readouterr().err


def test_resume_of_a_run_saved_before_a_flag_existed_takes_its_default(model_dir, tmp_path):
    out = tmp_path / "old-run"
    os.makedirs(out)
    cfg = vars(flags.parse_args(["--scale", model_dir, "--data", "toy_math", "--steps", "2", "--out", str(out)]))
    for k in ("n_voters", "toy_check", "damp_placebo"):   # flags a run folder of an older version lacks
        del cfg[k]
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f)
    args = flags.parse_args(["--resume", str(out)])
    assert args.n_voters is None and args.toy_check is None and args.damp_placebo is False
    assert flags.workflow_params(args) == {} and args.steps == 2


def test_a_run_saves_the_dtype_it_resolved_so_a_resume_elsewhere_keeps_it(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "r"
    train.main(["--scale", model_dir, "--data", "toy_math", "--workflow", "single", "--steps", "1",
                "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2",
                "--lora-rank", "2", "--device", "cpu", "--quiet", "--out", str(out)])
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"   # no --dtype: a CPU's default
    monkeypatch.setattr(flags, "_check_device", lambda ap, device: None)   # as if this machine had CUDA
    args = flags.parse_args(["--resume", str(out), "--device", "cuda"])
    assert (args.device, args.dtype) == ("cuda", "float32")   # not re-resolved to CUDA's bfloat16


def test_quiet_shows_no_progress_bar_of_any_library(model_dir, tmp_path, capfd):
    train.main(["--scale", model_dir, "--data", "toy_math", "--workflow", "single", "--steps", "1",
                "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2",
                "--lora-rank", "2", "--device", "cpu", "--quiet", "--out", str(tmp_path / "r")])
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err and "%|" not in err


def test_a_second_ctrl_c_aborts_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    import signal

    import grpo
    real = grpo.update

    def twice(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)   # the second raises KeyboardInterrupt at once
        return real(*a, **k)
    monkeypatch.setattr(grpo, "update", twice)
    with pytest.raises(SystemExit) as e:
        train.main(["--scale", model_dir, "--data", "toy_math", "--workflow", "single", "--steps", "2",
                    "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "2",
                    "--lora-rank", "2", "--device", "cpu", "--quiet", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "aborted: this step was not saved" in err and "Traceback" not in err
