"""Decoding: how a model turns prompts into tokens.

* ``generate`` — the generate loop (prefill, then a token per step through static caches) and sampling;
* ``native_step`` — the default CPU decode step: the whole model in one native call (``kernels.ops.decode_model``);
* ``compiled`` — the ``torch.compile``d step; ``cuda_graphs`` — the CUDA-graph step on a GPU.
"""
