"""The update against its FLOP floor and against a reference commit's update, on the same rows.

    python bench/update.py                            # small Qwen3, a paper-like Voting step, CPU
    python bench/update.py --reference 1312004 --problems 2 --group 4 --repeats 1   # twice the rows

A Voting-shaped step at paper-like lengths, scaled down to run on a CPU in minutes: `--problems`
x `--group` episodes x (3 generator calls + 1 aggregator call). A problem's prompt is drawn
uniformly from 150-400 tokens; generator completions are lognormal (median `--median`, sigma
0.9) cut at `--cap`; the aggregator's prompt is the problem plus its three voters' solutions,
each clipped to `--cap`, plus 100 tokens of instruction, at most 2,000; its completion is
lognormal with a fifth of the median. Rewards are mixed within every group but a share
`--uniform` of them (advantage 0: the rows the update skips). Mini-batches of a quarter of the
rows, as the paper's 2,048 calls in 512-call mini-batches under Shared, so three quarters of
the rows need old logprobs. KL 0, no --tis: the paper's update.

Two updates run from the same weights on the same rows: this checkout's grpo.py and
policies.py, and the reference commit's (`git show COMMIT:grpo.py`, imported from a temporary
folder), each `--repeats` times, keeping the best time (shared machines are noisy). Printed:
- FLOPs done: the matmuls torch's FlopCounterMode sees in one untimed run of each, plus the
  attention, which it does not see (SDPA kernels), counted from each call's shapes: a masked
  batch of width W the full square, 4 W^2 Hq D a row and layer forward, a packed row of L tokens
  the causal half, 2 L^2 Hq D; a backward twice its forward;
- the minimum GRPO needs: every row that runs, once forward and once backward over its own
  L = prompt + completion - 1 tokens (the base's matmuls forward, their activation gradients
  backward, the adapters' three matmuls, causal attention, the head at completion positions
  only), plus a forward (adapter folded) for the rows whose old logprobs no earlier forward
  gives (after the first mini-batch). It counts the first layer's input gradient, which
  autograd skips (the embedding is frozen), so a path at the floor prints about 0.99x;
- the padding share: pad positions among the positions the layers ran (an embedding hook);
- time: the reference's best over this checkout's best.
"""
import argparse
import copy
import importlib.util
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import policies  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, vocab_size=8192)   # Qwen3-0.6B's ratios, scaled down
SLOTS = ["generator0", "generator1", "generator2", "aggregator"]


def lognormal(rng, median, cap):
    return max(1, min(cap, int(math.exp(math.log(median) + 0.9 * rng.gauss(0, 1)))))


def voting_rows(args, rng, vocab):
    """The step's Samples (module docstring), advantages grouped by (problem, slot)."""
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]   # noqa: E731  (0 is the reference's pad)
    rows, keys = [], []
    for p in range(args.problems):
        problem = ids(rng.randint(150, 400))
        uniform = {s: rng.random() < args.uniform for s in SLOTS}
        for g in range(args.group):
            sols = [ids(lognormal(rng, args.median, args.cap)) for _ in range(3)]
            agg_prompt = (problem + [t for s in sols for t in s[:args.cap]] + ids(100))[-2000:]
            comps = sols + [ids(lognormal(rng, args.median / 5, args.cap))]
            for s, prompt, comp in zip(SLOTS, [problem] * 3 + [agg_prompt], comps):
                reward = float(uniform[s] or (g + SLOTS.index(s)) % 2)
                role = "aggregator" if s == "aggregator" else "generator"
                rows.append(grpo.Sample(role, s, f"p{p}", prompt, comp, [], True, reward, 0.0, g))
                keys.append((f"p{p}", s))
    for r, a in zip(rows, grpo.group_advantages([r.reward for r in rows], keys)):
        r.advantage = a
    return rows


def reference_modules(commit):
    """(grpo, policies) as they are at `commit`, imported under their own names."""
    folder = tempfile.mkdtemp(prefix="bench-update-")
    mods = []
    for name in ("grpo", "policies"):
        path = os.path.join(folder, f"{name}_ref.py")
        with open(path, "w") as f:
            f.write(subprocess.check_output(["git", "-C", ROOT, "show", f"{commit}:{name}.py"], text=True))
        spec = importlib.util.spec_from_file_location(f"{name}_ref", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


class Counter:
    """Positions the layers ran and how many were pads (id 0), and the attention's FLOPs, which
    torch's FlopCounterMode does not see (the SDPA kernels are not matmuls): read from the
    shapes each attention call is given, in its first layer, times the layers; a backward
    counts twice the forward."""

    def __init__(self, model):
        c = model.config
        self.per = 2 * c.num_attention_heads * c.head_dim * c.num_hidden_layers   # 2 Hq D layers
        self.ran = self.pads = self.attn = 0
        self.hook = model.get_input_embeddings().register_forward_hook(self.seen)

    def seen(self, module, inputs, out):
        ids = inputs[0]
        self.ran += ids.numel()
        self.pads += int((ids == 0).sum())

    def spy(self, real, packed_rows):
        """An attention function that counts, then calls `real`: a masked call runs the full
        square (4 B Wq Wk Hq D a forward), a packed row the causal half (2 L^2 Hq D)."""
        def attention(module, q, k, v, mask, **kw):
            if module.layer_idx == 0:
                grad = 3 if torch.is_grad_enabled() else 1
                if packed_rows:
                    self.attn += grad * sum(self.per * n * L * L for _, n, L in kw["packed_rows"])
                else:
                    self.attn += grad * (2 if mask is not None else 1) * self.per * q.shape[0] * q.shape[2] * k.shape[2]
            return real(module, q, k, v, mask, **kw)
        return attention


def minimum_flops(samples, plan_later, cfg, rank):
    """The FLOPs GRPO needs for these rows (module docstring)."""
    h, V, L, I = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    body = L * (h * q + 2 * h * kv + q * h + 3 * h * I)                 # base weights a token meets
    lora = L * rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + I) + (I + h))
    attn = 2 * cfg.num_attention_heads * cfg.head_dim * L             # causal forward, per L^2
    total = 0
    for i, s in enumerate(samples):
        if s.advantage == 0.0:
            continue
        n, c = len(s.prompt_ids) + len(s.completion_ids) - 1, len(s.completion_ids)
        train = 2 * body * n * 2 + 2 * lora * n * 3 + attn * n * n * 3 + 2 * h * V * c * 2
        old = (2 * body * n + attn * n * n + 2 * h * V * c) if i in plan_later else 0
        total += train + old
    return total


def run_update(grpo_mod, policy, samples, args, shuffle_seed=0):
    opts, scheds = grpo_mod.make_optimizers(policy, lr=1e-4, warmup_steps=0, total_steps=10)
    hp = grpo_mod.Hyper(temperature=0.7, mini_batch=max(1, len(samples) // 4), token_budget=args.token_budget)
    t0 = time.perf_counter()
    grpo_mod.update(policy, opts, scheds, samples, hp, shuffle=torch.Generator().manual_seed(shuffle_seed))
    return time.perf_counter() - t0


def counted(grpo_mod, policy, samples, args):
    """(FLOPs, pad share) of one update: matmuls as FlopCounterMode sees them, plus attention."""
    import packed
    from transformers import AttentionInterface
    count = Counter(policy.model)
    real = {name: AttentionInterface()[name] for name in ("sdpa", packed.ATTENTION)}
    for name, fn in real.items():
        AttentionInterface.register(name, count.spy(fn, name == packed.ATTENTION))
    try:
        with FlopCounterMode(display=False) as fc:
            run_update(grpo_mod, policy, samples, args)
    finally:
        for name, fn in real.items():
            AttentionInterface.register(name, fn)
        count.hook.remove()
    return fc.get_total_flops() + count.attn, count.pads / max(1, count.ran)


def later_rows(samples, policy, args):
    """Rows after each adapter's first mini-batch: those whose old logprobs need a forward."""
    rows = grpo.adapter_rows(policy, samples, "shared", torch.Generator().manual_seed(0))
    mbs = grpo.optimizer_batches(rows, max(1, len(samples) // 4))
    return {i for mb in mbs[1:] for i in mb}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default="1312004", help="commit whose update is the baseline (default: %(default)s)")
    ap.add_argument("--problems", type=int, default=2, help="problems per step (default: %(default)s)")
    ap.add_argument("--group", type=int, default=2, help="episodes per problem (default: %(default)s)")
    ap.add_argument("--median", type=int, default=300, help="median generator completion, tokens (default: %(default)s)")
    ap.add_argument("--cap", type=int, default=1024, help="completion cap, tokens (default: %(default)s)")
    ap.add_argument("--uniform", type=float, default=0.25, help="share of (problem, slot) groups with one reward (default: %(default)s)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    ap.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each; the best is kept (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(args.seed)
    cfg = Qwen3Config(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    grpo_ref, policies_ref = reference_modules(args.reference)

    def fresh(pol_mod):   # the same adapters every time, B != 0 so every matmul of the backward runs
        torch.manual_seed(args.seed)
        pol = pol_mod.Policy(copy.deepcopy(model), None, ("generator", "aggregator"), "shared", rank=args.rank, alpha=32)
        with torch.no_grad():
            for p in pol.parameters_of("shared"):
                p.normal_(0, 0.02)
        return pol
    samples = voting_rows(args, random.Random(args.seed), cfg.vocab_size)
    runs = sum(s.advantage != 0.0 for s in samples)
    own = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    print(f"small Qwen3 {SHAPE}, LoRA r{args.rank}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{len(samples)} rows ({runs} run), {own} tokens; prompts {min(len(s.prompt_ids) for s in samples)}-"
          f"{max(len(s.prompt_ids) for s in samples)}, completions {min(len(s.completion_ids) for s in samples)}-"
          f"{max(len(s.completion_ids) for s in samples)}")
    floor = minimum_flops(samples, later_rows(samples, fresh(policies), args), cfg, args.rank)
    done_new, pad_new = counted(grpo, fresh(policies), samples, args)
    done_ref, pad_ref = counted(grpo_ref, fresh(policies_ref), samples, args)
    best = {}
    for which in ["ref", "new"] * args.repeats:
        mod, pol = (grpo_ref, fresh(policies_ref)) if which == "ref" else (grpo, fresh(policies))
        best[which] = min(best.get(which, math.inf), run_update(mod, pol, samples, args))
    print(f"minimum GRPO needs: {floor / 1e12:.3f} TFLOP")
    for name, done, pad, t in [(args.reference, done_ref, pad_ref, best["ref"]), ("this checkout", done_new, pad_new, best["new"])]:
        print(f"{name:14s} {done / 1e12:.3f} TFLOP = {done / floor:.2f}x the minimum, padding {pad:.0%} of the "
              f"positions run, best of {args.repeats}: {t:.1f} s")
    print(f"speed-up ({args.reference} / this checkout): {best['ref'] / best['new']:.2f}x")


if __name__ == "__main__":
    main()
