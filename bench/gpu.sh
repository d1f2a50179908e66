#!/usr/bin/env bash
# The checks to run when a GPU is lent (an H200 with torch 2.11 and transformers 5.17; this script
# installs nothing and reads nothing from the network): one call of at most 8 minutes, every
# part under `timeout -k` (train.py finishes its step on SIGTERM, so each part is killed 10 s
# after its limit), the most wanted figures first.
#
#   bash bench/gpu.sh 2>&1 | tee $OUT/gpu.log   # on the GPU
#   bash bench/gpu.sh --tiny                    # every section on this CPU with tiny shapes (~2 minutes)
#   PARTS="sdpa decode" bash bench/gpu.sh       # some sections, in that order (voting train sampler decode sdpa)
#
# voting: a paper-like Voting generation at the 0.6B shape (bench/generate.py --workload voting):
#    $VOTING_PROBLEMS problems (default 32, half the paper's 64, so that both timings below fit
#    the part's 180 s; VOTING_PROBLEMS=64 for the paper's) x 8 rollouts, prompts of 150-350
#    tokens, completions lognormal (median 410, sigma 0.9) cut at 2,048, each row's limit its
#    drawn length (random weights never stop), one engine.generate call in the default KV budget
#    with each decode attention, "pages" (the CUDA default) then "flex" (FlexAttention's fused
#    paged kernel, compiled for every row count before its call), on the same prompts and
#    lengths: tokens/s, the share of peak bandwidth the bytes a decode needs (weights once a step,
#    each row's own K/V) reach, flex's tokens/s over pages', and why flex fell back to pages if
#    it did. The default parts are voting, train and sampler (under 8 minutes); decode and sdpa
#    run when PARTS names them.
# train: one training step, Voting at the paper's batch (64 problems x 8 rollouts, LoRA r64, Shared)
#    at the Qwen3-0.6B shape with random weights and the toy tokenizer (bench/random_model.py,
#    built on the device): the step's time and parts, the update's peak memory and what was held
#    as it began (bench/train_step.py: the KV cache is handed back before the update; the weights
#    and the kept decode graphs stay), and what the decode graphs did (captured, replayed or
#    eager, and why). A random model never stops, so every completion runs to $TRAIN_NEW
#    tokens. KL 0, as the paper: a random model is never right, so
#    bench/train_step.py --keyed-grades grades by a hash of the final text, so rewards vary within
#    a group and the update works; it prints the update's useful TFLOP/s and share of peak.
# decode: the decode step in the paper's regime (bench/decode.py --section paper): the 0.6B
#    shape with LoRA r64, 120 rows, W = 512 / 2,560 / 5,120: ms per step (CUDA graphs on), and
#    the kernel-launching ops and host syncs per step.
# sampler: greedy parity with model.generate, sampled rows replayed from CUDA graphs against the
#    same call stepped eagerly (equal tokens), how long the host waits to upload a decode step's
#    numbers behind queued work (pageable memory against engine._Upload's pinned buffers), then
#    tokens/s of engine.generate against model.generate on a realistic workload of 256 prompts
#    (half of 512, to leave the voting part its time; bench/generate.py; rows stop at lognormal
#    lengths, so the row groups change as in a real call: graph captures per call are counted).
# sdpa: the SDPA kernel PyTorch picks at each call site (decode, prefill, training) and each
#    kernel's time there, first call on a new shape and steady (bench/sdpa.py).
# At the end, one summary table, also written to $OUT/gpu-summary.txt ($OUT: the device tool's
# output folder; the current folder when unset); a part that fails leaves its log in $OUT.
# $PY is the Python to run (default python3: the GPU machine has no `python`).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
PARTS=${PARTS:-voting train sampler}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1   # nothing is fetched, output as it comes
if [ "${1:-}" = "--tiny" ]; then
  DEVICE=cpu SCALE=tiny TRAIN_NEW=8 TRAIN_PROBLEMS=4 ROWS=4 WIDTHS="64 128" STEPS=4
  SLOTS=8 PROMPTS=32 NEW=16 SDPA="--config tiny --prompt-len 48 --new 8 --shapes 2 --repeats 3"
  VOTING="--problems 4 --rollouts 8 --new 64 --peak-tb-s 0.05 --attend pages,flex"
else
  DEVICE=cuda SCALE=0.6b TRAIN_NEW=${TRAIN_NEW:-256} TRAIN_PROBLEMS=64 ROWS=120 WIDTHS="512 2560 5120" STEPS=16
  SLOTS=128 PROMPTS=256 NEW=256 SDPA="--config 0.6b"
  VOTING="--problems ${VOTING_PROBLEMS:-32} --rollouts 8 --new 2048 --attend pages,flex"
fi
OUT=${OUT:-.}
mkdir -p "$OUT"
summary="$OUT/gpu-summary.txt"
: > "$summary"
work=$(mktemp -d)
# a failed part's log is what tells why: copy the logs out before the work folder goes
trap 'cp "$work"/train.log "$work"/sdpa.json "$OUT"/ 2>/dev/null; cp "$work"/run/metrics.jsonl "$OUT"/train-metrics.jsonl 2>/dev/null; rm -rf "$work"' EXIT
started=$SECONDS
row() { printf '%-44s %s\n' "$1" "$2" >> "$summary"; }
part() { echo "== $1 ($(( SECONDS - started )) s so far)"; }
limit() { local s=$1; shift; timeout -k 10 "$s" "$@"; }   # SIGTERM at the limit, SIGKILL 10 s later

part "environment"
$PY - <<'EOF' | tee "$work/env"
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}, "
      f"cuDNN {torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}")
EOF
row "environment" "$(cat "$work/env")"

run_train() {
part "train: one training step at the $SCALE shape, Voting, $TRAIN_PROBLEMS problems x 8, $TRAIN_NEW new tokens"
limit 40 $PY bench/random_model.py --config "$SCALE" --device "$DEVICE" --out "$work/model" || row "training step" "no model (rc $?)"
limit 180 $PY -u bench/train_step.py --scale "$work/model" --data toy_math --workflow voting --steps 1 \
    --problems-per-step "$TRAIN_PROBLEMS" --eval-every 0 --eval-problems 8 --max-new-tokens "$TRAIN_NEW" \
    --kl-coef 0 --keyed-grades --save-every 0 --samples-every 0 --device "$DEVICE" --quiet --out "$work/run" \
    2>&1 | tee "$work/train.log" | grep -E "^(memory|update|rollout|engine):|Error|error" ; echo "(rc ${PIPESTATUS[0]})"
$PY - "$work/run/metrics.jsonl" "$work/train.log" >> "$summary" <<'PY'
import json, re, sys
try:
    m = json.loads(open(sys.argv[1]).readline())
    t = m["time"]
    print(f"{'training step (s)':44s} {t['step']:.1f} = rollout {t['rollout']:.1f} + score {t['score']:.1f} "
          f"+ update {t['update']:.1f}; {m['tokens_per_s']:.0f} rollout tokens/s")
except (OSError, ValueError, KeyError):
    print(f"{'training step':44s} did not finish")
found = re.findall(r"update: .*", open(sys.argv[2]).read())
print(f"{'update alone (KV cache freed)':44s} {found[-1][8:] if found else 'not reached'}")
found = re.findall(r"engine: .*", open(sys.argv[2]).read())
print(f"{'decode graphs in the training step':44s} {found[-1][8:] if found else 'not reached'}")
PY
}

run_voting() {
part "voting: a paper-like Voting generation, $SCALE shape, $VOTING"
limit 180 $PY -u bench/generate.py --device "$DEVICE" --config "$SCALE" --workload voting $VOTING --median 0.2 \
    --sigma 0.9 --samplers continuous | tee "$work/voting"
for a in pages flex; do
  line=$(grep -o "^voting $a: .*" "$work/voting" | cut -c$(( 10 + ${#a} ))-)
  row "voting generation, $a" "${line:-did not finish}"
done
line=$(grep -o '^voting flex / pages: .*' "$work/voting" | cut -c22-)
row "voting tokens/s, flex / pages" "${line:-not reached}"
row "decode graphs in the voting generation" "$(grep -o 'engine: .*' "$work/voting" | tail -1 | cut -c9-)"
}

run_decode() {
part "decode: the decode step in the paper's regime: $SCALE shape, LoRA r64, $ROWS rows, W = $WIDTHS"
limit 60 $PY -u bench/decode.py --section paper --device "$DEVICE" --config "$SCALE" --rows "$ROWS" \
    --widths $WIDTHS --steps "$STEPS" --json "$work/paper.json" || echo "(stopped: rc $?)"
$PY - "$work/paper.json" >> "$summary" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(print(f"{'decode step':44s} did not finish"))
for k, v in r.items():
    if isinstance(v, dict):
        print(f"{'decode ms/step, ' + k:44s} {v['ms_per_step']:.2f}")
print(f"{'decode kernel-launching ops / syncs per step':44s} {r.get('ops_per_step', float('nan')):.0f} / "
      f"{r.get('syncs_per_step', float('nan')):.2f}")
PY
}

run_sampler() {
part "sampler: parity with model.generate and of graphs with eager steps, then tokens/s"
limit 30 $PY -u bench/generate.py --check --device "$DEVICE" | tee "$work/parity"
row "greedy parity with model.generate" "$(grep '^parity on' "$work/parity")"
row "sampled rows, graphs against eager" "$(grep '^graphs against' "$work/parity")"
row "a step's upload behind queued work" "$(grep '^upload of' "$work/parity" | cut -d: -f2-)"
limit 70 $PY -u bench/generate.py --device "$DEVICE" --config "$SCALE" --workload realistic --slots "$SLOTS" \
    --prompts "$PROMPTS" --new "$NEW" --samplers continuous,model.generate --repeats 1 | tee "$work/sampler"
row "sampler tok/s: continuous vs model.generate" "$(grep -E '^  (continuous|model.generate) ' "$work/sampler" | \
    awk '{printf "%s %s  ", $1, $2}') $(grep -o 'continuous = .*' "$work/sampler")"
row "decode graphs in the sampler run" "$(grep -o 'engine: .*' "$work/sampler" | tail -1 | cut -c9-)"
}

run_sdpa() {
part "sdpa: the kernel picked at each attention call site, and each kernel's time there"
limit 90 $PY -u bench/sdpa.py --device "$DEVICE" $SDPA --json "$work/sdpa.json" | tee "$work/sdpa"
$PY - "$work/sdpa.json" >> "$summary" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(print(f"{'SDPA call sites':44s} did not finish"))
def ms(first, steady):
    return "n/a" if first is None else f"{first:.2f}/{steady:.3f}"
for site, v in r.items():
    times = "  ".join(f"{b} {ms(v['ms_first_new_shape'][b], v['ms_steady'][b])}" for b in v.get("ms_steady", {}))
    print(f"{'SDPA ' + site + ': chosen; ms new shape/steady':44s} {v['chosen']}  {times}")
PY
}

for p in $PARTS; do "run_$p"; done

echo "== summary ($(( SECONDS - started )) s; also in $summary)"
cat "$summary"
