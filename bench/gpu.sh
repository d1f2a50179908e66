#!/usr/bin/env bash
# The checks to run when a GPU is lent (an H200 with torch 2.11 and transformers 5.17; this
# script installs nothing and reads nothing from the network). About 9 minutes in all (an estimate:
# it has never run on a GPU): the sampler section (~5 minutes) and one training step (~3-4).
#
#   bash bench/gpu.sh 2>&1 | tee gpu.log
#
# Sampler section: greedy parity of rollout.generate with model.generate on the GPU (tiny fp32
# model), then at the Qwen3 0.6B, 1.7B and 4B shapes (random weights from the published configs,
# bf16) tokens/s and ratios of rollout.generate (continuous batching, a KV budget of $SLOTS rows)
# against lockstep batches of $SLOTS rows and model.generate in the same batches: an equal-length
# workload ($SLOTS rows x $NEW_EQUAL tokens) and a realistic one ($PROMPTS rows, lognormal
# lengths capped at $NEW). Each scale runs under a timeout (70 / 90 / 120 s, or $LIMIT), so the
# whole stays within about 5 minutes even if a scale is slower than planned: samplers print as
# they finish, continuous batching and model.generate first, the lockstep reference last.
#
# Check the script itself on a CPU with a tiny shape (seconds):
#   DEVICE=cpu SCALES=tiny SLOTS=4 PROMPTS=16 NEW=16 NEW_EQUAL=8 PROMPT_LEN=12 TRAIN_SCALE=tiny TRAIN_NEW=8 bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
SCALES=${SCALES:-"0.6b 1.7b 4b"}
SLOTS=${SLOTS:-256}        # rows held at once: the batch of 256
PROMPTS=${PROMPTS:-512}    # realistic workload: rows in all (2 lockstep batches)
NEW=${NEW:-512}            # realistic workload: cap of the lognormal row lengths
NEW_EQUAL=${NEW_EQUAL:-128}
PROMPT_LEN=${PROMPT_LEN:-200}  # longest prompt (a generator prompt of the paper)
LIMIT=${LIMIT:-}           # seconds per scale (default: 70 at 0.6b, 90 at 1.7b, 120 at 4b)
started=$SECONDS

echo "== environment"
python - <<'EOF'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"cuda {torch.cuda.is_available()} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

echo "== sampler: greedy parity with model.generate on $DEVICE"
timeout 60 python -u bench/generate.py --check --device "$DEVICE" || echo "PARITY FAILED (rc $?)"

for scale in $SCALES; do
  case $scale in 4b) limit=120 ;; 1.7b) limit=90 ;; *) limit=70 ;; esac
  echo "== sampler at $scale: rollout.generate vs model.generate vs lockstep ($(( SECONDS - started )) s so far)"
  timeout "${LIMIT:-$limit}" python -u bench/generate.py --device "$DEVICE" --config "$scale" --workload both \
      --slots "$SLOTS" --prompts "$PROMPTS" --new "$NEW" --equal-new "$NEW_EQUAL" --prompt-len "$PROMPT_LEN" \
      --samplers continuous,model.generate,lockstep --repeats 1 || echo "(scale $scale stopped: rc $?)"
done
echo "== sampler section done in $(( SECONDS - started )) s"

# =====================================================================================

# Training-step section: one step of Voting at the paper's settings (64 problems x 8 rollouts,
# LoRA r64, mini-batches of 512, Shared) at the Qwen3-0.6B shape with random weights and the
# toy tokenizer (bench/random_model.py). A random model never stops, so every completion runs
# to $TRAIN_NEW tokens (the paper's 5120 would take ~10x longer than the time this script
# has; the memory plan line shows what 5120 needs). --kl-coef 0.001 makes every row run the
# training forward and backward (with all-zero rewards the update would skip them all).
TRAIN_NEW=${TRAIN_NEW:-512}
TRAIN_LIMIT=${TRAIN_LIMIT:-300}
work=$(mktemp -d)
echo "== training step: Voting at the 0.6B shape, $TRAIN_NEW new tokens ($(( SECONDS - started )) s so far)"
python bench/random_model.py --config "${TRAIN_SCALE:-0.6b}" --out "$work/model"
timeout "$TRAIN_LIMIT" python -u train.py --scale "$work/model" --data toy_math --workflow voting --steps 1 \
    --eval-every 0 --eval-problems 16 --max-new-tokens "$TRAIN_NEW" --kl-coef 0.001 --save-every 0 \
    --samples-every 0 --device "$DEVICE" --quiet --out "$work/run" || echo "(training step stopped: rc $?)"
python - "$work/run/metrics.jsonl" <<'PY'
import json, sys
try:
    m = json.loads(open(sys.argv[1]).readline())
except (OSError, ValueError):
    sys.exit("no metrics.jsonl: the step did not finish")
t = m["time"]
print(f"step {t['step']:.1f} s (rollout {t['rollout']:.1f}, score {t['score']:.1f}, update {t['update']:.1f}), "
      f"{m['tokens_per_s']:.0f} rollout tokens/s, peak {m.get('cuda_peak_gib', float('nan')):.1f} GiB")
PY
rm -rf "$work"
echo "== all done in $(( SECONDS - started )) s"
