"""moonep.triton_interpreter's shim that patches triton.language once: a kernel calling a @triton.jit helper in a
loop, launched again, patches nothing more (triton 3.5 re-patches at every launch and helper call) and still
computes what numpy does; the remembered numpy dtypes are triton's own lookup's for dtypes, pointers and blocks; a
tuple type's name, formed when read, is the one triton forms at construction."""

from __future__ import annotations

import numpy as np
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and installs the interpreter's shims
import tests.moonep.helpers.triton_interpreted  # noqa: F401

# isort: split
import triton
import triton.language as tl
from triton.runtime import interpreter

import moonep.triton_interpreter as shims


@triton.jit
def _scaled(x, i):
    return x * (i + 1)


@triton.jit
def _sum_of_scaled_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros([N], dtype=tl.float32)
    for i in tl.static_range(STEPS):
        acc += _scaled(x, i)
    tl.store(out_ptr + offs, acc)


def test_language_patched_once_and_kernels_still_compute(monkeypatch) -> None:
    x = torch.arange(32, dtype=torch.float32)
    out = torch.full_like(x, -1.0)
    _sum_of_scaled_kernel[(2,)](x, out, N=16, STEPS=3)  # patches the language if no earlier test did
    calls = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (calls.append(a[0]), patch_builtin(*a)))
    out.fill_(-1.0)
    _sum_of_scaled_kernel[(2,)](x, out, N=16, STEPS=3)
    assert calls == [], f"triton.language patched again on a second launch: {len(calls)} module passes"
    np.testing.assert_array_equal(out.numpy(), x.numpy() * (1 + 2 + 3))


def test_remembered_dtypes_answer_as_tritons_lookup() -> None:
    dtypes = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
              tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float8e5, tl.float8e4nv]
    types = [*dtypes, *(tl.pointer_type(t) for t in dtypes), *(tl.block_type(t, [4, 8]) for t in dtypes),
             tl.block_type(tl.pointer_type(tl.float32), [16])]
    for t in types * 2:  # the second pass answers from the cache
        assert shims._get_np_dtype_cached(t) == shims._get_np_dtype(t), t
    assert interpreter._get_np_dtype is shims._get_np_dtype_cached


def test_tuple_type_name_formed_when_read_as_triton_forms_it() -> None:
    types = [tl.int32, tl.block_type(tl.float32, [4, 8]), tl.pointer_type(tl.bfloat16)]
    for fields in (None, ["a", "b", "c"]):
        t = tl.tuple_type(types, fields)
        assert "name" not in vars(t), "the name is formed at construction again"
        names = fields or [""] * len(types)
        want = "[" + ",".join(f"{k}:{v}" for k, v in zip(names, types, strict=True)) + "]"  # triton 3.5 __init__
        assert t.name == str(t) == want, (t.name, want)
    shape = tl.tuple([tl.constexpr(4), tl.constexpr(8)])
    assert str(shape.type) == "[:constexpr_type[4],:constexpr_type[8]]" and shape.type == tl.tuple([4, 8]).type
