"""``gqa bench model``: the whole model's KV-cache size, prefill and decode tokens/s against HF transformers and
llama.cpp, as MHA, GQA and MQA; throughput at batch; tensor-parallel sizes; on CUDA (``cuda``) gqa's graphs against HF
eager and static cache + compile. The flags (``arguments``, torch-free), the module that runs it (``benchmark``), one
engine per process (``worker``), the report."""

from .arguments import DESCRIPTION, HELP, RUN, add_arguments

__all__ = ["DESCRIPTION", "HELP", "RUN", "add_arguments"]
