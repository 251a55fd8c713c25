"""The first step's wait, said and accounted (moontrain.trainer.first_step), on the CPU:

- the note before the step names what it compiles, and what seeding fla's cache did (seeded, or why not);
- the line after it, built from given timings: total, torch.compile (left out below 0.05 s), fla's
  searches and its seeding, or nothing about fla for a run without it;
- the clock on a real compile: torch.compile's part (aot_eager, forward and lazily compiled backward) is
  inside the measured wall time and counted in the step that compiled only; fla's searches are the
  autotune entries the step added to the cache;
- Triton's compiles (cache misses) counted through its compilation listener, called as Triton calls it;
- Trainer.fit prints the line once, after the first step's own line and before the second step's.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from moontrain.metrics.progress import ProgressLog
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer import first_step
from moontrain.trainer.first_step import FirstStepClock, first_step_line, first_step_note
from moontrain.trainer.kernel_cache import SHIPPED_FLA_DIR, FlaSeed
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import small_config

CUDA = torch.device("cuda", 0)
SEEDED = FlaSeed(shipped=SHIPPED_FLA_DIR, cache_dir=Path("/c/triton"), in_cache=42, copied=5)
FOREIGN = FlaSeed(shipped=SHIPPED_FLA_DIR, cache_dir=Path("/c/triton"), in_cache=0, copied=0,
                  mismatch="triton 3.5.0 here, they are for 3.6.0")


def test_first_step_note_names_what_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_config("moonep", 1)
    assert first_step_note(cfg, torch.device("cpu")) is None
    cfg.train.compile = True
    assert first_step_note(cfg, CUDA) == (
        "the first step also torch.compile compiles the dense layers (train.compile); Triton compiles moonep's "
        "kernels: it can take a minute or more (later steps reuse them)")
    assert first_step_note(cfg, CUDA, warmed=True) == (
        "the first step also torch.compile compiles the dense layers (train.compile); Triton compiles the kernels "
        "the warm-up did not: it can take a minute or more (later steps reuse them)")
    monkeypatch.setattr(first_step, "uses_fla", lambda *args: True)  # fla-core is not installed on the CPU
    cfg.train.compile = False
    assert first_step_note(cfg, CUDA, SEEDED) == (
        "the first step also fla autotunes its KDA kernels for shapes beyond the 42 entries seeded from "
        "recipes/data/fla_autotune_h200 (Triton's cache: /c/triton); Triton compiles moonep's kernels: it can "
        "take a minute or more (later steps reuse them)")
    cfg.experts.backend = "local"
    assert first_step_note(cfg, CUDA, FOREIGN) == (
        "the first step also fla autotunes its KDA kernels for every shape (minutes; nothing seeded from "
        "recipes/data/fla_autotune_h200: triton 3.5.0 here, they are for 3.6.0): it can take a minute or more "
        "(later steps reuse them)")


def test_first_step_line_from_given_timings() -> None:
    assert first_step_line(41.23, 24.94, SEEDED, 0) == (
        "first step 41.2 s (torch.compile 24.9 s; fla autotune: 0 shapes searched, 42 entries seeded from "
        "recipes/data/fla_autotune_h200)")
    timed_elsewhere = FlaSeed(shipped=SHIPPED_FLA_DIR, cache_dir=Path("/c"), in_cache=42, copied=0,
                              timed_on="NVIDIA H200")
    assert first_step_line(9.04, 0.0, timed_elsewhere, 1) == (
        "first step 9.0 s (fla autotune: 1 shape searched, 42 entries seeded from recipes/data/fla_autotune_h200, "
        "timed on an NVIDIA H200)")
    assert first_step_line(239.0, 30.0, FOREIGN, 12) == (
        "first step 239.0 s (torch.compile 30.0 s; fla autotune: 12 shapes searched, nothing seeded from "
        "recipes/data/fla_autotune_h200: triton 3.5.0 here, they are for 3.6.0)")
    assert first_step_line(3.04, 0.04, None, 0) == "first step 3.0 s"
    compiled = [("moonep", "_scatter_kernel", 0.5), ("fla", "chunk_kda_bwd_kernel_intra", 6.25),
                ("fla", "chunk_local_cumsum_vector_kernel", 0.75), ("moontrain", "_bwd_kernel", 3.0),
                ("other", "?", 0.25)]
    assert first_step_line(309.8, 38.7, SEEDED, 0, triton=compiled) == (
        "first step 309.8 s (torch.compile 38.7 s; Triton compiled 5 kernels in 10.8 s (fla 2: 7.0 s, moontrain 1: "
        "3.0 s, moonep 1: 0.5 s, other 1: 0.2 s; slowest fla chunk_kda_bwd_kernel_intra 6.2 s): a cold cache, which "
        "later runs on this machine reuse; fla autotune: 0 shapes searched, 42 entries seeded from "
        "recipes/data/fla_autotune_h200)")
    assert first_step_line(3.04, 0.0, None, 0, triton=[]) == "first step 3.0 s"


def test_triton_compiles_counts_cache_misses_and_keeps_the_listener_before_it() -> None:
    """TritonCompiles on Triton's compilation listener (called here as Triton's compile() calls it: the CPU
    compiles no kernel): misses counted with their seconds, hits not; a listener installed before it keeps
    being called and is back after close()."""
    from triton import knobs
    from triton.knobs import CompileTimes

    seen = []
    before = knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        compiles = first_step.TritonCompiles()
        listener = knobs.compilation.listener
        fla_src = types.SimpleNamespace(name="chunk_kda_fwd_kernel", fn=types.SimpleNamespace(
            __module__="fla.ops.kda.chunk_fwd", __name__="chunk_kda_fwd_kernel"))
        for src, hit, us in ((fla_src, False, 2_000_000), (fla_src, True, 300), (None, False, 500_000)):
            listener(src=src, metadata={}, metadata_group={}, cache_hit=hit,
                     times=CompileTimes(ir_initialization=us // 2, lowering_stages=[("ttir", us // 2)],
                                        store_results=0))
        assert (compiles.kernels, compiles.seconds) == (2, 2.5) and seen == [False, True, False]
        assert compiles.compiled == [("fla", "chunk_kda_fwd_kernel", 2.0), ("other", "?", 0.5)]
        compiles.close()
        assert knobs.compilation.listener is not listener and knobs.compilation.listener(
            src=None, metadata={}, metadata_group={}, times=None, cache_hit=True) is None and seen[-1] is True
    finally:
        knobs.compilation.listener = before


def test_triton_compiles_names_the_package_of_a_kernel_torch_compile_re_emits() -> None:
    """A kernel compiled from a module torch.compile generated (its source re-emitted under its own name) is
    counted under the package whose loaded module holds a Triton kernel of that name; inductor's own kernel
    names, and names that are not kernels there, stay "other"."""
    from triton.knobs import CompileTimes

    import moontrain.model.kda.short_conv_kernel  # noqa: F401  (loaded, as in a run that calls it)

    compiles = first_step.TritonCompiles()
    try:
        for name in ("_short_conv_dpre_kernel", "triton_poi_fused_add_0", "short_conv_silu"):
            src = types.SimpleNamespace(name=name, fn=types.SimpleNamespace(__module__="ctorchinductor_x1", __name__=name))
            compiles.record(src=src, metadata={}, metadata_group={}, cache_hit=False,
                            times=CompileTimes(ir_initialization=1000, lowering_stages=[], store_results=0))
    finally:
        compiles.close()
    assert [(p, n) for p, n, _ in compiles.compiled] == [
        ("moontrain", "_short_conv_dpre_kernel"), ("other", "triton_poi_fused_add_0"), ("other", "short_conv_silu")]


_COMPILE_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moontrain.model import lm_loss_kernel
from moontrain.trainer.first_step import TritonCompiles
compiles = TritonCompiles()
src = ASTSource(fn=lm_loss_kernel._grad_kernel, signature={"x_ptr": "*bf16", "lse_ptr": "*fp32", "t_ptr": "*i64",
                "V": "i32", "inv_n": "fp32", "BV": "constexpr"}, constexprs={"BV": 2048})
for _ in range(2):  # the second compile finds the first's result in the (fresh) cache: not counted
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
compiles.close()
print(compiles.compiled)
"""


def test_triton_compiles_names_a_real_compiles_package_and_kernel(tmp_path: Path) -> None:
    """A kernel Triton really compiles (for sm90, on the CPU, into a fresh cache) is counted once, under its
    package and name, with the host seconds Triton reports."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (package, name, seconds), = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert (package, name) == ("moontrain", "_grad_kernel") and 0 < seconds < 300


def test_clock_counts_the_compile_and_the_searches_of_its_step(tmp_path: Path) -> None:
    (tmp_path / ("A" * 52)).mkdir()
    (tmp_path / ("A" * 52) / "old_kernel.autotune.json").write_text("{}")  # there before: not this step's
    seed = FlaSeed(shipped=SHIPPED_FLA_DIR, cache_dir=tmp_path, in_cache=42, copied=0)
    step = torch.compile(lambda x: (x.sin() * x).sum(), backend="aot_eager")
    x = torch.randn(16, requires_grad=True)
    t0 = time.perf_counter()
    clock = FirstStepClock(seed)
    step(x).backward()
    for key in ("B" * 52, "C" * 52):  # what fla writes for each shape it searched
        (tmp_path / key).mkdir()
        (tmp_path / key / "chunk_kda_fwd.autotune.json").write_text("{}")
    total_s, compile_s, searched = clock.measure()
    clock.compiles.close()
    wall_s = time.perf_counter() - t0
    assert 0 < compile_s <= total_s <= wall_s
    assert searched == 2
    later = FirstStepClock(seed)  # the compiled step again: nothing compiles, nothing is searched
    step(x).backward()
    total_s, compile_s, searched = later.measure()
    assert (compile_s, searched) == (0.0, 0)
    assert re.fullmatch(r"first step \d+\.\d s \(fla autotune: 0 shapes searched, 42 entries seeded from "
                        r"recipes/data/fla_autotune_h200\)", later.line()), later.line()


def test_fit_says_the_first_steps_wait_once_after_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    cfg = small_config("local", 1, run_dir=str(tmp_path), steps=2, checkpoint={"save_final": False})
    cfg.train.log_every = 1
    trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
    trainer.log = ProgressLog(tmp_path, cfg.train.steps)  # rank 0's step lines
    trainer.first_step = FirstStepClock(None)  # as the worker sets it on rank 0 of a GPU job
    try:
        trainer.fit()
    finally:
        trainer.log.close()
        trainer.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "first step" in line or line.startswith("step")]
    assert [line.split(" |")[0] for line in lines[::2]] == ["step 1/2", "step 2/2"], lines
    assert len(lines) == 3 and re.fullmatch(r"moontrain: first step \d+\.\d s", lines[1]), lines
