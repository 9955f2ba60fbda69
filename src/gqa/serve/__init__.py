"""Serving: a paged KV cache (``blocks``: block tables, reference counts, prefix caching) for many sequences at once."""

from .blocks import BlockManager, BlockTable, OutOfBlocks

__all__ = ["BlockManager", "BlockTable", "OutOfBlocks"]
