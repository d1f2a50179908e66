"""A prediction, not a measurement: the time of one training step at the paper's settings on one
H100 or H200, from bytes moved, FLOPs and kernel launches per step, for the decode loop as of
a64386d ("before"), as it is now ("after", engine.ATTEND "pages") and with ATTEND "flex"
("flex": the same, but a fused paged kernel reads each attended K/V byte once, flex_copies).

    python bench/predict.py                       # 0.6B / 1.7B / 4B on H100 and H200
    python bench/predict.py --workflow single     # one generator call per episode

Every constant it assumes is printed first; change one with --set NAME=VALUE (e.g. --set
mean_len=2000). The counts per decode step come from bench/decode.py --section ops (the
0.6B shape, LoRA r64, 28 layers; scaled by layers for 4B); the rest is arithmetic:
- a stage (all generator calls, then all aggregator calls) decodes with S rows in flight, S
  what the KV budget holds at prompt + 5,120 columns (budget = KV share x free memory after
  loading; after, in pages, every row counted at its limit: the rows holding their own tokens
  that the engine admits are printed per scale and GPU, not used); its steps are the stage's
  tokens / S,
  plus a tail of the longest row's length at about S/4 rows;
- a decode step costs max(host, device): host = kernel-launching ops issued eagerly x the
  host cost of one op (all of the step before; after, with CUDA graphs, only the sampling and
  counters outside the graph, plus the Python loop); device = bytes / (bandwidth x efficiency)
  + kernels x the gap between kernels. Bytes = the weights once, plus the attended K/V: before,
  every row attends the widest busy row (W_max) and transformers 5.17 (the GPU machine's)
  copies it g times with repeat_kv (read once, written g times, read g times by SDPA); after,
  each row attends its own width rounded up to a page (the mean width of a row in flight,
  E[len^2]/2E[len] past its prompt), its pages gathered (read, written, read again: 3x), and
  each layer's paged attention is issued eagerly between the graph's pieces (host);
- a stage's prefill: its distinct prompts through 2 x params FLOPs a token plus the attention's
  P x P square (before: all of it, an explicit mask; after: half, the causal kernel), and (after)
  each row bucket's CUDA graph capture, once a process (its share of a 500-step run);
- the update: every sample's prompt + completion through the passes grpo.update runs (the
  training forward, the backward to the activations, the old logprobs' forward on three
  quarters of the rows; a recompute only where the activations do not fit) plus causal attention, at the
  efficiency the H200 run measured (`train_eff`; each constant prints its source).
"""
import argparse
import math

GPUS = {"H100": dict(hbm_gb=80, tb_s=3.35, tflops=989), "H200": dict(hbm_gb=141, tb_s=4.8, tflops=989)}
SCALES = {  # params (B), layers, hidden, kv heads, head_dim, query heads
    "0.6b": dict(params=0.60, layers=28, hidden=1024, kv=8, head_dim=128, heads=16),
    "1.7b": dict(params=1.72, layers=28, hidden=2048, kv=8, head_dim=128, heads=16),
    "4b": dict(params=4.02, layers=36, hidden=2560, kv=8, head_dim=128, heads=32),
}
CONSTANTS = dict(
    bw_eff=0.42,            # share of peak HBM bandwidth a decode step's reads reach
    train_eff=0.14,         # share of peak bf16 FLOP/s the update reaches (MFU, of the FLOPs update_s counts)
    old_share=0.75,         # rows whose old logprobs need a forward of their own (all but the first mini-batch)
    act_share=0.5,          # share of the free memory a micro-batch's activations may take unchecked
    token_budget=16384,     # tokens per training micro-batch
    host_us_per_op=9.0,     # host time of one eagerly issued op (PyTorch + transformers' Python), us
    gap_us_eager=2.5,       # device time between two eagerly launched kernels, us
    gap_us_graph=1.0,       # device time between two kernels of a replayed CUDA graph, us
    loop_host_ms=0.5,       # after: the Python of one loop turn outside the graph (schedule, counters), ms
    ops_before=3408,        # kernel-launching ops per decode step, a64386d (bench/decode.py --section ops)
    ops_after=2322,         # the same, now, eager
    ops_after_outside=59,   # now: of them, outside the decode forward (sampling, counters, stop check)
    hole_ops=30,            # now: kernels of each layer's eager paged attention between graph pieces
    kv_share_before=0.5,    # KV budget share of the free memory, before
    kv_share_after=0.85,    # and now
    reserved_gb=4.0,        # memory neither the weights nor the KV cache may use (CUDA context, activations)
    prompt=250,             # generator prompt tokens
    median_len=900,         # generator completion: lognormal median (tokens) ...
    sigma=0.9,              # ... and sigma, cut at cap
    cap=5120,               # max_new_tokens (math)
    embed=1536,             # --max-embed-tokens: each solution in the aggregator's prompt
    agg_len=400,            # aggregator completion, mean tokens
    wmax_frac=0.85,         # before: the widest busy row's column, as a share of prompt + cap
    attend_over=1.023,      # after: attended / own widths, each row's own columns rounded up to a 64-token page
    gather_copies=3,        # after: K/V bytes moved per attended byte: paged_attention gathers the pages
                            # (read, written) and its products read them again
    flex_copies=1,          # flex: the same, FlexAttention's fused paged kernel (engine.flex_paged_attention)
    problems=64, rollouts=8,
    capture_ms=60.0,        # after: one CUDA graph capture with its warm-up step and synchronize, ms (stated)
    buckets=63,             # after: row buckets captured, once a process (the voter call's, both stages)
    sample_bytes=24,        # after: sampler bytes a row and vocabulary entry a step (fp32: 6 passes x 4 B)
    page=64,                # after: tokens a K/V page holds (engine.PAGE["cuda"])
    prefill_eff=0.40,       # share of peak bf16 FLOP/s a prefill reaches
)


# Where each constant comes from ("assumed" where nothing measured it); printed with it.
SOURCES = dict(
    bw_eff="measured on one H200 for the row-group engine (docs/BENCHMARKS.md: 2.0 TB/s between widths "
           "2,560 and 5,120); assumed for the pages' gather and products",
    host_us_per_op="assumed", gap_us_eager="assumed", gap_us_graph="assumed", loop_host_ms="assumed",
    ops_before="counted, bench/decode.py --section ops at a64386d", ops_after="counted, bench/decode.py --section ops",
    ops_after_outside="counted, bench/decode.py --section ops",
    hole_ops="counted in engine.paged_attention and _PagedLayer.write",
    attend_over="simulated, tests/test_cudagraphs.py's paper-like voter call (-s)",
    gather_copies="counted in engine.paged_attention", capture_ms="assumed",
    flex_copies="stated: a fused paged kernel reads each attended K/V byte once (unmeasured until bench/gpu.sh "
                "runs on a GPU)",
    buckets="simulated, tests/test_cudagraphs.py's paper-like voter call (two calls, 63 captures)",
    sample_bytes="counted in rollout.sample_next (fp32 on CUDA)", page="engine.PAGE['cuda']",
    kv_share_after="engine.KV_FRACTION",
    train_eff="the H200 run of docs/BENCHMARKS.md: 1312004's update, 3.0 PFLOP by its count in 22.3 s, 0.14 of "
              "989 TFLOP/s; assumed to hold for the packed update until bench/gpu.sh measures it",
    old_share="counted from grpo.update: 4 mini-batches per adapter at the paper's 2,048 calls",
    act_share="policies.ACTIVATION_SHARE (--grad-checkpointing auto)", token_budget="train.py's default",
    problems="the paper's settings (DESIGN.md)", rollouts="the paper's settings", cap="the paper's math cap",
)


def rows_that_fit(s, gpu, c, prompt, after, held=None):
    """Rows a stage holds at once: the KV share of the free memory after loading over what a row
    holds: before, its prompt + cap in tokens (dense rows); after, `held` tokens in whole pages
    (rows hold their own tokens: on average the prompt and E[len^2]/2E[len] of completion)."""
    kvb = 2 * s["layers"] * s["kv"] * s["head_dim"] * 2                        # bf16 K/V bytes a token
    free = gpu["hbm_gb"] * 1e9 - s["params"] * 2e9 - c["reserved_gb"] * 1e9
    budget = free * c["kv_share_after" if after else "kv_share_before"]
    page = c["page"] if after else 1
    return int(budget // (kvb * page)) // math.ceil(((held or prompt + c["cap"]) if after else prompt + c["cap"]) / page)


def lengths(c):
    """(E[len], E[len^2], the longest) of the generator completions: a lognormal cut at cap."""
    xs = [min(c["cap"], math.exp(math.log(c["median_len"]) + c["sigma"] * z / 10)) for z in range(-40, 41)]
    ws = [math.exp(-0.5 * (z / 10) ** 2) for z in range(-40, 41)]
    m1 = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    m2 = sum(w * x * x for w, x in zip(ws, xs)) / sum(ws)
    return m1, m2, c["cap"]


def stage(s, gpu, c, rows, prompt, mean, m2, longest, after, distinct):
    """Seconds of one stage: `rows` calls of `prompt` tokens and `mean` completions, `distinct`
    of the prompts prefilled (identical prompts are prefilled once), and (after) the graphs'
    captures."""
    kvb = 2 * s["layers"] * s["kv"] * s["head_dim"] * 2                        # bf16 K/V bytes a token
    weights = s["params"] * 2e9
    # rows at their limit: the conservative count (the tail below would count more rows' tail twice)
    S = max(1, min(rows, rows_that_fit(s, gpu, c, prompt, after)))
    g = s["heads"] // s["kv"]
    if after:
        attended = (prompt + m2 / (2 * mean)) * c["attend_over"]
        host = ((c["ops_after_outside"] + c["hole_ops"] * s["layers"]) * c["host_us_per_op"] * 1e-6
                + c["loop_host_ms"] * 1e-3)
        gap = c["gap_us_graph"]
        copies = c["gather_copies"]
    else:
        attended = (prompt + c["cap"]) * c["wmax_frac"]
        host = c["ops_before"] * s["layers"] / 28 * c["host_us_per_op"] * 1e-6
        gap = c["gap_us_eager"]
        copies = 1 + 2 * g                                                      # repeat_kv on 5.17
    kernels = (c["ops_after"] if after else c["ops_before"]) * s["layers"] / 28

    def step(n):
        sampler = c["sample_bytes"] if after else 60                           # fp32 now, float64 before
        moved = weights + n * attended * kvb * copies + n * 151936 * sampler
        device = moved / (gpu["tb_s"] * 1e12 * c["bw_eff"]) + kernels * gap * 1e-6 \
            + 2 * s["params"] * 1e9 * n / (gpu["tflops"] * 1e12 * 0.5)
        return max(host, device)
    full = rows * mean / S
    tail = longest
    decode = full * step(S) + tail * step(max(1, S // 4))
    # after: each row bucket captured once a process: its share of a 500-step run
    captures = c["buckets"] * c["capture_ms"] * 1e-3 / 500 if after else 0.0
    return decode + captures + prefill_s(s, gpu, c, distinct, prompt, after), S, step(S)


def prefill_s(s, gpu, c, prompts, length, after):
    """Seconds of prefilling `prompts` distinct prompts of `length` tokens: 2 x params FLOPs a
    token plus the attention (QK^T and PV, every head and layer): the full P x P square before
    (an explicit mask), half of it after (the causal kernel on right-padded prompts)."""
    square = 0.5 if after else 1.0
    flops = prompts * (2 * s["params"] * 1e9 * length
                       + square * 4 * length * length * s["heads"] * s["head_dim"] * s["layers"])
    return flops / (gpu["tflops"] * 1e12 * c["prefill_eff"])


MLP = {"0.6b": 3072, "1.7b": 6144, "4b": 9728}   # intermediate sizes (Qwen3's configs)


def checkpointed(s, gpu, c, scale):
    """Whether policies.checkpointing_plan turns gradient checkpointing on: a micro-batch's
    activations (policies.activation_bytes, bf16) above act_share of the memory free after the
    weights."""
    q, kv, h = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["hidden"]
    per = (6 * h + 4 * q + 4 * kv + 4 * MLP[scale]) * 2 + 4 * (2 * h + q + kv)
    free = gpu["hbm_gb"] * 1e9 - s["params"] * 2e9 - c["reserved_gb"] * 1e9
    return c["token_budget"] * s["layers"] * per > c["act_share"] * free


def update_s(s, gpu, c, samples, scale):
    """Seconds of the update: (tokens per sample, count) pairs through the passes grpo.update runs,
    in forward-sized passes of 2 x params FLOPs a token: the training forward, the backward to
    the activations (the base is frozen: one pass), the old logprobs' forward on `old_share` of
    the rows, a recompute where checkpointed (`checkpointed`); plus causal attention, 2 L^2 Hq D a
    layer a pass (its backward two passes); at `train_eff` of the bf16 peak."""
    passes = 2 + c["old_share"] + checkpointed(s, gpu, c, scale)
    flops = 0.0
    for tokens, n in samples:
        flops += n * (2 * s["params"] * 1e9 * tokens * passes
                      + 2 * tokens * tokens * s["heads"] * s["head_dim"] * s["layers"] * (passes + 1))
    return flops / (gpu["tflops"] * 1e12 * c["train_eff"])


def predict(scale, gpu_name, c, workflow, after):
    s, gpu = SCALES[scale], GPUS[gpu_name]
    mean, m2, longest = lengths(c)
    episodes = c["problems"] * c["rollouts"]
    voters = 3 if workflow == "voting" else 1
    # every voter and rollout of a problem gets the same prompt: one prefill a problem
    gen, S, ms = stage(s, gpu, c, voters * episodes, c["prompt"], mean, m2, longest, after, c["problems"])
    parts = {"generators": gen}
    samples = [(c["prompt"] + mean, voters * episodes)]
    if workflow == "voting":
        agg_prompt = 3 * min(mean, c["embed"]) + 512
        parts["aggregator"], _, _ = stage(s, gpu, c, episodes, agg_prompt, c["agg_len"], 2 * c["agg_len"] ** 2,
                                          4 * c["agg_len"], after, episodes)
        samples.append((agg_prompt + c["agg_len"], episodes))
    parts["update"] = update_s(s, gpu, c, samples, scale)
    return parts, S, ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflow", default="voting", choices=["voting", "single"], help="what a step runs")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="change an assumed constant")
    args = ap.parse_args()
    c = dict(CONSTANTS)
    for kv in args.set:
        k, v = kv.split("=")
        c[k] = type(c[k])(float(v))
    mean, m2, _ = lengths(c)
    print("constants (NAME=VALUE: where it comes from):")
    for k, v in c.items():
        print(f"  {k}={v:g}: {SOURCES.get(k, 'assumed')}{' (set here)' if v != CONSTANTS[k] else ''}")
    assert all(0 < c[k] <= 1 for k in ("bw_eff", "train_eff", "prefill_eff")), "an efficiency above 1"
    print("gpus:", ", ".join(f"{k} {v['hbm_gb']} GB {v['tb_s']} TB/s {v['tflops']} TFLOP/s bf16" for k, v in GPUS.items()))
    print(f"generator completions: mean {mean:.0f} tokens, a row in flight is {m2 / (2 * mean):.0f} past its prompt on average")
    agg = 3 * min(mean, c["embed"]) + 512
    held = {"generators": (c["prompt"], c["prompt"] + m2 / (2 * mean)), "aggregator": (agg, agg + c["agg_len"])}
    print(f"rows in flight the KV budget holds (pages of {c['page']}; every row at its limit / rows holding their "
          f"own mean tokens, {held['generators'][1]:.0f} and {held['aggregator'][1]:.0f}):")
    for sc in SCALES:
        print("  " + "; ".join(f"{sc} {g}: " + ", ".join(
            f"{k} {rows_that_fit(SCALES[sc], GPUS[g], c, p, True)} / {rows_that_fit(SCALES[sc], GPUS[g], c, p, True, h)}"
            for k, (p, h) in held.items()) for g in GPUS))
    print(f"\n{args.workflow}, {c['problems']} problems x {c['rollouts']} rollouts; minutes per training step (a prediction)")
    print(f"{'scale':5s} {'gpu':4s} {'code':6s} {'rows':>5s} {'ms/step':>8s} {'generators':>10s} {'aggregator':>10s} "
          f"{'update':>7s} {'step':>6s} {'500 steps':>9s}")
    flex = {**c, "gather_copies": c["flex_copies"]}        # "flex": "after" with a fused kernel's copies
    step = {}
    for scale in SCALES:
        for gpu in GPUS:
            for code, cc in (("before", c), ("after", c), ("flex", flex)):
                parts, S, ms = predict(scale, gpu, cc, args.workflow, code != "before")
                total = step[scale, gpu, code] = sum(parts.values())
                print(f"{scale:5s} {gpu:4s} {code:6s} {S:5d} {ms * 1e3:8.1f} "
                      f"{parts['generators'] / 60:10.1f} {parts.get('aggregator', 0) / 60:10.1f} "
                      f"{parts['update'] / 60:7.1f} {total / 60:6.1f} {total * 500 / 86400:7.1f} d")
    pages, fused = step["0.6b", "H200", "after"] / 60, step["0.6b", "H200", "flex"] / 60
    print(f"\n0.6b H200 {args.workflow} step at bw_eff {c['bw_eff']:g}: {pages:.1f} min with \"pages\" (gather_copies "
          f"{c['gather_copies']:g}), {fused:.1f} min with \"flex\" (flex_copies {c['flex_copies']:g})")


if __name__ == "__main__":
    main()
