"""Attention benchmark: every gqa backend, ``auto`` and torch SDPA side by side. See ``--help``."""

from gqa.bench.attention.benchmark import main

raise SystemExit(main())
