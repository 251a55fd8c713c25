"""Triton kernels of moonep's data path (moonep.datapath.triton_path strings them together).
Importing this package never imports triton: the kernel modules import it, and only the triton
data path imports them (CUDA machines), so CPU machines need no triton."""
