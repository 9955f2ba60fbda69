"""``python -m gqa.kernels [--verbose]``: build the native CPU kernels for this machine (``make`` runs it)."""

from __future__ import annotations

import argparse

from . import build, library_path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gqa.kernels", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args()
    if library_path().exists():
        print(f"gqa kernels: already built at {library_path()}")
        return
    print(f"gqa kernels: built {build(verbose=args.verbose)}")


if __name__ == "__main__":
    main()
