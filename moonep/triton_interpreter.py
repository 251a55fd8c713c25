"""Triton's interpreter (TRITON_INTERPRET=1) on the CPU with the numpy and triton this project pins: the shims
its kernels need, applied to triton.runtime.interpreter when this module is imported. For the interpreted tests
(tests/moonep/helpers/triton_interpreted.py imports it) and CPU diagnostics that run moonep's and moontrain's
kernels in the interpreter (benchmarks/diagnostics/host_overhead.py); nothing in a training step imports it.

- a runtime scalar used as an index (a kernel loop to a kernel argument) through the array's one element (numpy 2
  rejects int() of a 1-element array);
- tl.histogram's counts as the int32 data its label promises;
- tl.dot on bf16 operands through their fp32 values (the interpreter multiplies their uint16 bits), fp32 products
  summed in float64 and rounded once (the same on every CPU, whatever BLAS kernel numpy picks);
- reductions and scans with a custom combine function on whole slices at once, not element by element;
- triton.language patched once per set of language modules a kernel sees, not at every launch and helper call;
- the numpy dtype of a Triton dtype remembered, not looked up in a table rebuilt at every operation;
- a tuple type's printed name formed when read, not at each of the ~10^6 tuples the interpreter builds a case.
"""

from __future__ import annotations

import functools

import numpy as np
from triton.runtime import interpreter as _interpreter

_patch_lang_tensor = _interpreter._patch_lang_tensor


def _patch_lang_tensor_numpy2(tensor):
    """triton 3.5's interpreter turns a runtime scalar into an index with int() of a 1-element array,
    which numpy 2.4 rejects (a kernel loop `range(0, n)` with n a kernel argument fails); index
    through the array's single element instead. Test-only shim: the GPU never runs the interpreter."""
    _patch_lang_tensor(tensor)
    tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])


_interpreter._patch_lang_tensor = _patch_lang_tensor_numpy2
_create_histogram = _interpreter.InterpreterBuilder.create_histogram


def _create_histogram_int32(self, data, bins, mask):
    """triton 3.5's interpreter labels np.histogram's int64 counts int32, so arithmetic on them
    stores 8-byte elements into int32 memory; give them the int32 data the label promises."""
    out = _create_histogram(self, data, bins, mask)
    return _interpreter.TensorHandle(out.data.astype(np.int32), out.dtype)


_interpreter.InterpreterBuilder.create_histogram = _create_histogram_int32
_create_dot = _interpreter.InterpreterBuilder.create_dot


def _create_dot_fp32(self, a, b, d, input_precision, max_num_imprecise_acc):
    """triton 3.5's interpreter stores bf16 as its uint16 bits and multiplies those; give tl.dot the
    fp32 values (exact: a bf16 value is an fp32 value with its low 16 bits zero). An fp32 product is
    summed in float64 and rounded to fp32 once: the interpreter's np.matmul in fp32 sums in the order of
    the BLAS kernel numpy's OpenBLAS picks for the CPU and the block's shape (its Haswell kernels, which it
    also runs on AMD's Zen, sum a [16, 16] x [16, 32] product's columns unlike the same columns of a
    [16, 16] x [16, 64] one), so two launches of one kernel with different tiles would differ by the CPU.
    In float64 the order moves a sum by ~2^-50 of it, which the rounding to fp32 removes."""
    def as_fp32(x):
        if x.dtype.scalar != _interpreter.tl.bfloat16:
            return x
        return _interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), _interpreter.tl.float32)

    a, b = as_fp32(a), as_fp32(b)
    if a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return _interpreter.TensorHandle(product + d.data, d.dtype.scalar)
    return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


_interpreter.InterpreterBuilder.create_dot = _create_dot_fp32


def _combine_slices(op, left, right, dtypes):
    """The combine function of a reduce / scan applied to whole numpy slices at once: flattened and
    padded to a power of two (a block's shape), the padding's results dropped."""
    shape, size = left[0].shape, left[0].size
    padded = 1 << max(0, size - 1).bit_length()

    def block(x, t):
        return op.to_tensor(np.pad(x.reshape(-1), (0, padded - size), mode="edge"), t)

    out = op.combine_fn.fn(*(block(x, t) for x, t in zip(left, dtypes, strict=True)),
                           *(block(x, t) for x, t in zip(right, dtypes, strict=True)))
    return [o.handle.data[:size].reshape(shape) for o in (out if isinstance(out, tuple) else (out,))]


def _generic_reduce_vectorized(self, input):
    """triton 3.5's interpreter reduces with a custom combine function (a tuple reduction) in a
    Python loop over every element, seconds per planner program; combine adjacent pairs of whole
    slices instead, the earlier on the left (Triton's combine functions are associative)."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    while data[0].shape[0] > 1:
        n = data[0].shape[0] // 2 * 2
        pairs = _combine_slices(self, [d[0:n:2] for d in data], [d[1:n:2] for d in data], dtypes)
        data = [np.concatenate([p, d[n:]]) for p, d in zip(pairs, data, strict=True)]
    ret = []
    for d, t in zip(data, dtypes, strict=True):
        d = d[0]
        if self.keep_dims:
            d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * len(input[0].shape))
        elif original_axis is None:
            d = d.item()
        ret.append(self.to_tensor(d, t))
    return ret


def _generic_scan_vectorized(self, input):
    """An inclusive scan with a custom combine function as log2(n) steps on whole slices
    (Hillis-Steele: element i combines element i - 2**k on the left), not a loop per element."""
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, self.axis, 0) for arg in input]
    k = 1
    while k < data[0].shape[0]:
        new = _combine_slices(self, [d[:-k] for d in data], [d[k:] for d in data], dtypes)
        data = [np.concatenate([d[:k], x]) for d, x in zip(data, new, strict=True)]
        k *= 2
    return [self.to_tensor(np.moveaxis(d, 0, self.axis), t) for d, t in zip(data, dtypes, strict=True)]


_interpreter.ReduceOps.generic_reduce = _generic_reduce_vectorized
_interpreter.ScanOps.generic_scan = _generic_scan_vectorized

_patch_lang = _interpreter._patch_lang
_patched: set[frozenset[int]] = set()


def _patch_lang_once(fn):
    """triton 3.5's interpreter patches triton.language (inspect.getmembers over its modules) at every launch
    and at every call of a @triton.jit helper inside a kernel: 45 % of an R = 8 fused-planner case (14.5 s -> 7.9).
    The patches replace the language's builtins in place and nothing undoes them, so a second pass over the
    same modules changes nothing; run it once per set of modules (tl, tl.core) a function's globals hold."""
    langs = frozenset(id(v) for v in fn.__globals__.values() if v is _interpreter.tl or v is _interpreter.tl.core)
    if langs not in _patched:
        _patch_lang(fn)  # also raises, as triton does, for a function that sees neither module
        _patched.add(langs)


_interpreter._patch_lang = _patch_lang_once

_get_np_dtype = _interpreter._get_np_dtype
_element_np_dtype = functools.lru_cache(maxsize=64)(_get_np_dtype)
_UINT64 = np.dtype(np.uint64)


def _get_np_dtype_cached(tt_dtype):
    """triton 3.5's _get_np_dtype, remembered per scalar dtype: it builds its 18-entry table at every call (every
    operation; the R = 8 fused-planner case: 7.9 s -> 6.7). A block's numpy dtype is its element's (triton's
    rule), a pointer's uint64 (triton's too): both are unhashable, only the scalar dtypes go through the cache."""
    if isinstance(tt_dtype, _interpreter.tl.block_type):
        tt_dtype = tt_dtype.element_ty
    if isinstance(tt_dtype, _interpreter.tl.pointer_type):
        return _UINT64
    return _element_np_dtype(tt_dtype)


_interpreter._get_np_dtype = _get_np_dtype_cached


_tuple_type = _interpreter.tl.core.tuple_type


def _tuple_type_init_unnamed(self, types, fields=None):
    """triton 3.5's tuple_type.__init__ less its name: it formats the name string (every member type printed) for
    each tuple it builds, and the interpreter builds one per tensor (its shape) and per block type, ~10^6 a fused-
    planner case at R = 8, whose name nothing reads but printing (10.4 s -> 8.8). `name` is formed when read."""
    self.types = types
    self.fields = fields or [""] * len(types)


def _tuple_type_name(self) -> str:
    return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types, strict=False)]) + "]"


_tuple_type.__init__ = _tuple_type_init_unnamed
_tuple_type.name = property(_tuple_type_name)
