"""peft loads what `Policy.save` writes, and transformers loads what `Policy.export_merged` writes.

The adapters are trained for a few AdamW steps first (B != 0), so the checks compare a real
delta, not a fresh adapter that leaves the base unchanged. fp32 throughout, tolerance 1e-5.
"""
import pytest
import torch

import policies
from conftest import tiny_qwen3

peft = pytest.importorskip("peft", reason="peft is a test requirement (pip install peft)")

ROLES = ("generator", "aggregator")
IDS = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]])  # (B, T), the second row left-padded
MASK = (IDS != 0).long()                                          # (B, T)
POS = (MASK.cumsum(-1) - 1).clamp(min=0)                          # (B, T), as the sampler passes them
TOL = 1e-5


@pytest.fixture
def base_dir(tmp_path):
    """A tiny random Qwen3 saved as a model folder, with a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    folder = tmp_path / "base"
    tiny_qwen3().save_pretrained(str(folder))
    vocab = {f"t{i}": i for i in range(64)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token="t2", pad_token="t2")
    tok.save_pretrained(str(folder))
    return str(folder)


def logits(module):
    with torch.no_grad():
        return module(IDS, attention_mask=MASK, position_ids=POS).logits  # (B, T, V)


def train_a_little(policy, name, seed, steps=3):
    """A few AdamW steps of next-token loss on random targets, so the adapter's B is non-zero."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 64, IDS.shape, generator=g)
    opt = torch.optim.AdamW(policy.parameters_of(name), lr=1e-2)
    for _ in range(steps):
        with policy.using(name) as m:
            out = m(IDS, attention_mask=MASK, position_ids=POS).logits
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(b.abs().max() > 0 for b in policy.lora.B[name])


def trained_policy(base_dir, sharing):
    model, tok = policies.load(base_dir)
    pol = policies.Policy(model, tok, ROLES, sharing, rank=4, alpha=8)
    for i, name in enumerate(pol.names):
        train_a_little(pol, name, seed=i)
    return pol


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_peft_loads_saved_adapters_with_the_same_logits(base_dir, tmp_path, sharing):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    pol = trained_policy(base_dir, sharing)
    pol.save(str(tmp_path / "ckpt"))
    base = logits(pol.model)

    # every adapter of the folder into one PeftModel, as multi-LoRA serving would hold them
    first, *rest = pol.names
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir).eval(),
                                                str(tmp_path / "ckpt" / first), adapter_name=first)
    for name in rest:
        peft_model.load_adapter(str(tmp_path / "ckpt" / name), adapter_name=name)
    peft_model.eval()
    for name in pol.names:
        # peft read every tensor we wrote, and expects no other (its own state-dict keys)
        saved = load_file(str(tmp_path / "ckpt" / name / "adapter_model.safetensors"))
        held = get_peft_model_state_dict(peft_model, adapter_name=name)
        assert set(held) == set(saved) and all(torch.equal(held[k], saved[k]) for k in saved)
        peft_model.set_adapter(name)
        with pol.using(name) as m:
            ours = logits(m)
        theirs = logits(peft_model)
        diff = (ours - theirs).abs().max().item()
        print(f"peft {sharing}/{name}: max |logit diff| {diff:.2e}, adapter effect {(ours - base).abs().max().item():.2e}")
        assert diff <= TOL
        assert (ours - base).abs().max() > 1e-2  # the adapter does change the output
    if sharing == "isolated":  # the roles' adapters really are different weights
        with pol.using("generator") as m:
            gen = logits(m)
        with pol.using("aggregator") as m:
            assert (logits(m) - gen).abs().max() > 1e-2


@pytest.mark.parametrize("sharing", ["shared", "isolated"])
def test_merged_export_loads_with_transformers_with_the_same_logits(base_dir, tmp_path, sharing):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    pol = trained_policy(base_dir, sharing)
    for name in pol.names:
        folder = str(tmp_path / f"merged-{name}")
        pol.export_merged(name, folder)
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with pol.using(name) as m:
            ours = logits(m)
        diff = (ours - logits(merged)).abs().max().item()
        print(f"merged {sharing}/{name}: max |logit diff| {diff:.2e} (max |logit| {ours.abs().max().item():.1f})")
        assert diff <= TOL
        assert AutoTokenizer.from_pretrained(folder).eos_token == "t2"  # the tokenizer travels with it
