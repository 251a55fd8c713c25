"""The kernel warm-up's processes: a manifest's Triton kernels (moontrain.trainer.kernel_warmup) compiled into
Triton's cache, with their launchers, while the job starts.

Who starts them: `moontrain launch` (launcher_warmup), before it starts torchrun, so they run while torchrun and
the ranks import and build the trainer (a cold k3_small launch on an H100: the ranks' first rank reached the
warm-up 15.8 s after the launcher did, docs/performance.md); the host's first rank waits for the launcher's
report (MOONTRAIN_WARMUP_REPORT, a file the launcher writes when its processes are done) before its first step.
A job started without the launcher (torchrun, the benchmarks) starts them from its host's first rank
(rank_warmup), as the launcher would.

Each process is `python -m moontrain.trainer.warmup_pool WORKDIR`, which imports this module, the manifest's checks
and each kernel's own module (a multiprocessing "spawn" child would also import its parent's main module, the rank's
moontrain.trainer.worker, and could not be started before the rank). It claims the manifest's entries one at a time
(an exclusively created file per entry under WORKDIR/claims: the next free kernel in its walk, which groups them by
module so that few processes import fla; a slow compile holds up no queue) and for each one: an entry whose kernel
changed since the recording is left to the step (kernel_warmup.stale), else it is compiled (JITFunction.preload) and
its launcher built (the small C module Triton's driver builds with the host's C compiler at a kernel's first launch
and caches by its source: 52 of them were 9.2 s of the first step after a warm-up that compiled the kernels only, on
an H100). Each result is a file under WORKDIR/results; a process whose GPU or Triton differs from the manifest's
says so in WORKDIR/unusable and compiles nothing.

The report (Report) is the only thing read across processes; it decides one console line and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moontrain.trainer.kernel_warmup import SHIPPED, Manifest, cache_dir, compile_entry, load_manifest, stale, usable

REPORT_ENV = "MOONTRAIN_WARMUP_REPORT"
WAIT_S = 900.0  # the longest a first step waits for the warm-up (the step compiles what is left after it)


@dataclass(slots=True)
class Report:
    total: int = 0
    compiled: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)  # why each of those not compiled
    stale: list[str] = field(default_factory=list)  # entries whose kernel changed since the recording
    pending: int = 0  # not done within the wait
    skipped: str | None = None  # why nothing was started (the start line said so)
    unusable: str | None = None  # why the processes compiled nothing (another GPU or Triton)
    ready: float = 0.0  # the latest a process began its first entry, seconds after the start (Python, Triton, CUDA)
    busy: float = 0.0  # the compiles' seconds summed over the processes
    slowest: str | None = None  # the slowest compile, named with its seconds

    def line(self, waited: float) -> str | None:
        """The console line once joined (None if nothing was started)."""
        if self.skipped is not None:
            return None
        if self.unusable is not None:
            return f"kernel warm-up: not used ({self.unusable}); the step compiles its kernels"
        line = f"kernel warm-up: {self.compiled} of {self.total} kernels compiled in {self.seconds:.1f} s ("
        if self.slowest is not None:
            line += (f"the processes began after up to {self.ready:.1f} s, their compiles {self.busy:.1f} s of process "
                     f"time, the slowest {self.slowest}; ")
        line += f"the job waited {waited:.1f} s of it, once the trainer was built)"
        if self.pending:
            line += f"; {self.pending} not done after {WAIT_S:.0f} s (the step compiles them)"
        if self.failed:
            line += f"; {len(self.failed)} not compiled (the step compiles them), e.g. {self.failed[0]}"
        if self.stale:
            line += (f"; {len(self.stale)} manifest entries left to the step (kernels not installed here or changed "
                     f"since the recording; `python -m moontrain.trainer.kernel_warmup prune` drops them), e.g. "
                     f"{self.stale[0]}")
        return line

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Report:
        """A report file's text, every field type-checked (a ValueError otherwise)."""
        raw = json.loads(text)
        number, maybe_str = (int, float), (str, type(None))
        kinds = {"total": int, "compiled": int, "seconds": number, "failed": list, "stale": list, "pending": int,
                 "skipped": maybe_str, "unusable": maybe_str, "ready": number, "busy": number, "slowest": maybe_str}
        if not isinstance(raw, dict) or set(raw) != set(kinds):
            raise ValueError(f"a warm-up report holds exactly {sorted(kinds)}")
        for key, kind in kinds.items():
            ok = isinstance(raw[key], kind) and not isinstance(raw[key], bool)
            if not ok or (kind is list and not all(isinstance(s, str) for s in raw[key])):
                raise ValueError(f"warm-up report: {key} is {type(raw[key]).__name__}")
        return cls(**raw)


class Warmup:
    """The manifest's kernels compiling in `workers` child processes (start), joined (wait, or publish: the
    launcher's, which writes the report for the ranks). Starts nothing when the cache was warmed from this
    manifest before (its done-mark) or the manifest was recorded with another Triton."""

    def __init__(self, manifest: Manifest, workers: int) -> None:
        # at most one process a core but one (the job's own processes start meanwhile)
        self.manifest, self.workers = manifest, max(1, min(workers, (os.cpu_count() or 2) - 1))
        self.mark = cache_dir() / "moontrain_warm" / f"{manifest.digest}.done"
        # the Triton version here; the GPU's architecture is the processes' to check (the launcher touches no GPU)
        self.skip = usable(manifest, manifest.arch) or ("warmed before" if self.mark.is_file() else None)
        self.workdir: Path | None = None
        self._procs: list[subprocess.Popen] = []
        self._t0 = 0.0
        self.ran = False  # the processes ran on this GPU and were joined (wait)

    @property
    def report_path(self) -> Path:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="moontrain-warmup-"))
        return self.workdir / "report.json"

    def start(self) -> str:
        """Start the processes (unless skipped); one line for the console."""
        if self.skip is not None:
            return f"kernel warm-up: not needed ({self.skip})"
        self._t0, epoch = time.perf_counter(), time.time()
        work = self.report_path.parent
        (work / "claims").mkdir()
        (work / "results").mkdir()
        (work / "manifest.json").write_text(self.manifest.to_json())
        n, procs = len(self.manifest.kernels), min(self.workers, len(self.manifest.kernels))
        for k in range(procs):
            command = [sys.executable, "-m", "moontrain.trainer.warmup_pool", str(work), repr(epoch), str(k),
                       str(procs)]
            with open(work / f"process_{k}.log", "w") as log:
                self._procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT))
        return (f"kernel warm-up: compiling {n} Triton kernel{'s' if n != 1 else ''} in {len(self._procs)} "
                f"process{'es' if len(self._procs) != 1 else ''} while the job starts (Triton's cache: {cache_dir()})")

    def join(self, timeout_s: float = WAIT_S) -> Report:
        """Wait for the processes (at most timeout_s; those still running then are stopped) and read their results."""
        if self.skip is not None:
            return Report(skipped=self.skip)
        deadline = time.perf_counter() + timeout_s
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        report = self._read()
        self.ran = report.unusable is None
        if not report.pending and not report.failed and report.unusable is None:
            self.mark.parent.mkdir(parents=True, exist_ok=True)
            self.mark.write_text(f"{report.compiled} kernels\n")
        return report

    def _read(self) -> Report:
        work = self.report_path.parent
        report = Report(total=len(self.manifest.kernels), seconds=time.perf_counter() - self._t0)
        if (work / "unusable").is_file():
            report.unusable = (work / "unusable").read_text().strip()
            return report
        slowest = (0.0, "")
        for i in range(report.total):
            f = work / "results" / str(i)
            if not f.is_file():
                report.pending += 1
                continue
            result = json.loads(f.read_text())  # written by this module's processes (_child)
            why, seconds = result["why"], float(result["seconds"])
            report.ready, report.busy = max(report.ready, float(result["ready"])), report.busy + seconds
            if not why:
                report.compiled += 1
                slowest = max(slowest, (seconds, self.manifest.kernels[i].label))
            else:
                (report.stale if why.startswith("stale: ") else report.failed).append(why.removeprefix("stale: "))
        if slowest[1]:
            report.slowest = f"{slowest[1].rsplit('.', 1)[-1]} {slowest[0]:.1f} s"
        died = [p.returncode for p in self._procs if p.returncode != 0]
        if report.pending and died:  # a process that died took its claimed kernel with it
            report.failed.append(f"a warm-up process exited with {died[0]} (its log: {work}/process_*.log)")
        return report

    def wait(self, timeout_s: float = WAIT_S) -> str | None:
        """Join the processes; the console line (None if nothing was started)."""
        if not self._procs:
            return None
        t_wait = time.perf_counter()
        report = self.join(timeout_s)
        self._procs = []
        return report.line(time.perf_counter() - t_wait)

    def publish(self) -> None:
        """Join the processes and write the report where the ranks look for it (report_path, whole or not at all)."""
        try:
            report = self.join()
        except Exception as err:  # a report in any case: a rank waits for one before its first step
            report = Report(total=len(self.manifest.kernels), failed=[f"{type(err).__name__}: {str(err)[:160]}"])
        try:
            tmp = self.report_path.with_suffix(".tmp")
            tmp.write_text(report.to_json())
            os.replace(tmp, self.report_path)
        except OSError:  # the job ended and the launcher removed the folder meanwhile (close): no rank is waiting
            pass

    def cancel(self) -> None:
        """Stop the processes (a job that fails before its first step); a no-op once joined."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._procs = []

    def close(self) -> None:
        """Stop the processes if still running and remove their folder."""
        self.cancel()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class LauncherWarmup:
    """A rank's view of the warm-up its launcher started: wait() reads the launcher's report when it is written."""

    def __init__(self, path: Path) -> None:
        self.path, self.ran = path, False

    def start(self) -> None:
        return None  # the launcher printed the start line

    def wait(self, timeout_s: float = WAIT_S) -> str | None:
        t_wait = time.perf_counter()
        while not self.path.is_file():
            if time.perf_counter() - t_wait > timeout_s:
                return f"kernel warm-up: not finished after {timeout_s:.0f} s (the step compiles what is left)"
            time.sleep(0.05)
        try:
            report = Report.from_json(self.path.read_text())
        except ValueError as err:
            return f"kernel warm-up: its report {self.path} is not readable ({err})"
        self.ran = report.skipped is None and report.unusable is None
        return report.line(time.perf_counter() - t_wait)

    def close(self) -> None:
        return None  # the launcher stops its processes and removes their folder


def _manifest(setting: str) -> Manifest | None:
    path = SHIPPED if setting == "auto" else Path(setting)
    return load_manifest(path) if path.is_file() or setting != "auto" else None


def launcher_warmup(setting: str, workers: int, cuda: bool) -> Warmup | None:
    """The launcher's warm-up (train.kernel_warmup / kernel_warmup_workers), not yet started; None where it does not
    apply (off, no GPU). A manifest that fails its checks is a ValueError naming the file."""
    if setting == "none" or workers < 1 or not cuda:
        return None
    manifest = _manifest(setting)
    return Warmup(manifest, workers) if manifest is not None else None


def rank_warmup(setting: str, workers: int, device) -> Warmup | LauncherWarmup | None:
    """A rank's warm-up, to start: the launcher's (MOONTRAIN_WARMUP_REPORT) or its own; None where it does not apply
    (off, no CUDA, not the host's first process)."""
    if setting == "none" or workers < 1 or device.type != "cuda" or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    if report := os.environ.get(REPORT_ENV):
        return LauncherWarmup(Path(report))
    return launcher_warmup(setting, workers, cuda=True)


def _arch_problem(manifest: Manifest) -> str | None:
    """Why this process's GPU cannot use the manifest (None: it can, or no GPU driver answers: each compile then
    fails and says why)."""
    try:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
    except Exception:  # no GPU driver: every entry fails with its own error
        return None
    return usable(manifest, f"sm{target.arch}")


def walk(manifest: Manifest, k: int, n: int) -> list[int]:
    """The order in which process k of n tries the manifest's entries: grouped by module, from the k-th n-th of
    them on, wrapping round. A process imports the modules of the entries it compiles, and fla's takes ~3.4 s (all
    of fla; its kernels are 14 of the shipped manifest's 60): so each module's entries go to the one or two
    processes whose stretch they fall in, unless those are still busy when the others run out."""
    order = sorted(range(len(manifest.kernels)), key=lambda i: (manifest.kernels[i].module, i))
    start = k * len(order) // n
    return order[start:] + order[:start]


def _child(work: Path, epoch: float, k: int, n: int) -> int:
    from moontrain.supervisor import die_with_parent

    die_with_parent()
    manifest = load_manifest(work / "manifest.json")
    if (why := _arch_problem(manifest)) is not None:
        (work / "unusable").write_text(why)
        return 0
    ready = None
    for i in walk(manifest, k, n):
        entry = manifest.kernels[i]
        try:
            os.close(os.open(work / "claims" / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        t0 = time.time()
        ready = t0 - epoch if ready is None else ready
        why = ("stale: " + why) if (why := stale(entry)) is not None else (compile_entry(entry) or "")
        tmp = work / "results" / f"{i}.tmp"
        tmp.write_text(json.dumps({"why": why, "seconds": time.time() - t0, "ready": ready}))
        os.replace(tmp, work / "results" / str(i))
    return 0


def publish_in_background(warmup: Warmup) -> threading.Thread:
    """The launcher's join, in a thread that writes the report for the ranks."""
    thread = threading.Thread(target=warmup.publish, name="moontrain-kernel-warmup", daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
