"""Triton kernels for the hot operations, installed into the model through the op table (`strata.model.ops.Ops`).

Each kernel has a reference twin in PyTorch that defines what it must compute; the model never calls a kernel
directly, so the reference path runs anywhere and a kernel can be checked against it op by op. The kernels need a
CUDA device (the tests run them under Triton's CPU interpreter).
"""
