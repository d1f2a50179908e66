"""Wall time of Voting's generation stage against Single's, on the same problems and model.

    python bench/rollout.py                          # small random Qwen3 + toy tokenizer, CPU
    python bench/rollout.py --device cuda --config 0.6b --problems 64 --new 256

Single's stage is N problems x G rollouts = N*G generator calls; Voting's is the same problems
with 3 voters per rollout = 3*N*G calls. Both go through rollout.make_llm (one `generate` per
stage, identical prompts prefilled once and their cache replicated), so the question is how
much of the 3x more rows batching and prefix sharing absorb. Goal: Voting's stage under 2x
Single's. Also printed: whole episodes (Voting adds its aggregator stage, whose prompts hold
the three solutions) against Single's.

The random model almost never emits a stop id, so every row decodes --new tokens: the worst
case for the ratio (a trained model stops rows early, and finished rows cost little).
`--kv-mib` gives each generate call a KV budget, so a stage runs with continuous batching. Each
measurement is repeated --repeats times after a warm-up, best kept (shared, noisy machines).
"""
import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
import policies  # noqa: E402
import rollout  # noqa: E402
import toy  # noqa: E402
import workflows as wf  # noqa: E402
from bench.shapes import CONFIGS  # noqa: E402


def best_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS), help="model shape (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    ap.add_argument("--problems", type=int, default=16, help="problems per stage (N)")
    ap.add_argument("--group", type=int, default=8, help="rollouts per problem (G)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per call")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each, best kept")
    ap.add_argument("--kv-mib", type=float, default=None,
                    help="KV budget of each generate call in MiB (default: every row of a stage at once)")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    tok = toy.build_tokenizer()
    torch.manual_seed(0)
    shape = {**CONFIGS[args.config], "vocab_size": len(tok)}  # the toy vocabulary: prompts are real text
    model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True, rope_theta=1e6))
    if args.device.startswith("cuda"):   # as a run sets it (policies.load): cuda:N current, no cuDNN attention
        policies.cuda_settings(args.device)
    model = model.to(args.device, dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    policy = policies.Policy(model, tok, wf.ROLES["voting"], "shared", rank=8, alpha=16)
    problems = toy.problems("math", "test", args.problems)
    N, G = args.problems, args.group

    def llm():
        budget = None if args.kv_mib is None else int(args.kv_mib * 2**20)
        return rollout.make_llm(policy, sampler=functools.partial(engine.generate, kv_budget=budget),
                                temperature=0.7, max_new_tokens=args.new, seed=0)

    def single_stage():
        llm()("generator", ["generator"] * (N * G), [wf.generator_messages(p, "math") for p in problems for _ in range(G)],
              keys=[("single", i) for i in range(N * G)])

    def voting_stage():
        slots = [f"generator{k}" for k in range(3)]
        llm()("generator", slots * (N * G), [wf.generator_messages(p, "math") for p in problems for _ in range(3 * G)],
              keys=[("voting", i) for i in range(3 * N * G)])

    def episodes(workflow):
        return lambda: rollout.run_episodes(llm(), workflow, problems, G, "math")

    ts, tv = best_time(single_stage, args.repeats), best_time(voting_stage, args.repeats)
    es, ev = best_time(episodes("single"), args.repeats), best_time(episodes("voting"), args.repeats)
    budget = "every row at once" if args.kv_mib is None else f"{args.kv_mib:g} MiB"
    print(f"model {args.config} on {args.device}, N={N} problems x G={G}, {args.new} new tokens per call, "
          f"KV budget {budget}")
    print(f"generation stage: single {N * G:4d} rows {ts:6.2f} s | voting {3 * N * G:4d} rows {tv:6.2f} s "
          f"| voting / single = {tv / ts:.2f}x (goal < 2x)")
    print(f"whole episodes:   single {es:6.2f} s | voting (3 voters + aggregator) {ev:6.2f} s | ratio {ev / es:.2f}x")


if __name__ == "__main__":
    main()
