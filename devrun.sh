#!/bin/bash
# untracked helper for one device call (deleted before the session ends)
mkdir -p $OUT/r
step() { local name=$1 t=$2; shift 2; echo "== $name"; local s=$(date +%s); timeout $t bash -c "$*" > $OUT/r/$name.log 2>&1; local rc=$?; echo "   rc=$rc $(( $(date +%s)-s ))s"; tail -n 3 $OUT/r/$name.log; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
step train 250 "python3 benchmarks/train_step.py --rounds 3 --out $OUT/r/train_step_h200.json"
step t_fused 140 "python3 -m pytest -p no:cacheprovider -m gpu -q tests/test_fused_gpu.py -k 'test_fused_matches_reference and (rmsnorm or swiglu_bwd or dgamma or residual)'"
