"""The first training step's wait on a GPU, said before it and accounted after it (rank 0's console).

Before (first_step_note): what the step does besides training (torch.compile of the dense layers, fla's
autotuning of its KDA kernels and whether its shipped tile choices were seeded, Triton compiling moonep's
kernels); none of it happens again in later steps.

After (FirstStepClock, read by Trainer.fit after the job's first step), one line:

    first step 41.2 s (torch.compile 24.9 s; fla autotune: 0 shapes searched, 42 entries seeded from ...)

- the step's wall time: it ends in the step's host reads (Trainer.fit takes the first step's at once, not
  in the next step), so the GPU work of the step is inside it;
- torch.compile: the host time torch._dynamo spent compiling during the step, frames and their lazily
  compiled backward graphs (calculate_time_spent's total_wall_time, the sum of its entire_frame_compile and
  entire_backward_compile), read without a GPU sync; left out below 0.05 s;
- Triton: the kernels Triton compiled in this process during the step because its cache had none (fla's,
  moonep's, moontrain's; not inductor's, whose compile workers are other processes and whose time is
  torch.compile's) and the host seconds it spent on them, from Triton's compilation listener, per package
  with the slowest kernel named; left out when none. On a fresh machine this is most of the wait (minutes for k3_small: docs/performance.md);
  later runs on the machine reuse the cache (TRITON_CACHE_DIR);
- fla autotune: the autotune results the step added to Triton's cache (fla writes one per kernel and
  shape it searched; by default nothing else writes them: moonep's autotune keeps its choices in memory),
  counted on rank 0's host, with what seeding did (moontrain.trainer.kernel_cache).

The rest of the total (fla's searches, the step's own work) cannot be told apart without a sync per kernel,
so it is not split.
"""

from __future__ import annotations

import sys
import time

import torch

from moontrain.config import RunConfig
from moontrain.model.kda.layer import uses_fla
from moontrain.trainer.kernel_cache import FlaSeed, FlaSeeds, autotune_entries


def first_step_note(cfg: RunConfig, device: torch.device, fla_seed: FlaSeed | FlaSeeds | None = None,
                    warmed: bool = False) -> str | None:
    """What makes the first GPU step slow, said before it starts (it can take a minute or more). fla_seed:
    what seeding Triton's cache did (None: not seeded); warmed: the kernel warm-up compiled its manifest's
    kernels just before (moontrain.trainer.kernel_warmup)."""
    if device.type != "cuda":
        return None
    fla = "fla autotunes its KDA kernels"
    if fla_seed is not None and fla_seed.mismatch is not None:
        fla += f" for every shape (minutes; {fla_seed.describe()})"
    elif fla_seed is not None:
        fla += f" for shapes beyond the {fla_seed.describe()} (Triton's cache: {fla_seed.cache_dir})"
    work = [what for what, on in (
        ("torch.compile compiles the dense layers (train.compile)", cfg.train.compile),
        (fla, uses_fla(cfg.model, cfg.kernels.kda, device)),
        ("Triton compiles the kernels the warm-up did not" if warmed else "Triton compiles moonep's kernels",
         cfg.experts.backend == "moonep")) if on]
    if not work:
        return None
    return f"the first step also {'; '.join(work)}: it can take a minute or more (later steps reuse them)"


def compile_seconds() -> float:
    """Host seconds torch.compile has spent in this process so far (frames and lazy backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent()["total_wall_time"]


class TritonCompiles:
    """The kernels Triton compiles in this process (cache misses), each with its package (fla, moonep, moontrain,
    also for their kernels re-emitted by torch.compile, or "other": inductor's own compiles run in its
    workers) and host seconds, through
    triton.knobs.compilation.listener, until close(); a listener already installed keeps being called."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, str, float]] = []  # (package, kernel name, host seconds)
        self._names: dict[str, str] = {}  # kernel name -> package, for kernels compiled from generated modules
        self._knobs, self._previous = None, None
        try:  # here, not at import: the library imports no Triton on the CPU
            from triton import knobs
        except ImportError:
            return
        compilation = getattr(knobs, "compilation", None)
        if compilation is None or not hasattr(compilation, "listener"):  # a Triton without the listener: no count
            return
        self._knobs, self._previous = compilation, compilation.listener
        compilation.listener = self.record

    @property
    def kernels(self) -> int:
        return len(self.compiled)

    @property
    def seconds(self) -> float:
        return sum(sec for _, _, sec in self.compiled)

    def record(self, *, src, metadata, metadata_group, times, cache_hit: bool) -> None:
        """Triton's CompilationListener protocol (times in microseconds; src an ASTSource, whose fn is the
        @triton.jit function, or an IRSource without one)."""
        if not cache_hit:
            fn = getattr(src, "fn", None)
            module = getattr(fn, "__module__", None) or ""
            name = getattr(src, "name", None) or getattr(fn, "__name__", None) or "?"
            package = module.split(".")[0] if module.split(".")[0] in PACKAGES else self._package_of(name)
            self.compiled.append((package, name, getattr(times, "total", 0) / 1e6))
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                           cache_hit=cache_hit)

    def _package_of(self, name: str) -> str:
        """The package of a kernel compiled from another module: torch.compile re-emits the Triton kernels a
        compiled region calls (moontrain's convolution, say) in a generated module of its own, under their
        names. The one package in PACKAGES whose loaded modules hold a Triton kernel of that name, else
        "other" (inductor's own kernels, or a name two packages share)."""
        if name not in self._names:
            homes = set()
            try:  # runs inside Triton's compile: a Triton without these classes must not fail the compile
                from triton.runtime import KernelInterface  # JITFunction, Autotuner, Heuristics
                from triton.runtime.interpreter import InterpretedFunction  # @triton.jit under TRITON_INTERPRET=1
            except ImportError:
                kinds = ()
            else:
                kinds = (KernelInterface, InterpretedFunction)
            for module_name, module in list(sys.modules.items()):
                top = module_name.split(".")[0]
                if kinds and top in PACKAGES and isinstance(getattr(module, name, None), kinds):
                    homes.add(top)
            self._names[name] = homes.pop() if len(homes) == 1 else "other"
        return self._names[name]

    def close(self) -> None:
        if self._knobs is not None and self._knobs.listener == self.record:
            self._knobs.listener = self._previous


PACKAGES = ("fla", "moonep", "moontrain")  # whose compiles the first step's line counts apart


def compiles_by_package(compiled: list[tuple[str, str, float]]) -> str:
    """"fla 120: 90.1 s, moonep 70: 50.2 s" (kernels and host seconds per package, most seconds first), then
    the slowest kernel: where a cold cache's wait goes, and what to look at to shorten it."""
    per: dict[str, list[float]] = {}
    for package, _, sec in compiled:
        per.setdefault(package, []).append(sec)
    parts = [f"{pkg} {len(secs)}: {sum(secs):.1f} s"
             for pkg, secs in sorted(per.items(), key=lambda kv: (-sum(kv[1]), kv[0]))]
    package, name, sec = max(compiled, key=lambda c: c[2])
    return ", ".join(parts) + f"; slowest {package} {name} {sec:.1f} s"


class FirstStepClock:
    """Started right before the first step; line() after it says what the wait was. triton: count Triton's
    compiles (a GPU job)."""

    def __init__(self, fla_seed: FlaSeed | FlaSeeds | None, triton: bool = True) -> None:
        self.fla_seed = fla_seed
        self.entries = autotune_entries(fla_seed.cache_dir) if fla_seed is not None else 0
        self.compiles = TritonCompiles() if triton else None
        self.compiled_s = compile_seconds()
        self.t0 = time.perf_counter()

    def measure(self) -> tuple[float, float, int]:
        """(seconds since the start, of them torch.compile's, autotune entries added to the cache)"""
        total_s = time.perf_counter() - self.t0
        searched = autotune_entries(self.fla_seed.cache_dir) - self.entries if self.fla_seed is not None else 0
        return total_s, compile_seconds() - self.compiled_s, searched

    def line(self) -> str:
        """The line (once: the Triton count stops here)."""
        total_s, compile_s, searched = self.measure()
        triton = None
        if self.compiles is not None:
            self.compiles.close()
            triton = self.compiles.compiled
        return first_step_line(total_s, compile_s, self.fla_seed, searched, triton)


def first_step_line(total_s: float, compile_s: float, fla_seed: FlaSeed | FlaSeeds | None, searched: int,
                    triton: list[tuple[str, str, float]] | None = None) -> str:
    """The console line after the first step. fla_seed None: the run does not use fla. triton: the kernels
    Triton compiled (TritonCompiles.compiled: package, name, host seconds), said when any were."""
    parts = [f"torch.compile {compile_s:.1f} s"] if compile_s >= 0.05 else []
    if triton:
        n, sec = len(triton), sum(s for _, _, s in triton)
        parts.append(f"Triton compiled {n} kernel{'' if n == 1 else 's'} in {sec:.1f} s ({compiles_by_package(triton)}): "
                     "a cold cache, which later runs on this machine reuse")
    if fla_seed is not None:
        parts.append(f"fla autotune: {searched} shape{'' if searched == 1 else 's'} searched, {fla_seed.describe()}")
    return f"first step {total_s:.1f} s" + (f" ({'; '.join(parts)})" if parts else "")
