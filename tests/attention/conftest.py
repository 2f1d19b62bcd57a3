"""Triton kernels run on CPU tensors through Triton's interpreter. Triton reads TRITON_INTERPRET
when it decorates a function, its own library's included, so it must be set before triton is
first imported: here, at import, unless the environment already has it."""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/attention set TRITON_INTERPRET=1; export it instead")
os.environ["TRITON_INTERPRET"] = "1"
