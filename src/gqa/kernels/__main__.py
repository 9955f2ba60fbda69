"""``python -m gqa.kernels [--verbose]``: build the native CPU kernels for this machine (``make`` runs it)."""

from __future__ import annotations

import argparse
import shutil

from . import build, build_dir, library_path, load_error


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gqa.kernels", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args()
    path = library_path()
    if path.exists():
        error = load_error(path)
        if error is None:
            print(f"gqa kernels: already built at {path}")
            return
        print(f"gqa kernels: {path} cannot be loaded ({error}); building it again")
        shutil.rmtree(build_dir())  # the folder is this source's build alone: its objects may be as broken
    print(f"gqa kernels: built {build(verbose=args.verbose)}")


if __name__ == "__main__":
    main()
