"""The kernel warm-up's processes (moontrain.trainer.warmup_pool): each entry compiled once by one of the processes
that claim them, the report's counts (stale entries, failures), the launcher's report read by a rank, the
processes stopped and their folder removed, and on a GPU a recorded kernel compiled with its launcher into an
empty cache, where a new process then compiles and builds nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from moontrain.trainer import kernel_warmup as kw
from moontrain.trainer import warmup_pool as wp


def _spec(name: str = "_glu_rows_fwd_kernel", signature: dict | None = None) -> str:
    if signature is None:
        signature = dict.fromkeys(("hu_ptr", "a_ptr", "n_rows", "F", "ACT", "BLOCK_R", "BLOCK_F"), "*bf16")
    return json.dumps({"name": name, "signature": signature, "constant_keys": [], "constant_vals": [],
                       "attrs_keys": [], "attrs_vals": [], "options": {"num_warps": 4}, "key": "k"})


def _entry(name: str = "_glu_rows_fwd_kernel", spec: str | None = None) -> kw.Entry:
    return kw.check_entry({"module": "moonep.kernels.glu_rows", "name": name,
                           "specialization": spec if spec is not None else _spec()}, "t")


def _renamed() -> kw.Entry:
    sig = json.loads(_spec())["signature"]
    return _entry(spec=_spec(signature={"h_ptr" if k == "hu_ptr" else k: v for k, v in sig.items()}))


def test_skipped_for_another_triton_and_once_warmed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    w = wp.Warmup(kw.Manifest("0.1", "sm90", [_entry()]), 2)
    assert w.start() == f"kernel warm-up: not needed (recorded with Triton 0.1, this is Triton {kw._triton_version()})"
    assert w.wait() is None and not w.ran and w.workdir is None
    m = kw.Manifest(kw._triton_version(), "sm90", [_entry()])
    mark = tmp_path / "moontrain_warm" / f"{m.digest}.done"
    mark.parent.mkdir()
    mark.write_text("1 kernels\n")
    assert wp.Warmup(m, 2).start() == "kernel warm-up: not needed (warmed before)"


def test_processes_report_stale_and_failed_entries(tmp_path, monkeypatch) -> None:
    """On the CPU Triton has no driver, so every compile fails: the report counts each entry once (5 entries over 3
    processes), stale entries apart (a kernel gone, parameters renamed: the step compiles them), and no done-mark
    is written, so the next job tries again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    m = kw.Manifest(kw._triton_version(), "sm90", [_entry(), _entry(name="not_there"), _renamed(), _entry(),
                                                   _entry(spec=_spec().replace('"k"', '"k2"'))])
    assert wp.Warmup(m, 10_000).workers == max(1, (os.cpu_count() or 2) - 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # three processes on a two-core host too
    w = wp.Warmup(m, 3)
    start = w.start()
    assert start.startswith("kernel warm-up: compiling 5 Triton kernels in 3 processes while the job starts"), start
    work = w.workdir
    line = w.wait(timeout_s=300)
    assert line.startswith("kernel warm-up: 0 of 5 kernels compiled in ") and "; 3 not compiled" in line, line
    assert "; 2 manifest entries left to the step (kernels not installed here or changed" in line, line
    took, waited = map(float, re.search(r"compiled in ([0-9.]+) s \(the job waited ([0-9.]+) s of it", line).groups())
    assert 0 <= waited <= took, line  # the wait is part of the warm-up's time
    assert sorted(p.name for p in (work / "claims").iterdir()) == ["0", "1", "2", "3", "4"]
    records = {p.name: json.loads(p.read_text()) for p in (work / "results").iterdir()}
    assert sorted(records) == ["0", "1", "2", "3", "4"], records  # each entry once: no .tmp left, none twice
    results = {k: r["why"] for k, r in records.items()}
    assert all(0 < r["ready"] <= took and 0 <= r["seconds"] <= took for r in records.values()), (records, took)
    report = w._read()
    assert report.busy == pytest.approx(sum(r["seconds"] for r in records.values()))
    assert report.ready == max(r["ready"] for r in records.values()) and report.slowest is None  # none compiled
    assert results["1"].startswith("stale: moonep.kernels.glu_rows.not_there: AttributeError"), results["1"]
    assert results["2"].endswith("takes 7 (parameter 0: h_ptr -> hu_ptr)"), results["2"]
    assert all(results[k].startswith("moonep.kernels.glu_rows._glu_rows_fwd_kernel: ") for k in "034"), results
    assert w.ran and w.wait() is None
    assert not (tmp_path / "moontrain_warm").exists()
    w.close()
    assert not work.exists()


def test_a_gpu_the_manifest_was_not_recorded_for(tmp_path, monkeypatch) -> None:
    """A process whose GPU is another architecture writes why and compiles nothing: the end line says the warm-up
    was not used, and the job does not count it as run (its first-step note names Triton's compiles as usual)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    w = wp.Warmup(kw.Manifest(kw._triton_version(), "sm90", [_entry()]), 1)
    w.workdir = tmp_path / "work"
    (w.workdir / "results").mkdir(parents=True)
    (w.workdir / "unusable").write_text("recorded for sm90, this GPU is sm80")
    report = w.join(timeout_s=1)
    assert report.unusable == "recorded for sm90, this GPU is sm80" and not w.ran
    assert report.line(0.0) == ("kernel warm-up: not used (recorded for sm90, this GPU is sm80); the step compiles "
                                "its kernels")
    assert not (tmp_path / "moontrain_warm").exists()


def test_close_stops_the_processes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    w = wp.Warmup(kw.Manifest(kw._triton_version(), "sm90", [_entry()] * 4), 2)
    w.start()
    procs, work = list(w._procs), w.workdir
    w.close()
    assert all(p.returncode is not None for p in procs) and not work.exists()
    assert w.wait() is None and not w.ran


def test_a_rank_reads_the_launcher_s_report(tmp_path, monkeypatch) -> None:
    """The launcher joins its processes in a thread that writes the report; the rank's wait returns the same line
    (its own wait), and a report that is not one is named, not trusted."""
    import torch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    shipped = wp.launcher_warmup("auto", 2, cuda=True)
    assert shipped.manifest == kw.load_manifest(kw.SHIPPED) and wp.launcher_warmup("auto", 2, cuda=False) is None
    w = wp.Warmup(kw.Manifest(kw._triton_version(), "sm90", [_entry(), _entry(name="not_there")]), 2)
    w.start()
    monkeypatch.setenv(wp.REPORT_ENV, str(w.report_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    rank = wp.rank_warmup("auto", 8, torch.device("cuda"))
    assert isinstance(rank, wp.LauncherWarmup) and rank.start() is None
    thread = wp.publish_in_background(w)
    line = rank.wait(timeout_s=300)
    thread.join()
    assert line.startswith("kernel warm-up: 0 of 2 kernels compiled in ") and "1 not compiled" in line, line
    assert "1 manifest entries left to the step" in line and rank.ran, line
    report = wp.Report.from_json(w.report_path.read_text())
    assert (report.total, report.compiled, len(report.failed), len(report.stale)) == (2, 0, 1, 1)
    many = wp.Report(total=60, failed=[f"kernel {i}: no driver" for i in range(60)])
    assert wp.Report.from_json(many.to_json()) == many  # the rank's counts are the launcher's, none cut
    w.report_path.write_text(json.dumps({**json.loads(report.to_json()), "total": "all"}))
    assert "is not readable (warm-up report: total is str)" in wp.LauncherWarmup(w.report_path).wait(1)
    assert wp.LauncherWarmup(tmp_path / "never").wait(0.2) == ("kernel warm-up: not finished after 0 s (the step "
                                                              "compiles what is left)")
    w.close()


def test_each_process_walks_the_entries_grouped_by_module_from_its_own_stretch() -> None:
    """Every process tries every entry once, in module order from its own n-th of them on, so the shipped
    manifest's fla entries (whose import is all of fla) fall to the first processes' stretches: with 8 processes,
    fla is the first module of 2 walks, not of all 8."""
    shipped = kw.load_manifest(kw.SHIPPED)
    n_fla = sum(e.module.startswith("fla.") for e in shipped.kernels)
    assert 0 < n_fla < len(shipped.kernels) / 2, n_fla
    walks = [wp.walk(shipped, k, 8) for k in range(8)]
    for k, order in enumerate(walks):
        assert sorted(order) == list(range(len(shipped.kernels))), k
        modules = [shipped.kernels[i].module for i in order]
        start = k * len(order) // 8
        assert modules[len(order) - start:] + modules[:len(order) - start] == sorted(modules), k  # one wrap
    firsts = [shipped.kernels[order[0]].module.startswith("fla.") for order in walks]
    assert sum(firsts) == -(-n_fla * 8 // len(shipped.kernels)), firsts
    m = kw.Manifest("t", "sm90", [_entry(), _entry(name="b"), _entry()])
    assert wp.walk(m, 0, 1) == [0, 1, 2] and wp.walk(m, 1, 3) == [1, 2, 0]


def test_the_end_line_says_where_the_warm_up_s_time_went() -> None:
    r = wp.Report(total=60, compiled=60, seconds=36.0, ready=14.25, busy=120.0, slowest="_fused_kernel 4.2 s")
    assert r.line(13.5) == ("kernel warm-up: 60 of 60 kernels compiled in 36.0 s (the processes began after up to "
                            "14.2 s, their compiles 120.0 s of process time, the slowest _fused_kernel 4.2 s; the job "
                            "waited 13.5 s of it, once the trainer was built)")
    assert wp.Report.from_json(r.to_json()) == r


def test_the_launcher_writes_a_report_whatever_happens(tmp_path, monkeypatch) -> None:
    """A rank waits for the report before its first step: a join that raises still writes one, naming the error."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    w = wp.Warmup(kw.Manifest(kw._triton_version(), "sm90", [_entry()]), 1)

    def broken(timeout_s: float = 0.0) -> wp.Report:
        raise RuntimeError("results folder unreadable")

    monkeypatch.setattr(w, "join", broken)
    w.publish()
    line = wp.LauncherWarmup(w.report_path).wait(1)
    assert line.startswith("kernel warm-up: 0 of 1 kernels compiled") and "RuntimeError: results folder" in line, line
    w.close()


def test_where_no_warm_up_applies(tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.delenv(wp.REPORT_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert wp.rank_warmup("auto", 8, torch.device("cpu")) is None
    assert wp.rank_warmup("none", 8, torch.device("cuda")) is None
    assert wp.rank_warmup("auto", 0, torch.device("cuda")) is None
    assert isinstance(wp.rank_warmup("auto", 8, torch.device("cuda")), wp.Warmup)  # not started
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert wp.rank_warmup("auto", 8, torch.device("cuda")) is None
    bad = tmp_path / "m.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=f"kernel manifest {bad}: not a format-1 manifest"):
        wp.launcher_warmup(str(bad), 8, cuda=True)


GPU_CHILD = """
import sys, torch
import triton.runtime.build as build
from triton import knobs
compiled, built = [], []
knobs.compilation.listener = lambda **kw: None if kw["cache_hit"] else compiled.append(1)
_build = build._build
build._build = lambda *a, **k: (built.append(a[0]), _build(*a, **k))[1]
from moonep.kernels.glu_rows import glu_forward_rows
a = glu_forward_rows("situ_glu", torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
print("compiled", len(compiled), "launchers", built.count("__triton_launcher"))
"""


@pytest.mark.gpu
def test_recorded_kernel_warmed_into_an_empty_cache(tmp_path, monkeypatch) -> None:
    """A kernel recorded in this process, compiled by the processes into an empty cache with its launcher: a new
    process launching it compiles nothing (Triton's compilation listener hears only a cache hit) and builds no C
    module, where one on another empty cache compiles the kernel and builds its launcher."""
    import torch

    from moonep.kernels.glu_rows import _glu_rows_fwd_kernel, glu_forward_rows

    # another test of this process (pytest-xdist) may have launched it: the hook hears only a compile or a load
    _glu_rows_fwd_kernel.device_caches.clear()
    with kw.KernelRecorder() as rec:
        glu_forward_rows("situ_glu", torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
    major, minor = torch.cuda.get_device_capability()
    manifest = rec.manifest(f"sm{major}{minor}")
    assert [e.name for e in manifest.kernels] == ["_glu_rows_fwd_kernel"]
    warm = tmp_path / "warm"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(warm))
    w = wp.Warmup(manifest, 2)
    w.start()
    line = w.wait(timeout_s=300)
    w.close()
    assert line.startswith("kernel warm-up: 1 of 1 kernels compiled"), line
    assert list(Path(warm).rglob("__triton_launcher*.so")), "no launcher in the warmed cache"
    for cache, want in ((warm, "compiled 0 launchers 0"), (tmp_path / "cold", "compiled 1 launchers 1")):
        r = subprocess.run([sys.executable, "-c", GPU_CHILD], env={**os.environ, "TRITON_CACHE_DIR": str(cache)},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and want in r.stdout, (cache, r.stdout, r.stderr[-2000:])
