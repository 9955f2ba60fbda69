"""GPU kernels in Triton: the split-KV grouped decode kernel (``split_kv``, its Triton code in
``split_kv_kernels``). Importing this package does not import triton."""
