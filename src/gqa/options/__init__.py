"""The command line's vocabulary, without torch: ``defaults`` (choices and defaults shown in ``--help``, imported by
the modules that use them), ``common`` (the help formatter, model naming, the loading line, the model and ``--tp``
flags) and ``dtypes`` (the ``--dtype`` flag). ``gqa.cli`` and the benchmarks' own parsers build from these."""
