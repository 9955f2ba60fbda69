"""Across processes, on torch.distributed: ``distributed`` — process groups and local launches; ``tensor_parallel``
— a model sharded by KV groups."""
