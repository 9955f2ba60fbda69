"""gqa inside other libraries: ``hf`` — ``attn_implementation="gqa"`` for HF transformers."""
