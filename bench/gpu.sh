#!/usr/bin/env bash
# The checks to run when a GPU is lent (an H200 with torch 2.11 and transformers 5.17; this script
# installs nothing and reads nothing from the network): one call of at most 8 minutes, every
# part under `timeout -k` (train.py finishes its step on SIGTERM, so each part is killed 10 s
# after its limit), the most wanted figures first.
#
#   bash bench/gpu.sh 2>&1 | tee gpu.log       # on the GPU
#   bash bench/gpu.sh --tiny                   # every section on this CPU with tiny shapes (~1 minute)
#
# 1. one training step, Voting at the paper's batch (64 problems x 8 rollouts, LoRA r64, Shared)
#    at the Qwen3-0.6B shape with random weights and the toy tokenizer (bench/random_model.py):
#    the step's time and parts, and the update's own peak memory (bench/train_step.py: the KV
#    cache is handed back before the update). A random model never stops, so every completion
#    runs to $TRAIN_NEW tokens; --kl-coef 0.001 makes every row run the update.
# 2. the decode step in the paper's regime (bench/decode.py --section paper): the 0.6B shape
#    with LoRA r64, 120 rows, W = 512 / 2,560 / 5,120: ms per step (CUDA graphs on), and the
#    kernel-launching ops and host syncs per step.
# 3. the sampler: greedy parity with model.generate, then tokens/s of engine.generate against
#    model.generate on a realistic workload (bench/generate.py).
# At the end, one summary table, also written to $OUT/gpu-summary.txt ($OUT: the device tool's
# output folder; the current folder when unset).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--tiny" ]; then
  DEVICE=cpu SCALE=tiny TRAIN_NEW=8 TRAIN_PROBLEMS=4 ROWS=4 WIDTHS="64 128" STEPS=4
  SLOTS=8 PROMPTS=32 NEW=16
else
  DEVICE=cuda SCALE=0.6b TRAIN_NEW=${TRAIN_NEW:-512} TRAIN_PROBLEMS=64 ROWS=120 WIDTHS="512 2560 5120" STEPS=16
  SLOTS=128 PROMPTS=512 NEW=256
fi
OUT=${OUT:-.}
mkdir -p "$OUT"
summary="$OUT/gpu-summary.txt"
: > "$summary"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
row() { printf '%-44s %s\n' "$1" "$2" >> "$summary"; }
part() { echo "== $1 ($(( SECONDS - started )) s so far)"; }
limit() { local s=$1; shift; timeout -k 10 "$s" "$@"; }   # SIGTERM at the limit, SIGKILL 10 s later

part "environment"
python - <<'EOF' | tee "$work/env"
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}")
EOF
row "environment" "$(cat "$work/env")"

part "1. one training step at the $SCALE shape, Voting, $TRAIN_PROBLEMS problems x 8, $TRAIN_NEW new tokens"
limit 40 python bench/random_model.py --config "$SCALE" --out "$work/model" || row "training step" "no model (rc $?)"
limit 190 python -u bench/train_step.py --scale "$work/model" --data toy_math --workflow voting --steps 1 \
    --problems-per-step "$TRAIN_PROBLEMS" --eval-every 0 --eval-problems 8 --max-new-tokens "$TRAIN_NEW" \
    --kl-coef 0.001 --save-every 0 --samples-every 0 --device "$DEVICE" --quiet --out "$work/run" \
    2>&1 | tee "$work/train.log" | grep -E "^(memory|update|rollout):|Error|error" ; echo "(rc ${PIPESTATUS[0]})"
python - "$work/run/metrics.jsonl" "$work/train.log" >> "$summary" <<'PY'
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
PY

part "2. decode step in the paper's regime: $SCALE shape, LoRA r64, $ROWS rows, W = $WIDTHS"
limit 90 python -u bench/decode.py --section paper --device "$DEVICE" --config "$SCALE" --rows "$ROWS" \
    --widths $WIDTHS --steps "$STEPS" --json "$work/paper.json" || echo "(stopped: rc $?)"
python - "$work/paper.json" >> "$summary" <<'PY'
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

part "3. sampler: parity with model.generate, then tokens/s"
limit 30 python -u bench/generate.py --check --device "$DEVICE" | tee "$work/parity"
row "greedy parity with model.generate" "$(tail -1 "$work/parity")"
limit 60 python -u bench/generate.py --device "$DEVICE" --config "$SCALE" --workload realistic --slots "$SLOTS" \
    --prompts "$PROMPTS" --new "$NEW" --samplers continuous,model.generate --repeats 1 | tee "$work/sampler"
row "sampler tok/s: continuous vs model.generate" "$(grep -E '^  (continuous|model.generate) ' "$work/sampler" | \
    awk '{printf "%s %s  ", $1, $2}') $(grep -o 'continuous = .*' "$work/sampler")"

echo "== summary ($(( SECONDS - started )) s; also in $summary)"
cat "$summary"
