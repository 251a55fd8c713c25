"""Diagnostics: the tools an engineer uses to find out why a benchmark reads what it reads.

benchmarks/ holds what a user runs to measure moonep and moontrain (bench_*.py, check_determinism,
muon_sweep, bench_learning against reference_loop); their numbers are the tables of the README. These
ones localise a cost or a difference instead, and none of them is a table of the README:
- train_diagnostics: one extra step of bench_train profiled, its host syncs, its memory peak's allocations;
- profile_determinism: one profiled step per train.deterministic mode (check_determinism.py --profile);
- determinism_grads: which parameters' gradients differ between two identical passes;
- profile_planner: per-kernel device time of one fused plan at a simulated R-rank problem;
- host_overhead: the host work (aten ops, data-path calls) of one step, counted on the CPU;
- optimizer_overlap, graph_capture: the optimizer's step on a second stream; a pass replayed from a CUDA graph
  (one_rank: the one-GPU trainer both build).
"""
