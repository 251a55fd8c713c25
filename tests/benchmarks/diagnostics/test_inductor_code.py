"""inductor_code's summary of a generated module, on a hand-written call() in the form inductor's wrapper code takes
(the GPU run feeds it run_and_get_code's strings): the user launches with the tensor each reads first, the extern
calls, inductor's kernels and the allocations, in that order."""

from __future__ import annotations

from benchmarks.diagnostics.inductor_code import graph_summary

CODE = '''
cpp_fused_cat_0 = async_compile.cpp_pybinding(['const bfloat16*'], r"""...""")


class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        buf6 = empty_strided_cpu((642, 256), (256, 1), torch.bfloat16)
        cpp_fused_cat_0(primals_2, buf6)
        buf7 = empty_strided_cuda((128, 642), (642, 1), torch.bfloat16)
        extern_kernels.mm(reinterpret_tensor(primals_1, (128, 256), (256, 1), 0), buf6, out=buf7)
        _short_conv_fwd_kernel_0.run(reinterpret_tensor(buf7, (2, 64, 128), (41088, 642, 1), 128), primals_2, -1,
            buf8, 64, 128, stream=streamNone)
        _short_conv_dpre_kernel_0.run(buf9, primals_2, -1, buf10, stream=streamNone)
        return (buf8, )
'''


def test_summary_of_a_call() -> None:
    assert graph_summary(CODE) == [
        "user   _short_conv_fwd_kernel_0 <- reinterpret_tensor(buf7, (2, 64, 128), (41088, 642, 1), 128)",
        "user   _short_conv_dpre_kernel_0 <- buf9",
        "extern mm",
        "kernel cpp_fused_cat_0",
        "alloc  (642, 256) strides (256, 1) bfloat16",
        "alloc  (128, 642) strides (642, 1) bfloat16",
    ]
