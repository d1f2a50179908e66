"""Hand-written LoRA and the Shared / Isolated routing of roles to trainable weights."""
import json
import os

import pytest
import torch

import policies
from conftest import tiny_qwen3

IDS = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
ROLES = ("generator", "aggregator")


def randomise(policy, name, scale=0.1):
    with torch.no_grad():
        for p in policy.parameters_of(name):
            p.normal_(0, scale)


def test_fresh_adapter_leaves_base_unchanged():
    m = tiny_qwen3()
    base = m(IDS).logits
    pol = policies.Policy(m, None, ROLES, "isolated", rank=4, alpha=8)
    for name in pol.names:
        with pol.using(name) as mod:
            assert torch.equal(mod(IDS).logits, base)


def test_lora_targets_every_linear_but_the_head():
    m = tiny_qwen3()
    t = policies.lora_targets(m)
    assert len(t) == 7 * m.config.num_hidden_layers  # q k v o gate up down
    assert m.lm_head not in t.values()


def test_isolated_loss_on_one_role_reaches_only_its_adapter():
    m = tiny_qwen3()
    pol = policies.Policy(m, None, ROLES, "isolated", rank=4, alpha=8)
    for n in pol.names:
        randomise(pol, n)  # B != 0 so gradients reach A too
    with pol.using(pol.adapter("aggregator")) as mod:
        mod(IDS).logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pol.parameters_of("aggregator"))
    assert all(p.grad is None for p in pol.parameters_of("generator"))
    assert all(p.grad is None for p in m.parameters())  # the base never gets gradients


def test_shared_every_role_reaches_the_one_adapter():
    m = tiny_qwen3()
    pol = policies.Policy(m, None, ROLES, "shared", rank=4, alpha=8)
    assert pol.names == ["shared"] and {pol.adapter(r) for r in ROLES} == {"shared"}
    randomise(pol, "shared")
    for role in ROLES:
        for p in pol.parameters_of("shared"):
            p.grad = None
        with pol.using(pol.adapter(role)) as mod:
            mod(IDS).logits.square().mean().backward()
        assert all(p.grad is not None for p in pol.parameters_of("shared"))
    assert all(p.grad is None for p in m.parameters())


def test_save_load_roundtrip_in_peft_layout(tmp_path):
    from safetensors.torch import load_file
    m = tiny_qwen3()
    pol = policies.Policy(m, None, ROLES, "isolated", rank=4, alpha=8)
    randomise(pol, "generator")
    pol.save(str(tmp_path))
    cfg = json.load(open(tmp_path / "generator" / "adapter_config.json"))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    keys = load_file(str(tmp_path / "generator" / "adapter_model.safetensors")).keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    other = policies.Policy(tiny_qwen3(), None, ROLES, "isolated", rank=4, alpha=8)
    other.load_adapters(str(tmp_path))
    with torch.no_grad(), pol.using("generator") as a, other.using("generator") as b:
        assert torch.equal(a(IDS).logits, b(IDS).logits)


def test_merged_export_equals_base_plus_adapter(tmp_path):
    from transformers import AutoModelForCausalLM
    m = tiny_qwen3()
    pol = policies.Policy(m, None, ROLES, "shared", rank=4, alpha=8)
    randomise(pol, "shared")
    with torch.no_grad(), pol.using("shared") as mod:
        want = mod(IDS).logits
    pol.tokenizer = type("T", (), {"save_pretrained": lambda self, d: None})()
    pol.export_merged("shared", str(tmp_path))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.allclose(merged(IDS).logits, want, atol=1e-4)
        assert not torch.allclose(m(IDS).logits, want, atol=1e-3)  # the adapter did matter


def test_full_isolation_copies_train_and_base_stays_frozen():
    m = tiny_qwen3()
    pol = policies.Policy(m, None, ROLES, "isolated", isolation="full")
    with pol.using("aggregator") as mod:
        assert mod is not m
        mod(IDS).logits.square().mean().backward()
    assert all(p.grad is not None for p in pol.parameters_of("aggregator"))
    assert all(p.grad is None for p in pol.parameters_of("generator"))
    assert all(p.grad is None for p in m.parameters())


def test_unknown_role_and_bad_scale_raise_clear_errors(tmp_path):
    pol = policies.Policy(tiny_qwen3(), None, ROLES, "shared", rank=4, alpha=8)
    with pytest.raises(KeyError, match="unknown role"):
        pol.adapter("critic")
    with pytest.raises(ValueError, match="not a model folder"):
        policies.load(str(tmp_path))
    with pytest.raises(ValueError, match="expected toy"):
        policies.load("7b")


def test_load_local_folder_and_stop_ids(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    m = tiny_qwen3()
    m.save_pretrained(str(tmp_path))
    vocab = {f"t{i}": i for i in range(64)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token="t2", pad_token="t2")
    tok.save_pretrained(str(tmp_path))
    model, tk = policies.load(str(tmp_path))
    assert not any(p.requires_grad for p in model.parameters())
    assert policies.stop_ids(model, tk) == [1, 2]


def test_inference_folds_the_adapter_in_and_puts_the_base_back_exactly():
    from conftest import tiny_qwen3
    model = tiny_qwen3(seed=0)
    pol = policies.Policy(model, None, ("generator",), "shared", rank=4, alpha=8)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in pol.parameters_of("shared"):
            p.normal_(0, 0.1)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, 60, (3, 9))
    with torch.no_grad():
        with pol.using("shared") as m:
            hooked = m(input_ids=ids).logits
        with pol.inference("shared") as m:
            assert pol.lora.active is None                      # no hook runs: the weights hold it
            folded = m(input_ids=ids).logits
    assert float((folded - hooked).abs().max()) < 1e-4 and not torch.equal(folded, model(input_ids=ids).logits)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())   # the base as it was
    with pol.inference("shared") as m:                           # with grad enabled: the hooks, not a fold
        assert pol.lora.active == "shared"


def test_lora_in_bf16_is_two_matmuls_on_casts_kept_until_the_adapter_changes():
    from torch.utils._python_dispatch import TorchDispatchMode
    model = tiny_qwen3(seed=0).to(torch.bfloat16)
    pol = policies.Policy(model, None, ("generator",), "shared", rank=4, alpha=8)
    randomise(pol, "shared")
    lin = next(iter(pol.lora.targets.values()))
    x = torch.randn(3, lin.in_features, dtype=torch.bfloat16)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))
    with torch.no_grad(), pol.using("shared"):
        lin(x)                                                 # the first call makes the bf16 copies
        with Ops() as seen:
            out = lin(x)
        assert [o for o in seen.ops if o not in ("view", "t", "_unsafe_view")] == ["mm", "mm", "addmm_"]  # base, x A^T, += B^T
        with pol.using(None):
            base = lin(x)
    A, B = pol.lora.A["shared"][0], pol.lora.B["shared"][0]
    want = base.float() + pol.lora.scale * (x.float() @ A.t().bfloat16().float() @ B.t().bfloat16().float())
    assert torch.allclose(out.float(), want, atol=0.05, rtol=0.02)
    with torch.no_grad():                                      # an optimizer step changes the adapter in place
        B.add_(0.5)
        with pol.using("shared"):
            again = lin(x)
    with pol.using("shared"):                                  # with grad: casts of the fp32 parameters
        graded = lin(x)
        graded.float().square().sum().backward()
    assert torch.equal(again, graded.detach()) and not torch.equal(again, out)
    assert A.grad is not None and A.grad.dtype == torch.float32


def test_bf16_copies_follow_an_optimizer_step_that_moves_no_version_counter():
    # a fused AdamW writes the parameters without bumping their version counters; every
    # optimizer step of the process moves policies.STEPS instead, which the copies are keyed on
    model = tiny_qwen3(seed=0).to(torch.bfloat16)
    pol = policies.Policy(model, None, ("generator",), "shared", rank=4, alpha=8)
    randomise(pol, "shared")
    lin = next(iter(pol.lora.targets.values()))
    x = torch.randn(3, lin.in_features, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(pol.parameters_of("shared"), lr=0.0)
    B = pol.lora.B["shared"][0]

    def sampled():
        with torch.no_grad(), pol.using("shared"):
            return lin(x)
    before = sampled()
    version = B._version
    B.data.add_(0.5)                                   # as a fused step writes: no version bump
    assert B._version == version and torch.equal(sampled(), before)   # without a step, stale copies
    for p in pol.parameters_of("shared"):
        p.grad = torch.zeros_like(p)
    opt.step()                                         # lr 0: the step itself moves nothing
    with pol.using("shared"):
        want = lin(x).detach()                         # with grad: fresh casts of the parameters
    assert torch.equal(sampled(), want) and not torch.equal(want, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_count_matches_what_the_packed_forward_saves(monkeypatch, dtype):
    """policies.activation_bytes, which --grad-checkpointing auto reads, against the bytes autograd
    actually keeps for a training forward (LoRA on, packed rows; weights not counted); and the
    plan it decides."""
    import grpo
    import packed
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=300, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval().requires_grad_(False).to(dtype)
    pol = policies.Policy(model, None, ("g",), "shared", rank=8, alpha=16)
    weights = {p.data_ptr() for p in pol.parameters()}
    prompts, comps = [[5] * 100] * 4, [[7] * 50] * 4

    def held_bytes():   # what autograd keeps of the forward for its backward, weights left out
        kept = {}
        with pol.using("shared") as m, torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.setdefault(t.data_ptr(), t.untyped_storage().nbytes()) and t, lambda t: t):
            grpo.row_logprobs(m, prompts, comps, 0.7)
        return sum(v for k, v in kept.items() if k not in weights)
    tokens, size = sum(len(p) + len(c) - 1 for p, c in zip(prompts, comps)), torch.tensor([], dtype=dtype).element_size()
    count, held = policies.activation_bytes(cfg, tokens, size), held_bytes()
    assert 0.75 < count / held < 1.25
    if dtype == torch.float32:   # K/V with repeated heads (fp32 on CUDA) keep exactly what the count adds
        monkeypatch.setattr(packed, "gqa_kernel", lambda device, dtype: False)
        more = held_bytes() - held
        assert more == policies.activation_bytes(cfg, tokens, size, repeated_kv=True) - count > 0
    on, line = policies.checkpointing_plan(model, 16384)
    assert not on and "gradient checkpointing off (auto)" in line
    monkeypatch.setattr(policies, "ACTIVATION_SHARE", 1e-9)
    on, line = policies.checkpointing_plan(model, 16384)
    assert on and "gradient checkpointing on (auto)" in line and "more than" in line
