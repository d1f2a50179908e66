#!/bin/bash
# The toy lab's studies (docs/RESULTS.md), one cell at a time on one core, run from a git worktree
# pinned at the studies' commit (40c8d1d): git worktree add --detach ../study 40c8d1d && bash results/lab.sh ../study
# Rerunning this script resumes: sweep.py skips done cells and resumes interrupted ones.
set -u
cd "${1:-.}"
S="python sweep.py --jobs 1 --tasks math"
C="--steps 60 --eval-every 10 --eval-problems 256"
A="$S --workflows voting --sharings isolated --lrs 2e-3"
for seed in 0 1 2; do
  $A --seeds $seed --axis n-voters=8,4,2,1 --out runs/amplification -- $C
  $A --seeds $seed --axis n-voters=8 --axis mini-batch=1024 --out runs/amplification-equal-steps -- $C
  $A --seeds $seed --axis n-voters=8 --out runs/amplification-frozen-aggregator -- $C --lr-role aggregator=0
  $A --seeds $seed --axis n-voters=4 --axis mini-batch=512 --out runs/amplification-equal-steps -- $C
  $A --seeds $seed --axis n-voters=4 --out runs/amplification-frozen-aggregator -- $C --lr-role aggregator=0
done
for seed in 0 1 2; do
  $S --workflows voting eval_opt --sharings shared --lrs 2e-3 --seeds $seed --axis toy-check=0,8,24 --out runs/capture -- $C
done
for seed in 0 1 2 3 4; do
  D="$S --sharings isolated --lrs 2e-3 --seeds $seed"
  $D --workflows orch_workers --out runs/damping/none -- $C
  $D --workflows orch_workers --out runs/damping/damp -- $C --coherence-damp worker=0.5
  $D --workflows orch_workers --out runs/damping/placebo -- $C --coherence-damp worker=0.5 --damp-placebo
  $D --workflows eval_opt --out runs/damping/none -- $C
  $D --workflows eval_opt --out runs/damping/damp -- $C --coherence-damp generator=0.5
  $D --workflows eval_opt --out runs/damping/placebo -- $C --coherence-damp generator=0.5 --damp-placebo
done
for seed in 0 1 2; do
  $S --workflows voting --sharings isolated --lrs 1e-3 --seeds $seed --axis n-voters=8,1 --out runs/amplification-lr1e-3 -- --steps 100 --eval-every 10 --eval-problems 256
done
echo "study: all done"
