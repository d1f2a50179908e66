"""Save a random-weight Qwen3 at a published shape, with the toy tokenizer, as a model folder.

    python bench/random_model.py --config 0.6b --out qwen3-0.6b-random
    python train.py --scale qwen3-0.6b-random --data toy_math ...

Speed and memory do not depend on the weights, so this measures the real-scale training step
without downloading anything (no machine here can). The toy tokenizer (a few hundred ids)
renders the prompts; the model keeps Qwen3's 151,936-entry vocabulary, so the logits, the
sampler and the update cost what they cost at that scale. A random model almost never emits a
stop id, so every completion runs to --max-new-tokens: the worst case of the lengths.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shapes import CONFIGS  # noqa: E402  (bench/shapes.py: the published shapes)

import toy  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="0.6b", choices=sorted(CONFIGS), help="model shape (default: %(default)s)")
    ap.add_argument("--out", required=True, help="folder to write")
    ap.add_argument("--device", default="cpu", help="where to build it (a GPU builds the 0.6B in seconds)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="saved dtype (default: %(default)s)")
    args = ap.parse_args()
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tok = toy.build_tokenizer()
    stops = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen3Config(**CONFIGS[args.config], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=stops, pad_token_id=stops[1])
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, args.dtype))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = stops, stops[1]
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"{args.out}: Qwen3 {args.config} shape, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
