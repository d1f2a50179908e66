"""Compare two run folders number by number: are they the same run?

    python bench/compare_runs.py RUN_A RUN_B              # eval.jsonl, metrics.jsonl, samples.jsonl
    python bench/compare_runs.py RUN_A RUN_B --rel 1e-6   # the tolerance for gradient quantities

For each of eval.jsonl and samples.jsonl: byte-identical or not. For metrics.jsonl, every
number of every step: counts, rewards and lengths must be equal exactly; the gradient
quantities (norms, shares, cosines, coherence, damping) within --rel relative; wall-clock
fields (`time`, `tokens_per_s`, `cuda_peak_gib`) are skipped. Prints the largest relative
difference per kind of field and exits 1 when something differs beyond its tolerance.
"""
import argparse
import json
import os
import sys

CLOCK = {"time", "tokens_per_s", "cuda_peak_gib"}
NEAR = ("grad_norm", "grad_share", "cos", "coherence", "damp", "ratio_mean", "entropy", "logprob_gap",
        "clip_frac", "kl")   # fields computed from gradients or float token statistics


def leaves(x, path=()):
    """(path, value) of every number, string and bool in a nested record."""
    if isinstance(x, dict):
        for k, v in x.items():
            if k not in CLOCK:
                yield from leaves(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from leaves(v, path + (str(i),))
    else:
        yield path, x


def kind(path) -> str:
    return next((n for n in NEAR if any(n in p for p in path)), "exact")


def compare_metrics(a, b, rel):
    worst, bad = {}, []
    if len(a) != len(b):
        return worst, [f"metrics.jsonl: {len(a)} lines against {len(b)}"]
    for ra, rb in zip(a, b):
        la, lb = dict(leaves(ra)), dict(leaves(rb))
        if la.keys() != lb.keys():
            bad.append(f"step {ra.get('step')}: fields differ: {sorted(set(la) ^ set(lb))[:5]}")
            continue
        for p, x in la.items():
            y, k = lb[p], kind(p)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
                d = abs(x - y) / max(abs(x), abs(y), 1e-30)
                worst[k] = max(worst.get(k, 0.0), d)
                if (k == "exact" and x != y) or d > rel:
                    bad.append(f"step {ra.get('step')} {'/'.join(p)}: {x!r} vs {y!r}")
            elif x != y:
                bad.append(f"step {ra.get('step')} {'/'.join(p)}: {x!r} vs {y!r}")
    return worst, bad


def read(folder, name):
    path = os.path.join(folder, name)
    return open(path, "rb").read() if os.path.isfile(path) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="a run folder")
    ap.add_argument("b", help="another run folder")
    ap.add_argument("--rel", type=float, default=1e-6, help="relative tolerance of gradient quantities (default: %(default)s)")
    args = ap.parse_args()
    ok = True
    for name in ("eval.jsonl", "samples.jsonl"):
        x, y = read(args.a, name), read(args.b, name)
        same = x == y
        ok &= same
        lines = 0 if x is None else x.count(b"\n")
        print(f"{name}: {'byte-identical' if same else 'DIFFERENT'} ({lines} lines)")
    ma, mb = [[json.loads(line) for line in (read(f, "metrics.jsonl") or b"").splitlines() if line.strip()]
              for f in (args.a, args.b)]
    worst, bad = compare_metrics(ma, mb, args.rel)
    print(f"metrics.jsonl: {len(ma)} steps; largest relative difference by kind: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
    for line in bad[:20]:
        print("  differs:", line)
    ok &= not bad
    print("same run" if ok else "NOT the same run")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
