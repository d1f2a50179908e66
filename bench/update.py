"""Wall time of one grpo.update with and without skipping the rows that cannot move the weights.

    python bench/update.py                         # toy-sized Qwen3, a Voting-shaped step, CPU
    python bench/update.py --config small --uniform 0.75 --sharing isolated

A Voting-shaped step: P problems x G episodes x (3 generator calls + 1 aggregator call), with
random prompt and completion ids of toy-like lengths. A fraction `--uniform` of the
(problem, slot) groups get one reward for every episode (all 0 or all 1), so their
advantage is exactly 0; the rest get mixed rewards. The same samples are updated twice from
the same weights, with skip_zero=False (every row runs forward and backward) and
skip_zero=True, each --repeats times; the best time of each is kept (machines are shared and
noisy), and the ratio > 1 means the skip is faster. The two updates' gradients agree to float
rounding (tests/test_grpo.py checks that).
"""
import argparse
import copy
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dynamics  # noqa: E402
import grpo  # noqa: E402
import policies  # noqa: E402

CONFIGS = {
    "toy": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=400),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, vocab_size=4096),
}


def voting_step(problems, group, uniform, rng, vocab, prompt_len=(40, 80), gen_len=(12, 24), agg_len=4):
    """Samples of one Voting step; a fraction `uniform` of the (problem, slot) groups has zero variance."""
    slots = ["generator0", "generator1", "generator2", "aggregator"]
    rewards = {}
    for p in range(problems):
        for s in slots:
            if rng.random() < uniform:
                v = float(rng.random() < 0.5)
                rewards[p, s] = [v] * group
            else:
                rewards[p, s] = [float(g % 2) for g in range(group)]  # mixed
    rows, keys = [], []
    for p in range(problems):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        for g in range(group):
            for s in slots:
                n = agg_len if s == "aggregator" else rng.randint(*gen_len)
                comp = [rng.randrange(3, vocab) for _ in range(n)]
                role = "aggregator" if s == "aggregator" else "generator"
                rows.append(grpo.Sample(role, s, f"p{p}", prompt, comp, [], True, rewards[p, s][g], 0.0, g))
                keys.append((f"p{p}", s))
    for r, a in zip(rows, grpo.group_advantages([r.reward for r in rows], keys)):
        r.advantage = a
    return rows


def timed_update(policy, samples, skip, args):
    opts, scheds = grpo.make_optimizers(policy, lr=1e-4, warmup_steps=0, total_steps=10)
    hp = grpo.Hyper(temperature=0.7, mini_batch=args.problems * args.group, token_budget=args.token_budget,
                    skip_zero=skip)
    dyn = dynamics.RoleDynamics(policy)
    t0 = time.perf_counter()
    grpo.update(policy, opts, scheds, samples, hp, shuffle=torch.Generator().manual_seed(0), probe=dyn)
    return time.perf_counter() - t0, dyn.summary(hp)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="toy", choices=sorted(CONFIGS), help="model shape (random weights) (default: %(default)s)")
    ap.add_argument("--sharing", default="shared", choices=["shared", "isolated"], help="(default: %(default)s)")
    ap.add_argument("--problems", type=int, default=16, help="problems per step (default: %(default)s)")
    ap.add_argument("--group", type=int, default=8, help="episodes per problem (default: %(default)s)")
    ap.add_argument("--uniform", type=float, default=0.5, help="fraction of (problem, slot) groups with one reward (default: %(default)s)")
    ap.add_argument("--token-budget", type=int, default=16384, help="padded tokens per micro-batch (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each; the best is kept (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = ap.parse_args()
    if not 0 <= args.uniform <= 1 or min(args.problems, args.group, args.repeats) < 1:
        ap.error("--uniform must be in [0, 1]; --problems, --group and --repeats at least 1")

    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(args.seed)
    cfg = Qwen3Config(**CONFIGS[args.config], max_position_embeddings=1024, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()

    def fresh_policy():  # the same adapters every time (hooks cannot be deep-copied with a policy)
        torch.manual_seed(args.seed)
        return policies.Policy(copy.deepcopy(model), None, ("generator", "aggregator"), args.sharing, rank=16, alpha=32)
    samples = voting_step(args.problems, args.group, args.uniform, random.Random(args.seed), cfg.vocab_size)
    zero = sum(s.advantage == 0.0 for s in samples)
    print(f"{args.config} Qwen3, {args.sharing}: {len(samples)} rows, {zero} with advantage 0 "
          f"({zero / len(samples):.0%}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    best = {}
    for skip in [False, True] * args.repeats:
        t, out = timed_update(fresh_policy(), samples, skip, args)
        best[skip] = min(best.get(skip, t), t)
    print(f"update, every row:        {best[False]:.2f} s")
    print(f"update, zero rows skipped: {best[True]:.2f} s   ({out['roles']['generator']['skipped']} generator and "
          f"{out['roles']['aggregator']['skipped']} aggregator rows skipped)")
    print(f"ratio (every row / skipped): {best[False] / best[True]:.2f}x")


if __name__ == "__main__":
    main()
