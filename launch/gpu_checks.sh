#!/usr/bin/env bash
# The GPU tiers and benchmarks in one go (run from the repository root):
#   bash launch/gpu_checks.sh [OUT_DIR] [tests|cute|comm|train|planner|gemm|push|kda|conv|router|glu|tiles|kdabwd|attnres|lmloss|gradacc|writeback|gatenorm|kdakernels|kdacounters|opsites|outputcode|optim|determinism|ckpt|dense|mfu|k3|k3ab|k3ref|overlap|learning|warmup|firststep|pool|graph|entries ...]
#   (default: the first four, in order; comm and train need 2 GPUs; push, kda, conv, router, glu, tiles, kdabwd, attnres, lmloss, gradacc, writeback, gatenorm, kdakernels, kdacounters, opsites, outputcode,
#   optim, determinism, ckpt, dense, mfu, k3, k3ab, k3ref, overlap, warmup, firststep, pool, graph and entries run on one GPU)
# tests: on one GPU the single-GPU tier (`pytest -m "gpu or multigpu"`, the multigpu tests skip) in TEST_WORKERS
# (default 4) pytest-xdist workers sharing the GPU, whole files per worker, TEST_LIMIT s (default 300) per test
# with pytest-timeout, TESTS_TIMEOUT s (default 600) in all, one log OUT_DIR/tests.log; serial where xdist is
# absent. On 2+ GPUs the tier under torchrun --nproc_per_node=2, one log per rank (OUT_DIR/tests_r<rank>.log).
# Environment: TESTS (pytest paths, default tests/), TESTS_TIMEOUT / COMM_TIMEOUT / TRAIN_TIMEOUT /
# PLANNER_TIMEOUT / GEMM_TIMEOUT / KDA_TIMEOUT / ROUTER_TIMEOUT / TILES_TIMEOUT / KDABWD_TIMEOUT / ATTNRES_TIMEOUT / LMLOSS_TIMEOUT / GRADACC_TIMEOUT / WRITEBACK_TIMEOUT / GATENORM_TIMEOUT / KDAK_TIMEOUT / KDAC_TIMEOUT / OPSITES_TIMEOUT / OPTIM_TIMEOUT / DET_TIMEOUT / CKPT_TIMEOUT / DENSE_TIMEOUT / MFU_TIMEOUT / K3_TIMEOUT (s), MFU_ARGS / K3_ARGS (extra overrides for the mfu / k3 steps), K3_AB_ARGS (the overrides k3ab measures against main), LEARNING_ARGS (overrides for the learning step's runs, e.g. kernels.kda_gate_norm=fla), REF_TREE (k3ref: a tar.xz of the commit it measures this tree against), K3REF_ROWS (k3ref's rows: 131k
# recipe_batch, the default, or one of them), K3REF_ARGS (extra overrides for k3ref's run of this tree, e.g. kernels.router=auto), OPSITES_ARGS (extra op_sites.py arguments for the opsites / outputcode steps, e.g. --op add), DET_ONLY (runs of check_determinism, default A,B,P,C,D), GEMM_ARGS (bench_expert_gemm.py arguments, e.g. --shapes k3_small --merged-only), COMM_ARGS (bench_comm.py
# arguments instead of --experts 96 384, e.g. --shapes k3), TRAIN_ARGS (extra bench_train.py arguments), PLANNER_ARGS (bench_planner.py arguments, e.g.
# --experts 896 --topk 16 --ranks 8).
# PACK_OUT=1 packs OUT's files (the Triton cache's parts aside) into OUT/results.tar.xz at exit.
# Every step has its own time limit so one hang cannot eat the rest.
set -uo pipefail
out="${1:-gpu_out}"; shift || true
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests cute comm train)
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}"  # set -u: setup.sh reads it
[ -f .device/setup.sh ] && source .device/setup.sh  # CuTe DSL; extends PYTHONPATH (never overwrite it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT_DIR="$out"
num_gpus=$(python -c "import torch; print(torch.cuda.device_count())")
tests_limit=${TESTS_TIMEOUT:-$([ "$num_gpus" -ge 2 ] && echo 480 || echo 600)}
export FAULT_S=$(( tests_limit * 3 / 4 ))  # a hung test dumps its stack before the step's time limit
# Triton's compile cache travels in parts of < 16 MB (the most a returned file may have): .device/tcache/part-*
# in (the kit folder, carried), OUT/tcache/part-* out; copy those into .device/tcache/ for the next call. A cold
# cache costs minutes per fresh machine (torch.compile's, moonep's and fla's kernels; fla's tile searches)
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/moonep_triton_cache}"
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".device/tcache/part-*" > /dev/null; then cat .device/tcache/part-* | tar -xz -C "$TRITON_CACHE_DIR"; fi
python -m moontrain.trainer.kernel_cache  # fla's tile choices for k3_small's KDA heads, where missing (its README)
save_cache() {
  mkdir -p "$out/tcache" && tar -cz -C "$TRITON_CACHE_DIR" . 2>/dev/null | split -b 15000000 -d -a 2 - "$out/tcache/part-"
}
# PACK_OUT=1: every other file under OUT into one OUT/results.tar.xz at exit (a lent device machine returns at most 8
# files; a multi-step call writes more, and the rest would be lost)
pack_out() {
  local list; list=$(mktemp)
  ( cd "$out" && find . -type f ! -path './tcache/*' ! -name results.tar.xz -print0 > "$list" &&
    tar -cJf results.tar.xz --null -T "$list" && xargs -0 rm -f < "$list" ); rm -f "$list"
}
finish() { save_cache; [ "${PACK_OUT:-0}" = 1 ] && pack_out; }
# the kits' packages (.device/setup.sh installs them without bytecode) and this tree byte-compiled, as a pip install
# and a first run leave them (else the first processes to import a module compile it at once: firststep, pool)
byte_compile() { python -m compileall -q -j 0 ${PYTHONPATH//:/ } > /dev/null 2>&1; }
trap finish EXIT
for step in "${steps[@]}"; do
  case "$step" in
    tests) if [ "$num_gpus" -ge 2 ]; then
             timeout "$tests_limit" torchrun --nproc_per_node=2 --no-python bash -c \
               'python -m pytest -v -s --tb=short --durations=15 -o faulthandler_timeout=$FAULT_S -m "gpu or multigpu" ${TESTS:-tests/} \
                  > "$OUT_DIR/tests_r$LOCAL_RANK.log" 2>&1'
             echo "tests rc=$?"; grep -hE "passed|failed|^FAILED" "$out"/tests_r*.log | tail -4
           else  # SIGINT first: pytest stops and still writes its summary and durations
             opts=()
             python -c "import xdist" 2>/dev/null && opts+=(-n "${TEST_WORKERS:-4}" --dist loadfile)
             python -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout "${TEST_LIMIT:-300}")
             timeout -s INT -k 20 $(( tests_limit - 20 )) python -m pytest -v --tb=short --durations=15 \
               -o faulthandler_timeout="$FAULT_S" "${opts[@]}" -m "gpu or multigpu" ${TESTS:-tests/} > "$out/tests.log" 2>&1
             echo "tests rc=$? (one GPU; ${opts[*]:-serial, no pytest-xdist})"
             grep -E "^=+ ([0-9]+ [a-z]+|no tests ran).* in [0-9.]+s" "$out/tests.log" | tail -1
             grep -E "^(FAILED|ERROR) " "$out/tests.log" | head -20
             grep -A15 "slowest 15 durations" "$out/tests.log" | grep -E "^[0-9.]+s "
           fi ;;
    cute)  timeout 120 python -m pytest -q -m gpu experiments/cute_planner/test_cute_planner_gpu.py -s > "$out/cute.log" 2>&1
           echo "cute rc=$?"; tail -3 "$out/cute.log" ;;
    comm)  timeout "${COMM_TIMEOUT:-400}" torchrun --nproc_per_node=2 benchmarks/bench_comm.py ${COMM_ARGS:---experts 96 384} \
             --iters 7 --out "$out" > "$out/comm.log" 2>&1
           echo "comm rc=$?"; grep -v "^\[rank" "$out/comm.log" | tail -14 ;;
    train) timeout "${TRAIN_TIMEOUT:-400}" torchrun --nproc_per_node=2 benchmarks/bench_train.py --recipe recipes/k3_small_moe.yaml \
             --steps 5 --warmup 2 --out "$out" ${TRAIN_ARGS:-} > "$out/train.log" 2>&1
           echo "train rc=$?"; grep -v "^\[rank" "$out/train.log" | tail -10 ;;
    planner) timeout "${PLANNER_TIMEOUT:-300}" python benchmarks/bench_planner.py ${PLANNER_ARGS:-} --out "$out" > "$out/planner.log" 2>&1
           echo "planner rc=$?"; tail -12 "$out/planner.log" ;;
    gemm)  timeout "${GEMM_TIMEOUT:-300}" python benchmarks/bench_expert_gemm.py ${GEMM_ARGS:-} --out "$out" > "$out/expert_gemm.log" 2>&1
           echo "gemm rc=$?"; tail -40 "$out/expert_gemm.log" ;;
    push)  timeout "${PUSH_TIMEOUT:-400}" python benchmarks/bench_push_reduce.py --out "$out" > "$out/push_reduce.log" 2>&1
           echo "push rc=$?"; tail -40 "$out/push_reduce.log" ;;
    kda)   timeout "${KDA_TIMEOUT:-600}" python -m pytest -v -m gpu tests/moontrain/model/kda/test_layer_gpu.py \
             tests/moontrain/model/kda/test_chunk_gpu.py tests/moontrain/model/kda/test_layer_compile_gpu.py \
             > "$out/kda.log" 2>&1
           echo "kda rc=$?"; grep -hE "PASSED|FAILED|passed|failed" "$out/kda.log" | tail -6
           timeout "${KDA_TIMEOUT:-600}" python benchmarks/bench_kda.py --out "$out/bench_kda.json" > "$out/bench_kda.log" 2>&1
           echo "bench_kda rc=$?"; tail -10 "$out/bench_kda.log" ;;
    optim) timeout "${OPTIM_TIMEOUT:-400}" python benchmarks/bench_optim.py --recipe recipes/k3_small.yaml --steps 5 --warmup 2 \
             --out "$out/bench_optim_k3_small.json" parallel.ep=1 experts.backend=local train.micro_batch_size=1 > "$out/optim.log" 2>&1
           echo "optim rc=$?"; tail -6 "$out/optim.log" ;;
    determinism)  # checkpoints (~44 GB for k3_small) in RAM when /dev/shm holds them
           work=/tmp/moontrain_det; [ "$(df -k --output=avail /dev/shm | tail -1)" -gt 62000000 ] && work=/dev/shm/moontrain_det
           timeout "${DET_TIMEOUT:-900}" python benchmarks/check_determinism.py --recipe recipes/k3_small.yaml --steps 6 --work "$work" \
             --only "${DET_ONLY:-A,B,P,C,D}" --out "$out/determinism_k3_small.json" parallel.ep=1 train.micro_batch_size=1 train.compile=false > "$out/determinism.log" 2>&1
           echo "determinism rc=$?"; grep -E "bitwise|differ|step time" "$out/determinism.log" | tail -6; rm -rf "$work" ;;
    ckpt)  timeout "${CKPT_TIMEOUT:-590}" python -m pytest -q -m gpu tests/moontrain/checkpoint/test_streaming_io.py > "$out/ckpt_tests.log" 2>&1
           echo "ckpt tests rc=$?"; tail -2 "$out/ckpt_tests.log"
           timeout "${CKPT_TIMEOUT:-590}" python benchmarks/bench_checkpoint.py --device cuda --gb 20 --repeats 2 \
             --out "$out/bench_checkpoint_1xh200.json" > "$out/bench_checkpoint.log" 2>&1
           echo "bench_checkpoint rc=$?"; tail -8 "$out/bench_checkpoint.log" ;;
    dense) timeout "${DENSE_TIMEOUT:-400}" python -m pytest -q -m gpu tests/moontrain/parallel/test_plain_dense_gpu.py > "$out/dense_tests.log" 2>&1
           echo "dense tests rc=$?"; tail -2 "$out/dense_tests.log"
           for d in fsdp plain; do
             timeout "${DENSE_TIMEOUT:-400}" torchrun --nproc_per_node=1 benchmarks/bench_train.py --recipe recipes/k3_small.yaml \
               --backends moonep --targets 0.2 --steps 3 --warmup 2 --window 3 --tag "k3_small_dense_$d" --out "$out" \
               parallel.ep=1 train.micro_batch_size=1 train.compile=true parallel.fsdp_reshard_after_forward=false \
               parallel.dense=$d > "$out/dense_$d.log" 2>&1
             echo "bench_train dense=$d rc=$?"; grep -v "^\[rank" "$out/dense_$d.log" | tail -4
           done ;;
    firststep) # where a cold launch's time goes before and in its first step (k3_small, EP = 1, empty caches each run): the
           # launch with the shipped warm-up manifest and without a warm-up, every console line stamped with the seconds
           # since the launch (OUT/firststep_{shipped,none}.log); then the worker alone under cProfile for one step
           # (OUT/firststep.prof; the 40 largest cumulative entries printed), which names what the first step's line
           # cannot split (docs/performance.md). FIRSTSTEP_ARGS: extra overrides; FIRSTSTEP_RUNS (default "shipped:auto
           # none:none", name:train.kernel_warmup pairs); FIRSTSTEP_PROF=0 skips the cProfile run
           byte_compile
           since() { awk -v now="$(date +%s.%N)" -v t0="$1" 'BEGIN { printf "%7.1f", now - t0 }'; }
           fl="recipes/k3_small.yaml parallel.ep=1 checkpoint.save_final=false checkpoint.resume=none ${FIRSTSTEP_ARGS:-}"
           for run in ${FIRSTSTEP_RUNS:-shipped:auto none:none}; do
             IFS=: read -r name warm <<< "$run"
             t0=$(date +%s.%N)
             TRITON_CACHE_DIR=/tmp/first_tc_$name TORCHINDUCTOR_CACHE_DIR=/tmp/first_ic_$name timeout "${FIRSTSTEP_TIMEOUT:-200}" \
               python -u -m moontrain.cli launch $fl --nproc 1 train.steps=2 train.kernel_warmup=$warm \
               train.run_dir=/tmp/first_$name 2>&1 | while IFS= read -r l; do
                 printf '%s %s\n' "$(since "$t0")" "$l"; done > "$out/firststep_$name.log"
             echo "firststep $name: launch to exit $(since "$t0") s"
             grep -E "kernel warm-up|first step|step [12]/2" "$out/firststep_$name.log" | cut -c1-220
           done
           [ "${FIRSTSTEP_PROF:-1}" = 1 ] || continue
           TRITON_CACHE_DIR=/tmp/first_tc_prof TORCHINDUCTOR_CACHE_DIR=/tmp/first_ic_prof timeout "${FIRSTSTEP_TIMEOUT:-200}" \
             torchrun --nproc_per_node=1 --no-python python -m cProfile -o "$out/firststep.prof" -m moontrain.trainer.worker \
             $fl train.steps=1 train.run_dir=/tmp/first_prof > "$out/firststep_prof.log" 2>&1
           echo "firststep cProfile rc=$?"
           python -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(40)" \
             "$out/firststep.prof" 2>&1 | grep -E "^ +[0-9]" | cut -c1-200 ;;
    pool)  # the kernel warm-up's processes alone (no job beside them) on empty Triton caches, the shipped manifest, in
           # POOL_WORKERS processes (default "8 15"): what the warm-up costs where nothing competes for the host
           byte_compile
           for n in ${POOL_WORKERS:-8 15}; do
             TRITON_CACHE_DIR=/tmp/pool_tc_$n timeout "${POOL_TIMEOUT:-200}" python -c "if True:
               import sys; from moontrain.trainer.kernel_warmup import SHIPPED, load_manifest
               from moontrain.trainer.warmup_pool import Warmup
               w = Warmup(load_manifest(SHIPPED), int(sys.argv[1])); print(w.start()); print(w.wait())" "$n" \
               > "$out/pool_$n.log" 2>&1
             echo "pool $n processes rc=$?: $(tail -1 "$out/pool_$n.log" | cut -c1-300)"
           done ;;
    graph) # could k3_small's pass (EP = 1, the recipe's batch) replay from a CUDA graph: its host syncs, the capture,
           # eager against replay (benchmarks/diagnostics/graph_capture.py; GRAPH_ARGS: extra overrides)
           timeout "${GRAPH_TIMEOUT:-400}" torchrun --nproc_per_node=1 benchmarks/diagnostics/graph_capture.py \
             --out "$out/graph_capture.json" ${GRAPH_ARGS:-} > "$out/graph_capture.log" 2>&1
           echo "graph capture rc=$?"; grep -E "^ *[0-9]+\.|^ +[0-9]+ x" "$out/graph_capture.log" | cut -c1-300 | head -30 ;;
    warmup) # the first step on empty Triton and inductor caches, k3_small at EP = 1: without the kernel warm-up (recording
           # the kernels, OUT/kernels_markov.json), on documents (recording, OUT/kernels_docs.json), then on new empty caches
           # with the two merged (OUT/kernels_merged.json; docs/performance.md, session 38). WARMUP_ARGS: extra overrides
           # (an 80 GB card needs none: the recipe's train.activation_checkpointing=auto recomputes what it cannot hold)
           wl="python -m moontrain.cli launch recipes/k3_small.yaml parallel.ep=1 --nproc 1 train.steps=2 checkpoint.save_final=false checkpoint.resume=none ${WARMUP_ARGS:-}"
           docs="data.source=dataset data.path=$PWD/recipes/data/learning/corpus.jsonl data.tokenizer=$PWD/recipes/data/learning/tokenizer"
           for run in "cold_record:A:MOONTRAIN_RECORD_KERNELS=$out/kernels_markov.json:train.kernel_warmup=none" \
                      "docs_record:A:MOONTRAIN_RECORD_KERNELS=$out/kernels_docs.json:train.kernel_warmup=none $docs" \
                      "cold_warm:B::train.kernel_warmup=$out/kernels_merged.json"; do
             IFS=: read -r name cache rec extra <<< "$run"
             [ "$name" = cold_warm ] && python -m moontrain.trainer.kernel_warmup merge "$out/kernels_merged.json" \
               "$out/kernels_markov.json" "$out/kernels_docs.json"
             t0=$(date +%s)
             TRITON_CACHE_DIR=/tmp/warmup_tc$cache TORCHINDUCTOR_CACHE_DIR=/tmp/warmup_ic$cache timeout "${WARMUP_TIMEOUT:-240}" \
               env $rec $wl train.run_dir=/tmp/warmup_$name $extra > "$out/warmup_$name.log" 2>&1
             echo "warmup $name rc=$? launch to exit $(( $(date +%s) - t0 )) s"
             grep -E "kernel warm-up|first step" "$out/warmup_$name.log" | cut -c1-200
           done ;;
    entries) # the autotune entries a run makes beyond the shipped ones (after a kernel, its keys or its launch changed;
           # recipes/data/fla_autotune_h200/README): k3_small's first 2 steps on Markov tokens and on the learning
           # corpus's documents, and bench_kda's first case, then every *.autotune.json written in Triton's cache since,
           # copied to OUT/new_entries/<key folder>/ (to ship: copy them into recipes/data/fla_autotune_h200 when timed on an
           # H200, else into the folder of the GPU that timed them, e.g. fla_autotune_h100).
           # ENTRIES_ARGS: extra launch overrides (an 80 GB card needs none: the recipe's activation_checkpointing=auto)
           touch "$out/.entries_since"; sleep 1
           el="python -m moontrain.cli launch recipes/k3_small.yaml parallel.ep=1 --nproc 1 train.steps=2 checkpoint.save_final=false checkpoint.resume=none ${ENTRIES_ARGS:-}"
           docs="data.source=dataset data.path=$PWD/recipes/data/learning/corpus.jsonl data.tokenizer=$PWD/recipes/data/learning/tokenizer"
           timeout "${ENTRIES_TIMEOUT:-240}" $el train.run_dir=/tmp/entries_markov > "$out/entries_markov.log" 2>&1
           echo "entries markov rc=$?"; grep -E "first step" "$out/entries_markov.log" | cut -c1-240
           timeout "${ENTRIES_TIMEOUT:-240}" $el $docs train.run_dir=/tmp/entries_docs > "$out/entries_docs.log" 2>&1
           echo "entries docs rc=$?"; grep -E "first step" "$out/entries_docs.log" | cut -c1-240
           timeout "${ENTRIES_TIMEOUT:-240}" python benchmarks/bench_kda.py --cases 4x4096x16 > "$out/entries_bench_kda.log" 2>&1
           echo "entries bench_kda rc=$?"
           eout=$(readlink -f "$out"); mkdir -p "$eout/new_entries"
           (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -newer "$eout/.entries_since" \
              -exec cp --parents {} "$eout/new_entries/" \;)
           (cd "$eout/new_entries" && find . -name '*.autotune.json') ;;
    learning)  # docs/learning.md: the DeepSeek-V3 block (60 steps, ~2.5 min) and the K3 block (~2 min) on text, one GPU
           for setup in dsv3 k3_small; do
             timeout "${LEARNING_TIMEOUT:-280}" torchrun --nproc_per_node=1 benchmarks/bench_learning.py --setup "$setup" \
               --steps 60 --out "$out" ${LEARNING_ARGS:-} > "$out/learning_$setup.log" 2>&1
             echo "learning $setup rc=$?"; grep -E "^summary|^torchtitan" "$out/learning_$setup.log" | cut -c1-400
           done ;;
    mfu)   # issue 23's one-GPU point: k3_small_moe's widths with 64 experts at EP = 1, all-MLA layout, 131k tokens per
           # step in 4 passes of 8 x 4096, dense parameters without FSDP (peak 87 GiB); moonep's combine in both orders
           for c in source destination; do
             timeout "${MFU_TIMEOUT:-300}" torchrun --nproc_per_node=1 benchmarks/bench_train.py --recipe recipes/k3_small_moe.yaml \
               --backends moonep --targets 0.2 --steps 5 --warmup 2 --window 5 --tag "k3_small_moe_E64_R1_$c" --out "$out" \
               parallel.ep=1 model.num_experts=64 model.kda_layers_per_mla=0 model.use_nope=false parallel.dense=plain \
               train.micro_batch_size=8 experts.moonep.combine_reduce=$c ${MFU_ARGS:-} --profile moonep > "$out/mfu_$c.log" 2>&1
             echo "mfu combine_reduce=$c rc=$?"; grep -v "^\[rank" "$out/mfu_$c.log" | grep -E "^  moonep" | tail -1
             mkdir -p "$out/profile_$c"; mv "$out"/profile_moonep_*.txt "$out/profile_$c/" 2>/dev/null
           done ;;
    k3)    # issue 35's K3 points on one GPU, each a speed row that learns (lr 6e-4 on text): k3_small at 131,072
           # tokens a step (4 passes of 8 x 4096: half the passes' fixed work of 8 x 4 x 4096, which runs second), the
           # recipe's own batch, then the recipe launched as a newcomer runs it. K3_ROWS: the rows to run (default all three:
           # 131k 131k_mb4 recipe_batch); K3_LAUNCH=0 skips the launch
           k3_rows=(131k "parallel.dense=plain train.micro_batch_size=8 train.global_batch_size=32"
                    131k_mb4 "parallel.dense=plain train.micro_batch_size=4 train.global_batch_size=32" recipe_batch "")
           for i in 0 2 4; do
             [[ " ${K3_ROWS:-131k 131k_mb4 recipe_batch} " == *" ${k3_rows[$i]} "* ]] || continue
             timeout "${K3_TIMEOUT:-300}" torchrun --nproc_per_node=1 benchmarks/bench_train.py --learning-row \
               --recipe recipes/k3_small.yaml --backends moonep --targets --steps 3 --warmup 2 --window 6 \
               --tag "k3_small_${k3_rows[$i]}" --out "$out" parallel.ep=1 ${k3_rows[$((i + 1))]} ${K3_ARGS:-} \
               > "$out/k3_${k3_rows[$i]}.log" 2>&1
             echo "k3 ${k3_rows[$i]} rc=$?"; grep "learning row" "$out/k3_${k3_rows[$i]}.log" | tail -1
           done
           [ "${K3_LAUNCH:-1}" = 1 ] || continue
           timeout "${K3_TIMEOUT:-300}" python -m moontrain.cli launch recipes/k3_small.yaml parallel.ep=1 --nproc 1 \
             train.steps=20 checkpoint.save_final=false ${K3_ARGS:-} > "$out/k3_recipe_launch.log" 2>&1
           echo "k3 recipe launch rc=$?"; grep -E "^step" "$out/k3_recipe_launch.log" | tail -3 | cut -c1-160 ;;
    overlap) # could the optimizer's step hide behind the next forward? (benchmarks/diagnostics/optimizer_overlap.py:
           # a timing experiment, values not checked) at the recipe's batch, then with the pass on a high-priority stream
           for prio in default high; do
             timeout "${OVERLAP_TIMEOUT:-240}" torchrun --nproc_per_node=1 benchmarks/diagnostics/optimizer_overlap.py \
               --main-priority $prio --out "$out/optimizer_overlap_$prio.json" optim.lr=1e-10 ${OVERLAP_ARGS:-} > "$out/overlap_$prio.log" 2>&1
             echo "optimizer overlap ($prio priority) rc=$?"; tail -4 "$out/overlap_$prio.log"
           done ;;
    k3ab)  # one change measured against main on one machine: k3_small's 131k row (speed and learning) as main runs it,
           # then with K3_AB_ARGS (e.g. "kernels.kda_gate_norm=fla"), back to back
           for variant in main change; do
             args=""; [ "$variant" = change ] && args="${K3_AB_ARGS:?k3ab needs K3_AB_ARGS: the overrides of the change}"
             timeout "${K3_TIMEOUT:-300}" torchrun --nproc_per_node=1 benchmarks/bench_train.py --learning-row \
               --recipe recipes/k3_small.yaml --backends moonep --targets --steps 3 --warmup 2 --window 6 \
               --tag "k3_small_131k_$variant" --out "$out" parallel.ep=1 parallel.dense=plain train.micro_batch_size=4 \
               train.global_batch_size=32 $args > "$out/k3ab_$variant.log" 2>&1
             echo "k3ab $variant ($args) rc=$?"; grep -E "steady|learning row" "$out/k3ab_$variant.log" | tail -2
           done ;;
    k3ref) # a code change measured against an earlier commit on one machine: the 131k row and the recipe batch's row
           # (speed and learning) on REF_TREE (a tar.xz of that commit: git archive REF -- . ':!benchmarks/results' |
           # xz > .scratch/ref.tar.xz, carried), then on this tree, back to back
           ref_dir=$(mktemp -d); tar -xJf "${REF_TREE:?k3ref needs REF_TREE: a tar.xz of the commit to compare with}" -C "$ref_dir"
           abs_out=$(cd "$out" && pwd); base_path=${PYTHONPATH#"$PWD:"}  # the environment's paths without this tree
           for row in ${K3REF_ROWS:-131k recipe_batch}; do
             for variant in ref this; do
               extra=""; [ "$row" = 131k ] && extra="parallel.dense=plain train.micro_batch_size=4 train.global_batch_size=32"
               [ "$variant" = this ] && extra="$extra ${K3REF_ARGS:-}"
               dir=$PWD; [ "$variant" = ref ] && dir=$ref_dir
               (cd "$dir" && PYTHONPATH="$dir:$base_path" timeout "${K3_TIMEOUT:-300}" torchrun --nproc_per_node=1 \
                 benchmarks/bench_train.py --learning-row --recipe recipes/k3_small.yaml --backends moonep --targets \
                 --steps 3 --warmup 2 --window 6 --tag "k3_small_${row}_$variant" --out "$abs_out" parallel.ep=1 $extra \
                 > "$abs_out/k3ref_${row}_$variant.log" 2>&1)
               echo "k3ref $row $variant rc=$?"; grep -E "steady|learning row" "$out/k3ref_${row}_$variant.log" | tail -2
             done
           done ;;
    conv)  # KDA's short convolution kernels: their GPU tests (both backward routes), then against the compiled
           # specification, the dpre tile sweep and the walking backward's sweep
           timeout "${CONV_TIMEOUT:-200}" python -m pytest -q -m gpu tests/moontrain/model/kda/test_short_conv_gpu.py \
             > "$out/conv_tests.log" 2>&1
           echo "short conv tests rc=$?"; tail -3 "$out/conv_tests.log"
           timeout "${CONV_TIMEOUT:-200}" python benchmarks/bench_short_conv.py --out "$out/bench_short_conv.json" > "$out/conv.log" 2>&1
           echo "bench_short_conv rc=$?"; tail -34 "$out/conv.log" ;;
    router) # the router's PyTorch route against its routing kernels (kernels.router), forward + backward
           timeout "${ROUTER_TIMEOUT:-200}" python benchmarks/bench_router.py --out "$out/bench_router.json" > "$out/router.log" 2>&1
           echo "bench_router rc=$?"; tail -6 "$out/router.log" ;;
    glu)   # moonep's SiTU-GLU kernels at k3_small's shapes: the fused routed backward's and the forward's tiles swept
           timeout "${GLU_TIMEOUT:-200}" python benchmarks/bench_glu_route.py --out "$out/bench_glu_route.json" > "$out/glu.log" 2>&1
           echo "bench_glu_route rc=$?"; tail -40 "$out/glu.log" ;;
    tiles) # fla's KDA kernels' tiles re-timed at k3_small's pass (4 x 4096 x 16 heads of 128), one kernel at a time;
           # the autotune files of the best tiles in OUT/fla_entries (to ship: recipes/data/fla_autotune_h200/README)
           timeout "${TILES_TIMEOUT:-500}" python benchmarks/bench_fla_tiles.py --iters 10 ${TILES_ARGS:-} --entries "$out/fla_entries" \
             --out "$out/bench_fla_tiles.json" > "$out/tiles.log" 2>&1
           echo "bench_fla_tiles rc=$?"; grep -vE "^(Triton autotuning|with key|finished after|best config|Autotuning kernel)" "$out/tiles.log" | tail -30 ;;
    kdabwd) # the KDA backward's stages routed here (moontrain.model.kda.dqkg_kernel, intra_fla) against fla's calls
           timeout "${KDABWD_TIMEOUT:-300}" python -m pytest -q -s -m gpu tests/moontrain/model/kda/test_dqkg_kernel_gpu.py \
             > "$out/kdabwd_tests.log" 2>&1
           echo "kda backward stage tests rc=$?"; tail -3 "$out/kdabwd_tests.log"
           timeout "${KDABWD_TIMEOUT:-300}" python benchmarks/bench_kda_bwd.py --out "$out/bench_kda_bwd.json" > "$out/kdabwd_bench.log" 2>&1
           echo "bench_kda_bwd rc=$?"; tail -16 "$out/kdabwd_bench.log"
           timeout "${KDABWD_TIMEOUT:-300}" python benchmarks/diagnostics/kda_intra_tiles.py --out "$out/kda_intra_tiles.json" \
             > "$out/kda_intra_tiles.log" 2>&1
           echo "kda_intra_tiles rc=$?"; tail -11 "$out/kda_intra_tiles.log" ;;
    attnres) # the AttnRes aggregation's Triton kernels (kernels.attn_res=triton): their GPU test against float64, then
           # their tiles against the compiled math at k3_small's shape
           timeout "${ATTNRES_TIMEOUT:-200}" python -m pytest -q -m gpu tests/moontrain/model/test_attn_res_kernel_gpu.py \
             > "$out/attn_res_tests.log" 2>&1
           echo "attn_res kernel tests rc=$?"; tail -3 "$out/attn_res_tests.log"
           timeout "${ATTNRES_TIMEOUT:-200}" python benchmarks/bench_attn_res.py --out "$out/bench_attn_res.json" > "$out/attn_res.log" 2>&1
           echo "bench_attn_res rc=$?"; grep "  N " "$out/attn_res.log" ;;
    lmloss) # the head's per-chunk CE kernels (kernels.lm_loss=triton): their GPU test against float64 and the compiled
           # math, then the chunk math alone at k3_small's chunk, compiled against Triton
           timeout "${LMLOSS_TIMEOUT:-200}" python -m pytest -q -m gpu tests/moontrain/model/test_lm_loss_kernel_gpu.py tests/moontrain/model/test_lm_loss.py \
             > "$out/lm_loss_tests.log" 2>&1
           echo "lm_loss kernel tests rc=$?"; tail -3 "$out/lm_loss_tests.log"
           timeout "${LMLOSS_TIMEOUT:-200}" python benchmarks/bench_lm_loss.py --chunk-math-only --cases 16384x2048x163840 \
             --iters 20 --warmup 3 --out "$out/bench_lm_loss_chunk_math.json" > "$out/lm_loss.log" 2>&1
           echo "bench_lm_loss rc=$?"; grep -E "chunk math|scale pass" "$out/lm_loss.log" ;;
    gradacc) # parallel.dense=plain's grad accumulation: the Triton launch against the foreach path at k3_small's
           # dense sizes, then the plain-vs-FSDP GPU tests (both accumulate paths)
           timeout "${GRADACC_TIMEOUT:-300}" python benchmarks/bench_grad_accumulate.py \
             --out "$out/bench_grad_accumulate.json" > "$out/grad_accumulate.log" 2>&1
           echo "bench_grad_accumulate rc=$?"; tail -4 "$out/grad_accumulate.log"
           timeout "${GRADACC_TIMEOUT:-300}" python -m pytest -q -m gpu tests/moontrain/parallel/test_plain_dense_gpu.py \
             > "$out/plain_dense_tests.log" 2>&1
           echo "plain dense GPU tests rc=$?"; tail -3 "$out/plain_dense_tests.log" ;;
    writeback) # the write-back AdamW against torch's fused AdamW + cast at k3_small's masters, its tiles with both
           # moment dtypes, then its GPU tests
           timeout "${WRITEBACK_TIMEOUT:-300}" python benchmarks/bench_write_back.py --experts --bf16-moments \
             --tiles 2048x4 1024x4 4096x4 2048x8 --out "$out/bench_write_back.json" > "$out/write_back.log" 2>&1
           echo "bench_write_back rc=$?"; tail -4 "$out/write_back.log"
           timeout "${WRITEBACK_TIMEOUT:-300}" python -m pytest -q -m gpu tests/moontrain/optim/test_write_back_gpu.py \
             tests/moontrain/parallel/test_plain_dense_gpu.py > "$out/write_back_tests.log" 2>&1
           echo "write-back GPU tests rc=$?"; tail -3 "$out/write_back_tests.log" ;;
    gatenorm) # KDA's gate-and-norm kernels (kernels.kda_gate_norm=moontrain) and the fused intra stage
           # (kernels.kda_intra=moontrain): their GPU tests (the ends at default, 8 and 16 warps; the fused kernel and
           # route), bench_gate_norm over the warps, then bench_kda_intra_norm (the route's last two launches against
           # the fused stage's), with and without documents
           timeout "${GATENORM_TIMEOUT:-200}" python -m pytest -q -m gpu tests/moontrain/model/kda/test_chunk_gpu.py \
             -k "gate_norm_kernels or intra_norm or fused" > "$out/gate_norm_tests.log" 2>&1
           echo "gate-norm tests rc=$?"; tail -2 "$out/gate_norm_tests.log"
           timeout "${GATENORM_TIMEOUT:-200}" python benchmarks/bench_gate_norm.py --out "$out/bench_gate_norm.json" \
             > "$out/gate_norm.log" 2>&1
           echo "bench_gate_norm rc=$?"; tail -8 "$out/gate_norm.log"
           timeout "${GATENORM_TIMEOUT:-200}" python benchmarks/bench_kda_intra_norm.py \
             --out "$out/bench_kda_intra_norm.json" > "$out/kda_intra_norm.log" 2>&1
           echo "bench_kda_intra_norm rc=$?"; tail -8 "$out/kda_intra_norm.log" ;;
    kdakernels) # KDA's forward + backward by kernel (fla's chunk_kda on the model's route: moontrain's dqkg stage,
           # states kept, then recomputed) at 4 x 4096 x 16, with and without documents
           timeout "${KDAK_TIMEOUT:-300}" python benchmarks/diagnostics/kda_kernels.py --dqkg moontrain \
             --recompute off on --gate-norm fla moontrain intra_norm > "$out/kda_kernels.log" 2>&1
           echo "kda_kernels rc=$?"; head -24 "$out/kda_kernels.log"; tail -6 "$out/kda_kernels.log" ;;
    kdacounters) # KDA's forward + backward kernels (the model's route, 4 x 4096 x 16) under Nsight Compute: time,
           # DRAM bytes, occupancy, registers and warp stalls per kernel (benchmarks/diagnostics/kda_counters.py)
           ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
           kc=(--profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy
               --section LaunchStats --section WarpStateStats --csv --page raw)
           timeout "${KDAC_TIMEOUT:-300}" "$ncu_bin" "${kc[@]}" --metrics dram__bytes_read.sum,dram__bytes_write.sum \
             python benchmarks/diagnostics/kda_counters.py --run > "$out/kda_counters.csv" 2> "$out/kda_counters.err"
           rc=$?; echo "ncu ($ncu_bin) rc=$rc"
           if [ $rc -ne 0 ]; then  # without the two DRAM metrics, should the names be this ncu's others
             timeout "${KDAC_TIMEOUT:-300}" "$ncu_bin" "${kc[@]}" python benchmarks/diagnostics/kda_counters.py --run \
               > "$out/kda_counters.csv" 2>> "$out/kda_counters.err"; echo "ncu again rc=$?"
           fi
           tail -3 "$out/kda_counters.err"
           python benchmarks/diagnostics/kda_counters.py --table "$out/kda_counters.csv" --out "$out/kda_counters.json" \
             2>&1 | tee "$out/kda_counters.log" | cut -c1-220 ;;
    opsites) # where the K3 layers' large copies, casts and cats come from (fla's kernels included), 4 layers of
           # k3_small at 4 x 4096 tokens
           timeout "${OPSITES_TIMEOUT:-300}" python benchmarks/diagnostics/op_sites.py --layers 4 ${OPSITES_ARGS:-} \
             --out "$out/op_sites.json" > "$out/op_sites.log" 2>&1
           echo "op_sites rc=$?"; head -40 "$out/op_sites.log" ;;
    outputcode) # the same 4 layers with the dense parts compiled as train.compile does: inductor's generated code
           # (OUT/output_code.log.xz, its Triton kernels listed) and the large copies left outside the compiled graphs
           TORCH_LOGS=output_code timeout "${OPSITES_TIMEOUT:-300}" python benchmarks/diagnostics/op_sites.py --layers 4 ${OPSITES_ARGS:-} \
             --compile --out "$out/op_sites_compiled.json" > "$out/op_sites_compiled.log" 2> "$out/output_code.log"
           echo "op_sites --compile rc=$?"; head -30 "$out/op_sites_compiled.log"
           grep -oE "def triton_[a-z]+_fused_[A-Za-z0-9_]+" "$out/output_code.log" | sort | uniq -c | sort -rn | head -40
           xz -f "$out/output_code.log" ;;
    *) echo "unknown step $step (tests, cute, comm, train, planner, gemm, push, kda, conv, glu, tiles, kdabwd, attnres, lmloss, gradacc, writeback, gatenorm, kdakernels, kdacounters, opsites, outputcode, optim, determinism, ckpt, dense, mfu, k3, k3ab, k3ref, learning, warmup, firststep, pool, graph, entries)"; exit 2 ;;
  esac
done
