"""llama.cpp's OpenAI server (llama-cpp-python, installed by ../shared/peers/llamacpp.sh) started as
that script starts it, except that it accepts any x-request-id header: vLLM's bench client sends
ids like "bench-1a2b-7", and the server's UUID check answers every such request 400.

    LLAMACPP_VENV/bin/python benchmarks/llamacpp_server.py --model FILE.gguf [llama_cpp.server flags]
"""

import runpy

from starlette_context.plugins.base import PluginUUIDBase

# (force_new_uuid, version, validate, error_response): validation off, the rest as the defaults
PluginUUIDBase.__init__.__defaults__ = (False, 4, False, None)
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
