"""Tokens per second of engine.generate against lockstep batches and model.generate, in one run.

    python bench/generate.py                                   # both workloads, small random Qwen3, CPU
    python bench/generate.py --workload realistic --prompts 512 --slots 64
    python bench/generate.py --workload equal --prompt-min 16 --prompt-len 48 --equal-new 64  # 32 rows, 16-48
    python bench/generate.py --device cuda --config 0.6b --prompts 512 --slots 256 --new 512
    python bench/generate.py --check --device cuda   # greedy parity, graphs = eager (tiny model), upload wait
    python bench/generate.py --device cuda --config 0.6b --workload voting --samplers continuous --repeats 1
    python bench/generate.py --device cuda --config 0.6b --workload voting --attend pages,flex

Every sampler gets the same model, prompts and sampling settings (temperature, top_p=1). The stop
id is one the prompts never hold and the random model (almost) never samples, so a row runs to
its own limit, and tokens/s counts the tokens the rows asked for (the sum of their limits), the
same figure for every sampler. Workloads:
- equal: --slots rows of --equal-new tokens each, all held at once. The reference is
  `rollout.generate_simple` (every row of a batch steps together in one DynamicCache); the ratio
  continuous / lockstep must stay >= 1.
- realistic: --prompts rows whose limits are drawn from a lognormal (median --median x --new,
  sigma --sigma) capped at --new: most rows short, a few long, like real completions. The KV
  budget holds --slots rows of the longest prompt + --new tokens. Continuous batching (one
  generate over all rows in that budget) against lockstep batches (generate_simple) of --slots
  rows in input order (the same memory: each batch runs until its longest row ends), and
  against model.generate in the same batches. Goal on CPU: continuous / lockstep >= 1.5.
- voting: a paper-like Voting generation stage, --problems x --rollouts rows (64 x 8), a prompt
  of 150 to 350 tokens a problem (its rollouts share it), completions drawn from a lognormal
  (median --median x --new, sigma --sigma) cut at --new (2,048): each row's limit is its drawn
  length, so random weights end where a real model's long tail would. One engine.generate call in
  the default KV budget; it prints tokens/s and the share of the GPU's peak bandwidth that the
  bytes a decode needs (the weights once a step, each row's own K/V columns) reach
  (--peak-tb-s, known for H100 and H200). `--attend pages,flex` times each decode attention
  (engine.ATTEND) on the same prompts and lengths and prints flex's tokens/s over pages'; flex is
  compiled for every row count before its timed call (engine.flex_warm_up: those compiles are
  counted and timed apart), and if it fails the line says so and why.
Each sampler runs once to warm up (its first --slots rows, 8 tokens each), then --repeats times, interleaved, best time kept (these
machines are shared and noisy; only ratios within one run mean anything). On a CPU device the
time is the process's CPU time by default (`--clock cpu`; run with OMP_NUM_THREADS=1), which other
jobs on the machine disturb far less than the wall time.
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudagraphs  # noqa: E402
import engine  # noqa: E402
import rollout  # noqa: E402

from shapes import CONFIGS  # noqa: E402  (the model shapes every bench script builds)


# ----------------------------------------------------------------------------- the workloads

def build_model(config: str, device: str):
    """A random Qwen3 of a published shape, built on the device (fast at the real scales)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if device.startswith("cuda") and torch.device(device).index is not None:   # cuda:N current, as policies.use_device
        torch.cuda.set_device(torch.device(device))
    torch.manual_seed(0)
    cfg = Qwen3Config(**CONFIGS[config], tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def make_prompts(n: int, length: int, group: int, vocab: int, seed: int = 0, shortest: int | None = None) -> list:
    """n prompts of `shortest` to `length` ids (default: up to 7 shorter, 8 lengths), spread
    evenly, `group` rows per distinct prompt."""
    g = torch.Generator().manual_seed(seed)
    k = math.ceil(n / group)
    lens = ([length - (i % 8) for i in range(k)] if shortest is None else
            torch.linspace(length, shortest, k).round().long().tolist())
    distinct = [torch.randint(3, vocab - 2, (n_i,), generator=g).tolist() for n_i in lens]
    return [distinct[i // group] for i in range(n)]


def lognormal_limits(n: int, cap: int, median: float, sigma: float, seed: int = 0) -> list:
    """Heavy-tailed lengths: exp(N(log(median * cap), sigma)) rounded, in [1, cap]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median * cap) + sigma * torch.randn(n, generator=g))
    return x.round().clamp(1, cap).long().tolist()


def timed(fns: dict, warmups: dict, repeats: int, device: str, clock: str, report) -> None:
    """Best time of each fn, after one short warm-up call each, runs interleaved; each fn's
    `report(name, seconds, peak CUDA bytes)` is called as soon as its last run ends. clock "cpu"
    is this process's CPU time (on a shared CPU machine it leaves out the time other jobs take
    the core; run with OMP_NUM_THREADS=1), "wall" the wall time (with the device synchronised)."""
    now, cuda = (time.process_time if clock == "cpu" else time.perf_counter), device.startswith("cuda")

    def one(fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = now()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return now() - t0, torch.cuda.max_memory_allocated() if cuda else 0
    for fn in warmups.values():
        fn()
    best, peak = {k: float("inf") for k in fns}, {k: 0 for k in fns}
    for r in range(repeats):
        for k, fn in fns.items():
            t, m = one(fn)
            best[k], peak[k] = min(best[k], t), max(peak[k], m)
            if r == repeats - 1:
                report(k, best[k], peak[k])


def samplers(model, args, prompts, limits, slots):
    """name -> fn running every prompt to its limit: continuous (one call in a budget of
    `slots` rows), lockstep reference and model.generate in batches of `slots`."""
    stop, temp = model.config.vocab_size - 1, args.temperature
    bpt = engine.kv_bytes_per_token(model.config, model.dtype)
    budget = slots * (max(len(p) for p in prompts) + max(limits)) * bpt
    batches = [range(a, min(a + slots, len(prompts))) for a in range(0, len(prompts), slots)]

    def continuous():
        engine.generate(model, prompts, limits, [stop], 0, temperature=temp, seed=1,
                         kv_budget=budget, max_rows=slots)

    def lockstep():
        for b in batches:
            rollout.generate_simple(model, [prompts[i] for i in b], [limits[i] for i in b], [stop], 0,
                                    temperature=temp, seed=1, keys=list(b))

    def hf():
        for b in batches:
            ids, mask = rollout.left_pad([prompts[i] for i in b], 0, args.device)
            T = max(limits[i] for i in b)
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temp, top_p=1.0,
                           top_k=0, max_new_tokens=T, min_new_tokens=T, eos_token_id=stop, pad_token_id=0)
    fns = {"lockstep": lockstep, "continuous": continuous, "model.generate": hf}
    return {k: fns[k] for k in args.samplers.split(",")}, budget


def run(model, args, name, prompts, limits, slots):
    """Time every sampler on one workload; print a line per sampler as it ends, then the ratios."""
    fns, budget = samplers(model, args, prompts, limits, slots)
    warm, _ = samplers(model, args, prompts[:slots], [min(t, 8) for t in limits[:slots]], slots)
    tokens = sum(limits)
    print(f"{name}: {len(prompts)} rows, {tokens} tokens, limits mean {tokens / len(limits):.0f} max {max(limits)}; "
          f"KV budget {budget / 2**20:.1f} MiB holds {slots} rows", flush=True)
    rate = {}

    def report(k, t, peak):
        rate[k] = tokens / t
        mem = f" peak {peak / 2**30:5.1f} GiB" if peak else ""
        print(f"  {k:15s} {rate[k]:10.0f} tok/s {t:7.2f} s {args.clock}{mem}", flush=True)
        if k == "continuous":   # now, so the line survives a later sampler's time limit
            print(f"  engine: {cudagraphs.graphs_line()}", flush=True)
    timed(fns, warm, args.repeats, args.device, args.clock, report)
    if "continuous" in rate:
        vs = ", ".join(f"{rate['continuous'] / r:.2f}x {k}" for k, r in rate.items() if k != "continuous")
        print(f"  {name}: continuous = {vs}", flush=True)


PEAK_TB_S = {"H100": 3.35, "H200": 4.8}   # HBM bandwidth by the device's name


def voting(model, args) -> None:
    """The voting workload (see the docstring): for each of --attend, one timed call after a short
    warm-up call, on the same prompts and lengths; then flex's tokens/s over pages' when both ran."""
    g = torch.Generator().manual_seed(0)
    V, rows = model.config.vocab_size, args.problems * args.rollouts
    lens = torch.randint(150, 351, (args.problems,), generator=g).tolist()
    distinct = [torch.randint(3, V - 2, (n,), generator=g).tolist() for n in lens]
    prompts = [distinct[i // args.rollouts] for i in range(rows)]
    limits = lognormal_limits(rows, args.new, args.median, args.sigma, seed=2)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    rate = {}
    for attend in (args.attend or engine.ATTEND[kind]).split(","):
        engine.ATTEND[kind] = attend
        rate[attend] = voting_call(model, args, attend, prompts, limits)
    if "pages" in rate and "flex" in rate:
        print(f"voting flex / pages: {rate['flex'] / rate['pages']:.2f}x tokens/s (the same prompts and lengths)"
              + (f"; flex refused: {engine.FLEX['refused']}" if engine.FLEX["refused"] else ""), flush=True)


def voting_call(model, args, attend: str, prompts: list, limits: list) -> float:
    """One timed engine.generate of the voting rows with decode attention `attend`, after a warm-up
    call (and for flex, its compiles for every row count: engine.flex_warm_up); prints its line
    and returns its tokens/s."""
    V, rows, cuda = model.config.vocab_size, len(prompts), args.device.startswith("cuda")
    budget = engine.default_kv_budget(args.device)
    t0 = time.perf_counter()
    used = engine.flex_warm_up(model, rows) if attend == "flex" else attend
    fused = attend == "flex" and engine.FLEX_COMPILE["cuda" if cuda else "cpu"]   # else FlexAttention runs eagerly
    compiled = (f"; {engine.FLEX['compiles']} flex compiles before it ({time.perf_counter() - t0:.1f} s)"
                if fused else "")
    engine.generate(model, prompts[:8], [8] * 8, [V - 1], 0, temperature=args.temperature, kv_budget=budget)
    stats, graphs = {}, counters["stats"]["unique_graphs"]
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(model, prompts, limits, [V - 1], 0, temperature=args.temperature, seed=1, keys=list(range(rows)),
                    kv_budget=budget, stats=stats)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter() - t0
    bpt = engine.kv_bytes_per_token(model.config, model.dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    need = stats["decode_steps"] * weights + stats["own_columns"] * bpt      # what a decode must read
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tb_s or next((v for k, v in PEAK_TB_S.items() if k in name), None)
    share = f"{need / t / (peak * 1e12):.0%} of {peak} TB/s" if peak else "no peak known (--peak-tb-s)"
    late = counters["stats"]["unique_graphs"] - graphs
    print(f"voting {attend}: {rows} rows ({rows // args.rollouts} prompts x {args.rollouts}), {sum(limits)} tokens "
          f"(limits mean {sum(limits) / rows:.0f}, max {max(limits)}) in {t:.1f} s: {sum(limits) / t:.0f} tok/s; "
          f"{stats['decode_steps']} decode steps ({t / stats['decode_steps'] * 1e3:.1f} ms each, prefills included), "
          f"at most {stats['rows']} rows at once; attended {stats['attended_columns'] / stats['own_columns']:.3f}x the "
          f"rows' own columns; the weights and own K/V a decode needs, {need / t / 1e12:.2f} TB/s: {share}"
          + (f" (decoded with {used}: flex refused, {engine.FLEX['refused']})" if used != attend else "")
          + compiled + (f"; {late} graphs compiled inside the timed call" if late and fused else "")
          + ("; paged_attention's bf16 products widened to fp32 first (torch.bmm took no out_dtype)"
             if engine.BMM_OUT_DTYPE["cuda"] is False else ""), flush=True)
    print(f"  engine: {cudagraphs.graphs_line()}", flush=True)
    return sum(limits) / t


def check_parity(device: str) -> None:
    """Greedy engine.generate with per-row limits, in a budget of 3 of the longest rows (in pages,
    and the trash page), against model.generate on each prompt alone (fp32, a tiny random Qwen3),
    then graphs against eager steps (graphs_equal_eager): exits 1 on a mismatch. Pages of 4
    tokens on CUDA too, so rows span pages and cross into new ones between replays."""
    page = engine.PAGE["cuda"]
    engine.PAGE["cuda"] = 4
    try:
        _check_parity(device)
    finally:
        engine.PAGE["cuda"] = page


def _check_parity(device: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, initializer_range=0.3, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).to(device).eval()
    prompts = make_prompts(12, 9, 2, 60)
    limits = [1 + (7 * i) % 13 for i in range(len(prompts))]
    stop = [int(engine.generate(model, prompts[:1], 3, [63], 0, temperature=0).tokens[0, 2]), 63]
    bpt = engine.kv_bytes_per_token(cfg, model.dtype)
    page = engine.PAGE["cuda" if torch.device(device).type == "cuda" else "cpu"]
    budget = (3 * engine.pages_for(9 + 13, page) + 1) * page * bpt
    out = engine.generate(model, prompts, limits, stop, 0, temperature=0, kv_budget=budget)
    bad = 0
    for i, (p, t) in enumerate(zip(prompts, limits)):
        ref = model.generate(input_ids=torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), device=device,
                             dtype=torch.long), do_sample=False, max_new_tokens=t, pad_token_id=0, eos_token_id=stop)[0, len(p):]
        ours = out.tokens[i][out.mask[i]]
        bad += not torch.equal(ours, ref[: len(ours)]) or bool((ref[len(ours):] != 0).any())
    print(f"parity on {device}: {len(prompts) - bad}/{len(prompts)} prompts equal model.generate alone "
          f"({int(out.finished.sum())} stopped)", flush=True)
    bad += not graphs_equal_eager(model, prompts, limits, stop, None)
    if bad:
        sys.exit(1)


def graphs_equal_eager(model, prompts, limits, stop, budget) -> bool:
    """Sampled (T 0.7, keyed) engine.generate with CUDA graphs against the same call stepped
    eagerly, every row at once (budget None: row buckets up to 16, then smaller as rows end): a
    replay runs the kernels the eager step runs, so tokens must be equal and logprobs within 1e-4
    (a graph that replayed stale inputs, or K/V a capture left wrong, shows here). On a CPU both
    run eagerly."""
    kw = dict(temperature=0.7, seed=1, keys=list(range(len(prompts))), kv_budget=budget)
    replayed = engine.generate(model, prompts, limits, stop, 0, **kw)
    eager = engine.generate(model, prompts, limits, stop, 0, cuda_graphs=False, **kw)
    same = torch.equal(replayed.tokens, eager.tokens) and torch.equal(replayed.mask, eager.mask)
    gap = float((replayed.logprobs - eager.logprobs)[eager.mask].abs().max()) if same else math.inf
    print(f"graphs against eager steps: sampled tokens {'equal' if same else 'DIFFER'}, largest logprob "
          f"difference {gap:.1e} ({cudagraphs.graphs_line()})", flush=True)
    return same and gap <= 1e-4


def upload_wait(device: str, rows: int = 512, pages: int = 24) -> None:
    """How long the host waits to hand a decode step its numbers (writes.meta: about rows x (2 +
    3 x pages) int64s) while the device is busy with earlier work: from pageable memory, as the
    engine once did, the driver stages the copy and may wait for the queue; from engine._Upload's
    pinned buffers it should not. The values that arrive are checked. CUDA only."""
    dev = torch.device(device)
    if dev.type != "cuda":
        print("upload of a step's numbers: not measured (CUDA only)", flush=True)
        return
    n = rows * (2 + 3 * pages)
    dst, x = torch.empty(n, dtype=torch.long, device=dev), torch.randn(4096, 4096, device=dev)
    up = engine._Upload(dst, True)
    sends = {"pageable": lambda a: dst.copy_(torch.from_numpy(a).to(dev, non_blocking=True)), "pinned": up}
    waits, queued, ok = {}, 0.0, True
    for name, send in sends.items():
        host = []
        for k in range(6):
            a = np.arange(k, k + n, dtype=np.int64)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = x
            for _ in range(8):                          # tens of ms of work queued ahead of the copy
                y = (y @ x).clamp_(-1, 1)
            end.record()
            t = time.perf_counter()
            send(a)
            host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            queued, ok = start.elapsed_time(end), ok and bool((dst.cpu().numpy() == a).all())
        waits[name] = min(host[1:]) * 1e3               # the first call warms up
    print(f"upload of a step's numbers ({n * 8 // 1024} KiB) behind {queued:.0f} ms of queued work: the host waits "
          f"{waits['pageable']:.2f} ms from pageable memory, {waits['pinned']:.2f} ms through _Upload"
          + ("" if ok else "; VALUES WRONG"), flush=True)
    if not ok:
        sys.exit(1)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS), help="model shape (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    ap.add_argument("--workload", default="both", choices=["equal", "realistic", "both", "voting"], help="which workload")
    ap.add_argument("--problems", type=int, default=64, help="voting: distinct prompts")
    ap.add_argument("--rollouts", type=int, default=8, help="voting: rows a prompt")
    ap.add_argument("--peak-tb-s", type=float, default=None, help="voting: the device's peak bandwidth, TB/s "
                    "(default: known for H100 and H200)")
    ap.add_argument("--attend", default=None, help="voting: comma-separated decode attentions (engine.ATTEND: "
                    "pages, rows, flex), each timed on the same prompts and lengths (default: the device's)")
    ap.add_argument("--slots", type=int, default=32, help="rows the KV budget holds (equal: the rows)")
    ap.add_argument("--prompts", type=int, default=256, help="realistic: rows in all")
    ap.add_argument("--prompt-len", type=int, default=32, help="longest prompt; others are up to 7 shorter")
    ap.add_argument("--prompt-min", type=int, default=None, help="shortest prompt: lengths spread evenly from "
                    "--prompt-len down to it (default: up to 7 shorter than --prompt-len)")
    ap.add_argument("--new", type=int, default=128, help="realistic: the cap of the row limits")
    ap.add_argument("--equal-new", type=int, default=None, help="equal: new tokens per row (None: --new)")
    ap.add_argument("--median", type=float, default=0.15, help="realistic: median length / --new")
    ap.add_argument("--sigma", type=float, default=1.0, help="realistic: lognormal sigma of the lengths")
    ap.add_argument("--group", type=int, default=1, help="rows per distinct prompt (prefix sharing)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each sampler, best kept")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="time measured: process CPU time or wall time (default: cpu on a CPU device, else wall)")
    ap.add_argument("--check", action="store_true",
                    help="only check greedy parity with model.generate and sampled rows with CUDA graphs against eager "
                         "steps on --device (tiny fp32 model), and time a step's upload behind queued work, then exit")
    ap.add_argument("--samplers", default="lockstep,continuous,model.generate",
                    help="comma-separated subset of lockstep, continuous, model.generate, in the order run")
    args = ap.parse_args()
    args.clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    if args.check:
        check_parity(args.device)
        return upload_wait(args.device)

    torch.set_grad_enabled(False)
    model = build_model(args.config, args.device)
    V = model.config.vocab_size
    print(f"config={args.config} device={args.device} dtype={model.dtype} prompt<={args.prompt_len} "
          f"group={args.group} temperature={args.temperature}", flush=True)
    if args.workload == "voting":
        return voting(model, args)
    if args.workload in ("equal", "both"):
        prompts = make_prompts(args.slots, args.prompt_len, args.group, V, shortest=args.prompt_min)
        run(model, args, "equal", prompts, [args.equal_new or args.new] * len(prompts), args.slots)
    if args.workload in ("realistic", "both"):
        prompts = make_prompts(args.prompts, args.prompt_len, args.group, V, seed=1, shortest=args.prompt_min)
        limits = lognormal_limits(args.prompts, args.new, args.median, args.sigma)
        run(model, args, "realistic", prompts, limits, args.slots)


if __name__ == "__main__":
    main()
