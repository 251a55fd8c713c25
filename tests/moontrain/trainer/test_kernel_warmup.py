"""The Triton kernel warm-up's manifests (moontrain.trainer.kernel_warmup): checked before anything is imported or
compiled from them, the recorder's entries, the kernels resolved through autotune wrappers, the command line and
the shipped manifest against this tree (its processes: test_warmup_pool.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from moontrain.trainer import kernel_warmup as kw


def _spec(name: str = "_glu_rows_fwd_kernel", **options) -> str:
    signature = dict.fromkeys(("hu_ptr", "a_ptr", "n_rows", "F", "ACT", "BLOCK_R", "BLOCK_F"), "*bf16")  # its names
    return json.dumps({"name": name, "signature": signature, "constant_keys": [], "constant_vals": [],
                       "attrs_keys": [], "attrs_vals": [], "options": {"num_warps": 4, **options}, "key": "k"})


def _entry(module: str = "moonep.kernels.glu_rows", name: str = "_glu_rows_fwd_kernel", spec: str | None = None
           ) -> dict:
    return {"module": module, "name": name, "specialization": spec if spec is not None else _spec()}


def test_entry_accepted() -> None:
    e = kw.check_entry(_entry(), "t")
    assert (e.module, e.name, e.label) == ("moonep.kernels.glu_rows", "_glu_rows_fwd_kernel",
                                           "moonep.kernels.glu_rows._glu_rows_fwd_kernel")


@pytest.mark.parametrize("raw, match", [
    (_entry(module="os"), r"module 'os' is not a dotted name under moonep, moontrain, fla"),
    (_entry(module="moonep..x"), "is not a dotted name under"),
    (_entry(module="fla.ops; import os"), "is not a dotted name under"),
    (_entry(name="k()"), r"kernel name 'k\(\)' is not a dotted Python name"),
    (_entry(spec="{not json"), "specialization is not JSON"),
    (_entry(spec=json.dumps({"name": "k"})), "specialization must hold exactly"),
    (_entry(spec=_spec(ir_override="/tmp/evil.ttgir")), r"options \['ir_override'\] are not accepted"),
    (_entry(spec=_spec(ptx_options="--output-file /etc/x")), r"options \['ptx_options'\] are not accepted"),
    (_entry(spec=_spec(extern_libs=[["libdevice", "/tmp/evil.bc"]])), r"options \['extern_libs'\] are not accepted"),
    ({"module": "moonep.x", "name": "k"}, "an entry is an object with module, name and specialization"),
])
def test_entry_refused(raw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kw.check_entry(raw, "t")


def test_manifest_round_trip_merge_and_refusals(tmp_path) -> None:
    a = kw.Manifest("3.6", "sm90", [kw.check_entry(_entry(), "t")], {"gpu": "H200"})
    b = kw.Manifest("3.6", "sm90", [kw.check_entry(_entry(), "t"),
                                    kw.check_entry(_entry(spec=_spec(num_stages=3)), "t")])
    path = tmp_path / "m.json"
    path.write_text(a.to_json())
    back = kw.load_manifest(path)
    assert back.kernels == a.kernels and back.made_with == {"gpu": "H200"} and back.digest == a.digest
    merged = kw.merge([a, b])
    assert len(merged.kernels) == 2 and merged.kernels[0] == a.kernels[0]
    with pytest.raises(ValueError, match="one Triton version and GPU architecture"):
        kw.merge([a, kw.Manifest("3.6", "sm80")])
    path.write_text(json.dumps({"format": 1, "triton": "3.6", "arch": "sm90", "kernels": [_entry(module="os")]}))
    with pytest.raises(ValueError, match=r"m.json, entry 0: module 'os'"):
        kw.load_manifest(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="not a format-1 manifest"):
        kw.load_manifest(path)
    with pytest.raises(ValueError, match="not readable JSON"):
        kw.load_manifest(tmp_path / "missing.json")


def test_recorder_keeps_package_kernels_and_chains_the_previous_hook() -> None:
    from triton import knobs

    calls = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kwargs: calls.append(kwargs["fn"].name)
    try:
        with kw.KernelRecorder() as rec:
            hook = knobs.runtime.jit_post_compile_hook
            for module, name in (("moonep.kernels.glu_rows", "_glu_rows_fwd_kernel"), ("mykernels", "k"),
                                 ("moontrain.x", "f.<locals>.k"), ("moonep.kernels.glu_rows", "_glu_rows_fwd_kernel")):
                hook(key="k", repr="r", fn=SimpleNamespace(module=module, name=name),
                     compile={"specialization_data": _spec(extern_libs=[["libdevice", "/opt/x/libdevice.10.bc"]])},
                     is_manual_warmup=False, already_compiled=False)
        assert knobs.runtime.jit_post_compile_hook is not hook  # restored
        m = rec.manifest("sm90")
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert [e.label for e in m.kernels] == ["moonep.kernels.glu_rows._glu_rows_fwd_kernel"]
    assert json.loads(m.kernels[0].specialization)["options"] == {"num_warps": 4}  # the local libdevice path dropped
    assert calls == ["_glu_rows_fwd_kernel", "k", "f.<locals>.k", "_glu_rows_fwd_kernel"]


def test_resolve_through_wrappers() -> None:
    from moonep.kernels import glu_rows

    fn = kw._resolve("moonep.kernels.glu_rows", "_glu_rows_fwd_kernel")  # JITFunction (InterpretedFunction here)
    assert fn is glu_rows._glu_rows_fwd_kernel and fn.fn.__name__ == "_glu_rows_fwd_kernel"
    pytest.importorskip("fla")
    from fla.ops.kda import chunk_intra  # an autotuned kernel: the Autotuner's function

    assert kw._resolve("fla.ops.kda.chunk_intra", "chunk_kda_bwd_kernel_intra").fn.__name__ == \
        "chunk_kda_bwd_kernel_intra" and chunk_intra is not None
    with pytest.raises(ValueError, match="is not a Triton kernel"):
        kw._resolve("moonep.kernels.glu_rows", "glu_forward_rows")


def test_usable() -> None:
    m = kw.Manifest(kw._triton_version(), "sm90", [kw.check_entry(_entry(), "t")])
    assert kw.usable(m, "sm80") == "recorded for sm90, this GPU is sm80"
    assert kw.usable(m, "sm90") is None
    assert "recorded with Triton 0.1" in kw.usable(kw.Manifest("0.1", "sm90"), "sm90")


def test_cli_check_and_merge(tmp_path) -> None:
    a = tmp_path / "a.json"
    a.write_text(kw.Manifest("3.6", "sm90", [kw.check_entry(_entry(), "t")]).to_json())
    out = tmp_path / "m.json"
    run = lambda *args: subprocess.run([sys.executable, "-m", "moontrain.trainer.kernel_warmup", *args],
                                       capture_output=True, text=True, timeout=120)
    r = run("merge", str(out), str(a), str(a))
    assert r.returncode == 0 and "1 kernels from 2 manifests" in r.stdout, r.stderr
    r = run("check", str(out))
    assert r.returncode == 0 and r.stdout.startswith("1 kernels, Triton 3.6, sm90"), r.stderr
    assert run("bogus").returncode == 2
    b = tmp_path / "b.json"  # one entry whose kernel is gone: check fails naming it, prune drops it
    b.write_text(kw.Manifest("3.6", "sm90", [kw.check_entry(_entry(), "t"),
                                             kw.check_entry(_entry(name="not_there"), "t")]).to_json())
    r = run("check", str(b))
    assert r.returncode == 1 and "stale: moonep.kernels.glu_rows.not_there: AttributeError" in r.stdout, r.stdout
    r = run("prune", str(out), str(b))
    assert r.returncode == 0 and "1 kernels kept, 1 stale dropped" in r.stdout, r.stderr
    assert [e.name for e in kw.load_manifest(out).kernels] == ["_glu_rows_fwd_kernel"]


def test_shipped_manifest_passes_its_checks_and_names_this_tree_s_kernels() -> None:
    """The shipped manifest loads (every entry checked) and each moonep / moontrain entry still names a kernel of
    this tree with the parameters it was recorded with: a kernel renamed, removed or given other parameters since
    the recording fails here (record again, `gpu_checks.sh OUT warmup`, or drop the entry: `python -m
    moontrain.trainer.kernel_warmup prune`). fla's entries are checked where fla-core is installed."""
    import importlib.util

    m = kw.load_manifest(kw.SHIPPED)
    assert m.arch == "sm90"
    # recorded on the default KDA route (dq, dk in bf16 into the fused intra stage), on rows and on documents

    def constexprs(e: kw.Entry) -> dict:
        spec = json.loads(e.specialization)
        names = list(spec["signature"])
        return {names[i]: v for (i,), v in zip(spec["constant_keys"], spec["constant_vals"], strict=True)}

    route = {"_walk_kernel", "_intra_norm_kernel", "_kblock_kernel"}
    kda = {(e.name, constexprs(e)["IS_VARLEN"]) for e in m.kernels if e.name in route}
    assert kda == {(n, v) for n in route for v in (True, False)}, kda
    dq = {json.loads(e.specialization)["signature"]["dq"] for e in m.kernels if e.name == "_kblock_kernel"}
    assert dq == {"*bf16"}, dq
    with_fla = importlib.util.find_spec("fla") is not None
    for e in m.kernels:
        if e.module.startswith("fla") and not with_fla:
            continue
        fn = kw._resolve(e.module, e.name)
        assert json.loads(e.specialization)["name"].endswith(fn.fn.__name__), e.label
        assert kw.stale(e) is None, kw.stale(e)
