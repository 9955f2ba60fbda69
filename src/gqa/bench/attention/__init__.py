"""``gqa bench attention``: every attention implementation side by side against the machine's measured limits, or
forward + backward of prefill (``--backward``). The flags (``arguments``, torch-free) and the module that runs the
benchmark (``benchmark``); cases, implementations, timing, limits, the report and the plots beside them."""

from .arguments import DESCRIPTION, HELP, RUN, add_arguments, build_parser

__all__ = ["DESCRIPTION", "HELP", "RUN", "add_arguments", "build_parser"]
