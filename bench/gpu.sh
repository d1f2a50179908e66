#!/usr/bin/env bash
# The checks to run when a GPU is lent (an H200 with torch 2.11 and transformers 5.17; this
# script installs nothing and reads nothing from the network). About 5 minutes in all.
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
#   DEVICE=cpu SCALES=tiny SLOTS=4 PROMPTS=16 NEW=16 NEW_EQUAL=8 PROMPT_LEN=12 bash bench/gpu.sh
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
# END OF THE SAMPLER SECTION. The training-step section goes below this line (added by
# the lead: one training step of Voting at the paper's settings at 0.6B, with its peak
# memory and step time).
# =====================================================================================
