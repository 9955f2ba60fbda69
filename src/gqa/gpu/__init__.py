"""GPU paths: the Triton split-KV decode kernel (``split_kv``), the CUDA routing of ``auto`` (``routing``) and CUDA
graph decoding of a whole model (``graphs``). Importing this package does not import triton."""
