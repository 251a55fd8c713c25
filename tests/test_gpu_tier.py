"""What tests/conftest.py does on a GPU machine: no collected module sets TRITON_INTERPRET, and fla's
autotune choices are seeded into Triton's cache.

A module that sets TRITON_INTERPRET=1 at import, itself or through a tests module it imports, runs every
Triton kernel of the session in the interpreter; on a GPU that fails every kernel test. Such modules are
named *_interpreted.py and conftest does not collect them on a GPU machine. Checked two ways on the CPU:
- every tests module is scanned (its import-time statements, not its functions); each one that sets the
  variable, or imports one that does, must be named *_interpreted.py (conftest.py files never; tests/conftest.py
  sets it itself on a machine without a GPU, so that any selection of CPU tests runs as the whole tier does,
  and the collection below checks that it does not where torch sees one);
- the GPU tier of tests/moonep (where most of them live) is collected in a subprocess whose torch reports
  one CUDA GPU: no *_interpreted module is collected, TRITON_INTERPRET is unset when collection ends, and
  the gpu tests are there (the whole tree would take ~10 s of CPU; the scan covers it).
(The seeding of fla's autotune choices is tests/moontrain/trainer/test_kernel_cache.py's.)
The GPU tests' one convention (tests/conftest.py): the marker, no GPU folder; a module named *_gpu.py or
*_multigpu.py marks every one of its tests so.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests import conftest

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
VAR = "TRITON_INTERPRET"
ENV_SETTERS = {"setdefault", "update", "putenv", "setenv"}


def _import_time_nodes(tree: ast.Module) -> list[ast.AST]:
    """The nodes a module runs when imported: a function's decorators and default values run then, its
    body only when called."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(getattr(node, "decorator_list", []))
            stack.extend(d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return nodes


def _sets_var(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
        return isinstance(node.slice, ast.Constant) and node.slice.value == VAR
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ENV_SETTERS:
        return (any(isinstance(a, ast.Constant) and a.value == VAR for a in node.args)
                or any(k.arg == VAR for k in node.keywords))
    return False


def _imported_modules(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


def interpreter_modules() -> dict[str, Path]:
    """Every module under tests/ that sets TRITON_INTERPRET at import, itself or by importing one that does;
    tests/conftest.py aside: it sets it only without a GPU (ON_GPU), which test_gpu_collection_leaves_the_
    interpreter_off checks by collecting as on a GPU machine."""
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in TESTS_DIR.rglob("*.py")
             if p != TESTS_DIR / "conftest.py"}
    sets, imports = set(), {}
    for name, path in paths.items():
        nodes = _import_time_nodes(ast.parse(path.read_text(), str(path)))
        if any(_sets_var(n) for n in nodes):
            sets.add(name)
        imports[name] = {m for n in nodes for m in _imported_modules(n) if m in paths}
    changed = True
    while changed:
        grown = {name for name, deps in imports.items() if deps & sets}
        changed = not grown <= sets
        sets |= grown
    return {name: paths[name] for name in sorted(sets)}


def test_every_module_setting_triton_interpret_is_left_out_on_a_gpu(monkeypatch) -> None:
    found = interpreter_modules()
    # the scan sees both ways in: an assignment (helpers/triton_interpreted) and an import of such a module
    assert {"tests.moonep.helpers.triton_interpreted", "tests.moonep.kernels.test_expert_math_interpreted",
            "tests.moontrain.optim.test_write_back_interpreted"} <= found.keys(), sorted(found)
    misnamed = [name for name, path in found.items()
                if path.name == "conftest.py" or not path.name.endswith(conftest.INTERPRETED_SUFFIX)]
    assert not misnamed, (f"{misnamed} set {VAR} at import but would be collected on a GPU machine; "
                          f"name them *{conftest.INTERPRETED_SUFFIX} (tests/conftest.py leaves those out there)")
    monkeypatch.setattr(conftest, "ON_GPU", True)
    assert all(conftest.pytest_ignore_collect(path, None) for path in found.values())
    assert conftest.pytest_ignore_collect(TESTS_DIR / "moonep" / "test_planner.py", None) is None
    monkeypatch.setattr(conftest, "ON_GPU", False)
    assert not any(conftest.pytest_ignore_collect(path, None) for path in found.values())


FAKE_GPU_PLUGIN = '''
import os
import torch

torch.cuda.is_available = lambda: True  # before tests/conftest.py reads it: collect as on a one-GPU machine
torch.cuda.device_count = lambda: 1
# where fla-core is installed, tests/conftest.py seeds fla's autotune choices into Triton's cache (a temporary
# folder here), as on a GPU machine: it reads the device's architecture and name
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "NVIDIA H200 (faked)"


def pytest_collection_finish(session):
    print("TRITON_INTERPRET after collection:", os.environ.get("TRITON_INTERPRET"))
'''


def test_gpu_collection_leaves_the_interpreter_off(tmp_path: Path) -> None:
    (tmp_path / "fake_one_gpu.py").write_text(FAKE_GPU_PLUGIN)
    env = {k: v for k, v in os.environ.items() if k != VAR}  # this CPU session may have set it
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path / "triton_cache"), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "fake_one_gpu", "-p", "no:cacheprovider", "--co", "-q",
                          "-m", "gpu or multigpu", "tests/moonep"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    node_ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert "TRITON_INTERPRET after collection: None" in out.stdout, out.stdout[-3000:]
    assert not [n for n in node_ids if "_interpreted.py" in n], node_ids
    assert any(n.startswith("tests/moonep/datapath/test_triton_path_gpu.py::") for n in node_ids), out.stdout[-3000:]


def _marks(node: ast.AST) -> set[str]:
    """Names X of every `pytest.mark.X` in an expression (a decorator, or pytestmark's value)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "mark" and isinstance(n.value.value, ast.Name) and n.value.value.id == "pytest"}


def unmarked_gpu_tests(tests_dir: Path) -> list[str]:
    """Tests of modules named *_gpu.py / *_multigpu.py without that marker (the module's pytestmark or their
    own decorator); a folder named gpu counts as a whole miss."""
    found = [p.relative_to(tests_dir).as_posix() + "/" for p in tests_dir.rglob("gpu") if p.is_dir()]
    for path in sorted(tests_dir.rglob("test_*.py")):
        marker = "multigpu" if path.stem.endswith("_multigpu") else "gpu" if path.stem.endswith("_gpu") else None
        if marker is None:
            continue
        tree = ast.parse(path.read_text(), str(path))
        module = set().union(*(_marks(n.value) for n in tree.body if isinstance(n, ast.Assign)
                               and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)))
        if marker in module:
            continue
        found += [f"{path.relative_to(tests_dir).as_posix()}::{n.name}" for n in tree.body
                  if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
                  and marker not in set().union(*(_marks(d) for d in n.decorator_list))]
    return found


def test_gpu_test_modules_carry_their_marker(tmp_path: Path) -> None:
    assert unmarked_gpu_tests(TESTS_DIR) == []
    # the check itself: a planted folder, an unmarked test, a multigpu module marked gpu only
    (tmp_path / "gpu").mkdir()
    (tmp_path / "test_a_gpu.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_x(): pass\n\ndef test_y(): pass\n")
    (tmp_path / "test_b_multigpu.py").write_text("import pytest\n\npytestmark = [pytest.mark.gpu]\n\ndef test_z(): pass\n")
    (tmp_path / "test_c_gpu.py").write_text("import pytest\n\npytestmark = [pytest.mark.slow, pytest.mark.gpu]\n\n"
                                            "def test_w(): pass\n")
    assert unmarked_gpu_tests(tmp_path) == ["gpu/", "test_a_gpu.py::test_y", "test_b_multigpu.py::test_z"]


def test_importing_the_library_imports_no_triton() -> None:
    """On the CPU the interpreted tests need triton imported after TRITON_INTERPRET is set; the test modules
    collected before them import the trainer, the model and the benchmarks' diagnostics, so none of those may
    import triton (or torch._dynamo, which does) at import time: a kernel module or torch.compiler.disable as
    a decorator is imported or applied where it runs, not with the module."""
    modules = ["moontrain.trainer.trainer", "moontrain.model.transformer", "moontrain.model.kda.layer", "moontrain.cli",
               "moonep", "benchmarks.diagnostics.train_diagnostics"]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != VAR}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout
