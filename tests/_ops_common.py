"""Where the Triton op tests run: on CUDA, or on CPU under TRITON_INTERPRET=1 (CI); the torch path runs anywhere."""

import os

import pytest
import torch

from hf_cascade.ops import triton_available

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if CUDA and not INTERPRET else "cpu"
TRITON_OK = triton_available() and (CUDA or INTERPRET)
needs_triton = pytest.mark.skipif(
    not TRITON_OK, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (and triton installed)"
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
NEG_INF = float("-inf")
