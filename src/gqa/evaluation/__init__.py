"""Judging a model: ``perplexity`` (sliding-window perplexity and KL to a reference), ``answers`` (a chat model's
answers to a question set), ``suite`` (a converted chat model against its original: answers, KL, three prose
genres)."""
