#!/bin/bash
# stop_by.sh HH:MM [PATTERN] [EVAL_SECONDS]: stop a study's train.py runs so that each saves
# ckpt-last by HH:MM (UTC today), having lost as few steps as its step time allows.
#   It first kills the drivers, the scripts that would start the next cell (every process whose
#   command line matches the regex $DRIVERS, by default `lab\.sh`: results/lab.sh), then
#   sends each running `train.py --` whose command line matches PATTERN one SIGINT during the last
#   step that can end before HH:MM: train.py finishes that step, saves and exits 130, and
#   `--resume` (or the same sweep.py command) continues from there. The step time is the median
#   of the run's metrics.jsonl; a step ending in an evaluation (--eval-every) adds EVAL_SECONDS
#   (default 600). A run in its last step is left to finish. Run it with nohup, early.
set -u
[ $# -ge 1 ] || { echo "usage: stop_by.sh HH:MM [PATTERN] [EVAL_SECONDS]" >&2; exit 2; }
deadline=$(date -u -d "today $1" +%s) || exit 2
pattern=${2:-.}; eval_s=${3:-600}; margin=60
[ "$deadline" -gt "$(date +%s)" ] || { echo "stop_by.sh: $1 UTC has passed" >&2; exit 2; }
pkill -KILL -f -- "${DRIVERS:-lab\.sh}" && echo "$(date -u +%T) drivers killed"
declare -A sent
ev() { [ "$every" -gt 0 ] && [ $(($1 % every)) -eq 0 ] && echo "$eval_s" || echo 0; }   # step $1's evaluation
matching() {   # the pids of the runs PATTERN names
  for pid in $(pgrep -f "train.py --"); do
    [[ $(tr '\0' ' ' 2>/dev/null < /proc/$pid/cmdline) =~ $pattern ]] && echo "$pid"
  done
}
while pids=$(matching); [ -n "$pids" ]; do
  for pid in $pids; do
    cmd=$(tr '\0' ' ' 2>/dev/null < /proc/$pid/cmdline) || continue
    [ -n "${sent[$pid]:-}" ] && continue
    out=$(sed -E 's/.*--out ([^ ]+).*/\1/' <<< "$cmd")
    # the command line goes by the environment: in argv it would make this helper a "train.py --" process
    read -r last steps every med < <(RUN_CMD=$cmd RUN_OUT=$out python3 - <<'PY'
import json, os, re, statistics
out, cmd = os.environ["RUN_OUT"], os.environ["RUN_CMD"]
flag = lambda name, d: int(re.search(rf"--{name} (\d+)", cmd).group(1)) if re.search(rf"--{name} (\d+)", cmd) else d
try:
    records = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
except OSError:
    records = []
times = [r["time"]["step"] for r in records]
print(records[-1]["step"] if records else 0, flag("steps", 0), flag("eval-every", 0),
      int(statistics.median(times)) if times else 600)
PY
)
    now=$(date +%s); mtime=$(stat -c %Y "$out/metrics.jsonl" 2>/dev/null || echo "$now")
    cur=$((last + 1)); [ "$steps" -gt 0 ] && [ "$cur" -ge "$steps" ] && continue   # its last step: let it finish
    end_cur=$((mtime + $(ev "$last") + med)); [ "$end_cur" -lt "$now" ] && end_cur=$now
    end_next=$((end_cur + $(ev "$cur") + med + $(ev $((cur + 1))) + margin))
    if [ "$end_next" -gt "$deadline" ]; then
      kill -INT "$pid" && sent[$pid]=1
      echo "$(date -u +%T) SIGINT to $pid in step $cur ($(basename "$out"), median step ${med}s): saves about $(date -u -d @$((end_cur + $(ev "$cur"))) +%T)"
    fi
  done
  sleep 15
done
echo "$(date -u +%T) no run left"
