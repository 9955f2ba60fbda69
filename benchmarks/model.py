"""Whole-model benchmark: gqa vs HF transformers on SmolLM2 (see gqa.bench.model). Same as ``gqa bench model``."""

from gqa.bench.model.benchmark import main

raise SystemExit(main())
