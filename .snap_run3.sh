#!/usr/bin/env bash
# session 6 run 3 (2xH200): bench_train at the recipe (128k tokens in 4 passes), both backends, 2 rounds; every GPU test (2 ranks); bench_attention
out=$1; mkdir -p $out
t0=$(date +%s)
TRAIN_TIMEOUT=290 TRAIN_ARGS="--steps 3 --warmup 1 --window 3 --rounds 2 --tag session6" bash launch/gpu_checks.sh $out train; echo "$(( $(date +%s)-t0 ))s"
TESTS="tests/" TESTS_TIMEOUT=200 bash launch/gpu_checks.sh $out tests; echo "$(( $(date +%s)-t0 ))s"
grep -hE "^FAILED|passed|failed" $out/tests_r0.log | tail -6
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 60 python benchmarks/bench_attention.py --out $out > $out/attn.log 2>&1; echo "attn rc=$? $(( $(date +%s)-t0 ))s"; tail -6 $out/attn.log
cd $out && tar -czf ../all.tgz --exclude=tcache.tgz . && mv ../all.tgz ./all.tgz; ls
