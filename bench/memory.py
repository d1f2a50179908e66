"""Activation memory of the training forward, with and without layer checkpointing.

    python bench/memory.py                          # Qwen3-4B width, 2 layers, 2,048 tokens, CPU
    python bench/memory.py --config 0.6b --tokens 4096

Builds a random Qwen3 at a published width with only `--layers` layers (the activations of a
layer do not depend on how many follow it), puts a LoRA adapter on it, and runs grpo's
training forward (row_logprobs with grad: the packed forward) over one micro-batch of `--tokens` tokens, once
plain and once with policies.checkpoint_layers. What the forward keeps for the backward is
counted exactly: every tensor autograd saves (torch.autograd.graph.saved_tensors_hooks, each
storage once, the weights' own storages left out), plus, when checkpointed, the inputs each checkpointed layer keeps to recompute
from. The figures are scaled to the model's full depth and to train.py's 16,384-token
micro-batch. The padded path's logits (tokens x vocabulary, model dtype, and their gradient)
are reported apart: the packed forward keeps none (its head runs chunk by chunk). The ratio > 1 is how many times less the checkpointed forward keeps.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the project: bench/rewards.py is not rewards
import grpo  # noqa: E402
import packed  # noqa: E402
import policies  # noqa: E402
from shapes import CONFIGS  # noqa: E402

DEPTH = {"0.6b": 28, "1.7b": 28, "4b": 36}


def kept_by_forward(policy, tokens, checkpointed):
    """Bytes of the tensors the training forward keeps for the backward, the weights left out:
    autograd saves a frozen weight to pass the gradient through its layer, but that storage is
    the model's own, held whatever the micro-batch, so it is no activation."""
    storages = {}
    weights = {(w.untyped_storage().data_ptr(), w.device) for w in policy.model.parameters()}
    weights |= {(w.untyped_storage().data_ptr(), w.device) for n in policy.names for w in policy.parameters_of(n)}

    def pack(t):
        st = t.untyped_storage()
        if (st.data_ptr(), t.device) not in weights:
            storages[(st.data_ptr(), t.device)] = st.nbytes()
        return t
    if checkpointed:  # count what each checkpointed layer keeps: its tensor inputs
        import torch.utils.checkpoint as tuc
        real = tuc.checkpoint

        def counting(fn, *a, **k):
            for x in [*a, *k.values()]:
                if isinstance(x, torch.Tensor):
                    pack(x)
            return real(fn, *a, **k)
        tuc.checkpoint = counting
        policies.checkpoint_layers(policy.model)
    prompt, completion = [[5] * 16], [[7] * (tokens - 16)]
    with policy.using("shared") as model, packed.attention(model), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _, _ = grpo.row_logprobs(model, prompt, completion, 1.0)
        lp.sum().backward()   # the backward recomputes layers: the adapter stays on
    return sum(storages.values())


def measure(args, checkpointed: bool) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = dict(CONFIGS[args.config], num_hidden_layers=args.layers, vocab_size=1024)  # logits reported apart
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg, tie_word_embeddings=True)).to(getattr(torch, args.dtype)).eval()
    return kept_by_forward(policies.Policy(model, None, ("generator",), "shared", rank=64, alpha=32),
                           args.tokens, checkpointed)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="4b", choices=sorted(DEPTH), help="model width (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="layers actually built (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="(default: %(default)s)")
    args = ap.parse_args()
    kept = {ckpt: measure(args, ckpt) for ckpt in (False, True)}
    size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per = {k: v / args.tokens / args.layers for k, v in kept.items()}  # bytes per token per layer
    full = {k: v * DEPTH[args.config] * 16384 / 2**30 for k, v in per.items()}
    logits = 16384 * CONFIGS[args.config]["vocab_size"] * size * 2 / 2**30
    print(f"Qwen3-{args.config} width, {args.dtype}, LoRA r64, {args.layers} layers x {args.tokens} tokens measured")
    for k, name in ((False, "every activation kept"), (True, "layers checkpointed")):
        print(f"  {name:22s}: {per[k] / 1024:8.1f} KiB per token per layer -> {full[k]:7.1f} GiB for a "
              f"16,384-token micro-batch of all {DEPTH[args.config]} layers")
    print(f"  (the padded path's logits and their gradient, either way: {logits:.1f} GiB; the packed forward keeps none)")
    print(f"ratio (kept / checkpointed): {kept[False] / max(kept[True], 1):.1f}x")


if __name__ == "__main__":
    main()
