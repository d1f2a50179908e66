"""Tokens per second of rollout.generate against model.generate, measured in one run.

    python bench/generate.py                       # small random Qwen3 on CPU
    python bench/generate.py --device cuda --config 0.6b --batch 64 --new 256

Both samplers get the same model, the same left-padded prompts, the same sampling settings
(temperature, top_p=1) and no early stop (the random model rarely emits a stop id; stop ids are
set to an id the prompts never hold, and `min_new_tokens` is not used, so both produce
batch x new tokens). The ratio > 1 means ours is faster. Each is run --repeats times after one
warm-up call and the best time is kept (these machines are shared and noisy).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402

CONFIGS = {  # published Qwen3 shapes (random weights: speed does not depend on them)
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS), help="model shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    ap.add_argument("--batch", type=int, default=32, help="prompts per batch")
    ap.add_argument("--prompt-len", type=int, default=32, help="longest prompt; others are shorter")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each, best kept")
    ap.add_argument("--group", type=int, default=1, help="rows per distinct prompt (prefix sharing)")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    cfg = Qwen3Config(**CONFIGS[args.config], tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(cfg).to(args.device, dtype).eval()
    V = cfg.vocab_size
    stop = V - 1  # an id the prompts never hold; the random model almost never samples it
    g = torch.Generator().manual_seed(0)
    n_distinct = max(1, args.batch // args.group)
    distinct = [torch.randint(3, V - 2, (args.prompt_len - (i % 8),), generator=g).tolist() for i in range(n_distinct)]
    prompts = [distinct[i // args.group] for i in range(args.batch)]
    ids, mask = rollout.left_pad(prompts, 0, args.device)

    def ours():
        gen = torch.Generator(args.device).manual_seed(1)
        out = rollout.generate(model, prompts, args.new, stop_ids=[stop], pad_id=0,
                               temperature=args.temperature, generator=gen)
        return int(out.mask.sum())

    def theirs():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                             top_p=1.0, top_k=0, max_new_tokens=args.new, min_new_tokens=args.new,
                             eos_token_id=stop, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * args.batch

    def timed(fn):
        fn()  # warm-up
        best, n = float("inf"), 0
        for _ in range(args.repeats):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return n / best

    torch.set_grad_enabled(False)
    hf, us = timed(theirs), timed(ours)
    print(f"config={args.config} device={args.device} batch={args.batch} group={args.group} "
          f"prompt<={args.prompt_len} new={args.new}")
    print(f"model.generate    {hf:10.0f} tok/s")
    print(f"rollout.generate  {us:10.0f} tok/s")
    print(f"ratio (ours / hf) {us / hf:10.2f}x")


if __name__ == "__main__":
    main()
