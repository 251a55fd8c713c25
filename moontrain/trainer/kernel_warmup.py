"""Triton kernels compiled ahead of the first step, in parallel processes, from a manifest of their specialisations.

On a cold Triton cache the first step compiles every Triton kernel it launches (fla's KDA kernels, moonep's and
moontrain's own) one after the other as the step reaches them: 242 kernels in 173.5 s for k3_small on a fresh H200
machine (docs/performance.md). Which kernels, and how each is specialised (argument dtypes, pointer
alignment, constexprs, warps and stages), does not depend on the data, so it can be recorded once and shipped:

    record   MOONTRAIN_RECORD_KERNELS=<path> on a job: Triton's jit_post_compile_hook lists every kernel the job's
             rank 0 compiles or loads (its module, name and Triton's own specialisation data) and the manifest is
             written when the job ends (KernelRecorder; merge several with `python -m moontrain.trainer.kernel_warmup
             merge OUT IN...`)
    warm     a CUDA job with train.kernel_warmup (default: the shipped recipes/data/triton_kernels_sm90.json) starts
             train.kernel_warmup_workers processes as it starts (moontrain.trainer.warmup_pool: the launcher's,
             before torchrun); each compiles entries into the Triton cache through JITFunction.preload (Triton's
             API for this) and builds their launchers, and the job waits for them before its first step, which
             then finds them compiled

Each kernel is compiled from the source installed now, so a manifest recorded at another commit still serves
every kernel whose parameters are unchanged; entries whose kernel was renamed or whose parameters changed are
left to the step (stale; it compiles those kernels as before; `prune` writes a manifest without them).
Nothing in a manifest decides what runs beyond the choice of a known kernel and its compile settings
(docs/security.md): an entry names a module under moonep, moontrain or fla and a function in it by its
identifiers; its options must not carry an IR file, ptxas options or a library path (the libdevice path is the
local one, as the step's own compile takes it); the recorded GPU architecture and Triton version must be this
machine's, else the manifest is not used and the job says why. A warm cache is marked done (a file named by the
manifest's hash in the Triton cache folder), so later jobs start no processes; clearing the cache clears it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import sys
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "recipes" / "data" / "triton_kernels_sm90.json"
FORMAT = 1
PACKAGES = ("moonep", "moontrain", "fla")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,149}")
FORBIDDEN_OPTIONS = ("ir_override", "ptx_options", "extern_libs")  # a file to load, command-line text, a path


@dataclass(frozen=True, slots=True)
class Entry:
    module: str
    name: str
    specialization: str  # Triton's serialize_specialization_data, as recorded

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"


def _triton_version() -> str:
    import triton

    return ".".join(triton.__version__.split(".")[:2])


def check_entry(raw: object, where: str) -> Entry:
    """One manifest entry, validated (module, name, specialisation data); a ValueError names what is wrong."""
    if not isinstance(raw, dict) or set(raw) != {"module", "name", "specialization"}:
        raise ValueError(f"{where}: an entry is an object with module, name and specialization, got {raw!r:.120}")
    module, name, spec = raw["module"], raw["name"], raw["specialization"]
    parts = module.split(".") if isinstance(module, str) else []
    if not parts or parts[0] not in PACKAGES or not all(IDENT.fullmatch(p) for p in parts):
        raise ValueError(f"{where}: module {module!r} is not a dotted name under {', '.join(PACKAGES)}")
    if not isinstance(name, str) or not all(IDENT.fullmatch(p) for p in name.split(".")):
        raise ValueError(f"{where}: kernel name {name!r} is not a dotted Python name")
    try:
        data = json.loads(spec) if isinstance(spec, str) else None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: {module}.{name}: specialization is not JSON ({err})") from err
    need = {"name", "signature", "constant_keys", "constant_vals", "attrs_keys", "attrs_vals", "options", "key"}
    if not isinstance(data, dict) or set(data) != need or not isinstance(data["options"], dict):
        raise ValueError(f"{where}: {module}.{name}: specialization must hold exactly {sorted(need)}")
    bad = [k for k in FORBIDDEN_OPTIONS if data["options"].get(k) not in (None, "", [], {})]
    if bad:
        raise ValueError(f"{where}: {module}.{name}: options {bad} are not accepted from a manifest")
    return Entry(module, name, spec)


@dataclass(slots=True)
class Manifest:
    triton: str  # major.minor of the Triton that recorded it
    arch: str  # e.g. sm90
    kernels: list[Entry] = field(default_factory=list)
    made_with: dict = field(default_factory=dict)

    def to_json(self) -> str:
        kernels = [{"module": e.module, "name": e.name, "specialization": e.specialization} for e in self.kernels]
        return json.dumps({"format": FORMAT, "triton": self.triton, "arch": self.arch, "made_with": self.made_with,
                           "kernels": kernels}, indent=1) + "\n"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]


def load_manifest(path: str | Path) -> Manifest:
    """A manifest file, every entry validated (check_entry); a ValueError names the file and the fault."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"kernel manifest {path}: not readable JSON ({err})") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("kernels"), list):
        raise ValueError(f"kernel manifest {path}: not a format-{FORMAT} manifest (format, triton, arch, kernels)")
    if not isinstance(raw.get("triton"), str) or not isinstance(raw.get("arch"), str):
        raise ValueError(f"kernel manifest {path}: triton and arch must be strings")
    kernels = [check_entry(k, f"kernel manifest {path}, entry {i}") for i, k in enumerate(raw["kernels"])]
    made_with = raw.get("made_with") if isinstance(raw.get("made_with"), dict) else {}
    return Manifest(raw["triton"], raw["arch"], kernels, made_with)


def merge(manifests: list[Manifest]) -> Manifest:
    """One manifest holding each distinct (module, name, specialisation) once, in first-seen order."""
    if not manifests or len({(m.triton, m.arch) for m in manifests}) != 1:
        raise ValueError("merge takes one or more manifests of one Triton version and GPU architecture, got "
                         f"{sorted({(m.triton, m.arch) for m in manifests})}")
    seen: dict[tuple[str, str, str], Entry] = {}
    for m in manifests:
        for e in m.kernels:
            seen.setdefault((e.module, e.name, e.specialization), e)
    return Manifest(manifests[0].triton, manifests[0].arch, list(seen.values()), manifests[0].made_with)


class KernelRecorder:
    """Lists the Triton kernels this process compiles or loads (Triton's jit_post_compile_hook) while active."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str, str], Entry] = {}
        self._previous = None

    def _hook(self, *, fn, compile, **kwargs):
        spec = compile.get("specialization_data")
        if isinstance(spec, str) and "<locals>" not in fn.name:
            self.entries.setdefault((fn.module, fn.name, spec), Entry(fn.module, fn.name, spec))
        return self._previous(fn=fn, compile=compile, **kwargs) if self._previous else None

    def __enter__(self) -> KernelRecorder:
        from triton import knobs

        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = self._previous

    def manifest(self, arch: str, made_with: dict | None = None) -> Manifest:
        """The entries under PACKAGES (others, e.g. a user's own kernels, are left out) as a manifest."""
        kernels = []
        for e in self.entries.values():
            data = json.loads(e.specialization)
            if not isinstance(data.get("options"), dict):
                continue
            data["options"].pop("extern_libs", None)  # this machine's libdevice path: the compile takes its own
            try:
                kernels.append(check_entry({"module": e.module, "name": e.name, "specialization": json.dumps(data)},
                                           "recorded"))
            except ValueError:  # another package's kernel, or options a manifest may not carry
                continue
        return Manifest(_triton_version(), arch, kernels, made_with or {})


def _resolve(module: str, name: str):
    """The JITFunction named by an entry: the module attribute, through autotune / heuristics wrappers."""
    from triton.runtime.interpreter import InterpretedFunction  # @triton.jit under TRITON_INTERPRET=1
    from triton.runtime.jit import JITFunction

    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    for _ in range(8):
        if isinstance(obj, JITFunction | InterpretedFunction):
            return obj
        obj = getattr(obj, "fn", None)
    raise ValueError(f"{module}.{name} is not a Triton kernel")


def stale(entry: Entry) -> str | None:
    """Why an entry no longer fits this tree's kernel (renamed, removed, or its parameters changed since the
    recording), else None. Such an entry is not handed to the processes: the step compiles that kernel."""
    try:
        fn = _resolve(entry.module, entry.name)
    except (ImportError, AttributeError, ValueError) as err:
        return f"{entry.label}: {type(err).__name__}: {str(err)[:120]}"
    recorded, now = list(json.loads(entry.specialization)["signature"]), list(fn.arg_names)
    if recorded != now:
        i, (was, is_) = next((i, pair) for i, pair in enumerate(zip_longest(recorded, now, fillvalue="-"))
                             if pair[0] != pair[1])
        return (f"{entry.label}: recorded with {len(recorded)} parameters, this tree's kernel takes {len(now)} "
                f"(parameter {i}: {was} -> {is_})")
    return None


def prune(manifest: Manifest) -> tuple[Manifest, list[str]]:
    """The manifest without its stale entries, and why each was dropped."""
    kept, dropped = [], []
    for e in manifest.kernels:
        why = stale(e)
        if why is None:
            kept.append(e)
        else:
            dropped.append(why)
    return Manifest(manifest.triton, manifest.arch, kept, manifest.made_with), dropped


def compile_entry(entry: Entry) -> str | None:
    """Compile one entry into Triton's cache, its launcher included (a warm-up process's task); None on success,
    else why not (the step compiles that kernel as before)."""
    try:
        data = json.loads(entry.specialization)
        for key in FORBIDDEN_OPTIONS:
            data["options"].pop(key, None)  # the local libdevice, as the step's own compile takes it
        kernel = _resolve(entry.module, entry.name).preload(json.dumps(data))
    except Exception as err:  # a changed kernel: the step compiles it as before
        return f"{entry.label}: {type(err).__name__}: {str(err)[:160]}"
    try:
        from triton.runtime.driver import driver

        # what CompiledKernel._init_handles builds at the first launch: cached by its source, found by the step
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as err:
        return f"{entry.label}: compiled, but its launcher was not built: {type(err).__name__}: {str(err)[:120]}"
    return None


def cache_dir() -> Path:
    """Triton's cache folder (knobs.cache.dir: TRITON_CACHE_DIR, else under TRITON_HOME or the home folder)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def usable(manifest: Manifest, arch: str) -> str | None:
    """Why this machine cannot use the manifest, or None."""
    if manifest.arch != arch:
        return f"recorded for {manifest.arch}, this GPU is {arch}"
    if manifest.triton != _triton_version():
        return f"recorded with Triton {manifest.triton}, this is Triton {_triton_version()}"
    return None


def _main(argv: list[str]) -> int:
    usage = ("python -m moontrain.trainer.kernel_warmup merge OUT IN [IN ...]   (one manifest of several)\n"
             "python -m moontrain.trainer.kernel_warmup check [MANIFEST]       (validate; default the shipped one)\n"
             "python -m moontrain.trainer.kernel_warmup prune OUT [MANIFEST]   (without entries stale in this tree)")
    if len(argv) >= 3 and argv[0] == "merge":
        merged = merge([load_manifest(p) for p in argv[2:]])
        Path(argv[1]).write_text(merged.to_json())
        print(f"{argv[1]}: {len(merged.kernels)} kernels from {len(argv) - 2} manifests")
        return 0
    if argv and argv[0] == "check" and len(argv) <= 2:
        m = load_manifest(argv[1] if len(argv) == 2 else SHIPPED)
        print(f"{len(m.kernels)} kernels, Triton {m.triton}, {m.arch}; made with {m.made_with}")
        dropped = prune(m)[1]
        for why in dropped:
            print(f"stale: {why}")
        return 1 if dropped else 0
    if len(argv) in (2, 3) and argv[0] == "prune":
        pruned, dropped = prune(load_manifest(argv[2] if len(argv) == 3 else SHIPPED))
        Path(argv[1]).write_text(pruned.to_json())
        print(f"{argv[1]}: {len(pruned.kernels)} kernels kept, {len(dropped)} stale dropped")
        for why in dropped:
            print(f"  {why}")
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
