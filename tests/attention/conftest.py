"""Triton kernels run on CPU tensors through Triton's interpreter; it must be on before triton.jit
decorates them, so set it at import, before any test module imports the kernels."""

import os

os.environ["TRITON_INTERPRET"] = "1"
