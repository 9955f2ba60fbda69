"""Native CPU kernels (``csrc/*.cpp``), compiled once on the machine that runs them.

The library is pure Python and works without them; where they are built, ``gqa.ops`` and the ``fused`` attention
backend use them. They are built with the machine's C++ compiler (``-O3 -march=native``, OpenMP threads through
ATen's ``parallel_for``) by ``python -m gqa.kernels`` — ``make`` does this while setting up — into a folder keyed by
a hash of the source, the flags, the torch version and the CPU, so a changed source or a different torch gets a fresh
build instead of a stale library.

Nothing compiles on import: :func:`load` only loads a library that is already built (set ``GQA_BUILD_KERNELS=1`` to
build on first use instead), and ``GQA_DISABLE_KERNELS=1`` turns them off. Nor is torch imported here: where the
library lives (:func:`library_path`) and whether it is built (:mod:`gqa.kernels.probe`) are known without it, which
``gqa info`` reports.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import warnings
from importlib.util import find_spec
from pathlib import Path

NAME = "gqa_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"
# attention, float GEMV, decode ops; quantized GEMV; the whole decode step in one call
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "quantized.cpp", CSRC / "decode_step.cpp", CSRC / "kv_cache.cpp")
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# -ffp-contract=off: no multiply-add fused behind our back, so that a loop gives the same bits whichever batch width
# (template instance) runs it — a row's result does not depend on its batch (tested)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)
# GQA_KERNELS_SANITIZE=1: an AddressSanitizer + UBSan build (its own folder; `make test-sanitized` loads it with the
# sanitizer runtimes preloaded)
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g")

_loaded: bool | None = None  # None: not tried yet
_simd = 0  # gqa::simd_width() of the loaded library, read once: vectorized() runs inside torch.compile'd code too
_lane_rows = 0  # gqa::lane_rows(), read once likewise


def _key() -> str:
    digest = hashlib.sha256()
    sources = [path.read_bytes() for path in SOURCES + HEADERS]
    cflags, ldflags = _flags()
    for part in (*sources, " ".join(cflags + ldflags).encode(), _torch_version().encode()):
        digest.update(part)
    digest.update((platform.machine() + platform.processor() + _cpu_flags()).encode())
    return digest.hexdigest()[:16]


def sanitized() -> bool:
    """Whether this process builds and loads the sanitizer build of the kernels: ``GQA_KERNELS_SANITIZE=1``."""
    return os.environ.get("GQA_KERNELS_SANITIZE") == "1"


def _flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compiler's and the linker's flags of this build."""
    if sanitized():
        return CFLAGS + SANITIZE_FLAGS, LDFLAGS + SANITIZE_FLAGS[:1]
    return CFLAGS, LDFLAGS


def _torch_version() -> str:
    """``torch.__version__`` without importing torch where it is not imported yet: read from ``torch/version.py``,
    which it comes from (``import torch`` where that file says nothing)."""
    if "torch" not in sys.modules:
        spec = find_spec("torch")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            try:
                text = (Path(folder) / "version.py").read_text(encoding="utf-8")
            except OSError:
                continue
            found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
            if found:
                return found.group(1)
    import torch

    return str(torch.__version__)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_dir() -> Path:
    """Where the library of this source/torch/CPU lives: ``$GQA_KERNELS_DIR`` or ``<sys.prefix>/share/gqa-kernels``."""
    base = os.environ.get("GQA_KERNELS_DIR")
    root = Path(base) if base else Path(sys.prefix) / "share" / "gqa-kernels"
    return root / _key()


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels (about a minute) and load them; returns the library's path."""
    from torch.utils.cpp_extension import load  # slow import, only when building

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = _flags()
    load(
        name=NAME,
        sources=[str(path) for path in SOURCES],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),
        build_directory=str(directory),
        is_python_module=False,
        verbose=verbose,
    )
    _loaded_now()
    return library_path()


def load() -> bool:
    """Load the built kernels if there are any (building them first with ``GQA_BUILD_KERNELS=1``); True if loaded.

    Not decorated for ``torch.compile`` (that would import dynamo with ``gqa``): ``gqa.decoding.compiled`` calls it
    before compiling, so traced code only reads the settled ``_loaded``, a constant of the graph."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if disabled():
        return False
    path = library_path()
    if path.exists():
        error = load_error(path)
        if error is not None:  # a truncated or corrupt file: the PyTorch paths run, and the build command rebuilds it
            warnings.warn(
                f"gqa: the native kernels at {path} cannot be loaded ({error}); running without them. "
                "Rebuild them with `python -m gqa.kernels`.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        _loaded_now()
    elif build_on_first_use():
        build()
    return _loaded


def load_error(path: Path) -> str | None:
    """Load the library at ``path`` into this process; ``None`` if it loaded, else why not."""
    import torch

    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        return str(e.__cause__ or e)
    return None


def build_on_first_use() -> bool:
    """Whether ``load`` builds the kernels where they are not built: ``GQA_BUILD_KERNELS=1``."""
    return os.environ.get("GQA_BUILD_KERNELS") == "1"


def disabled() -> bool:
    """Whether the kernels are off here: ``GQA_DISABLE_KERNELS=1``, or Windows."""
    return os.environ.get("GQA_DISABLE_KERNELS") == "1" or sys.platform == "win32"


def available() -> bool:
    """Whether the native kernels are loaded (loading them if they are built)."""
    return load()


def simd_width() -> int:
    """Float32 lanes of the loaded kernels' SIMD paths: 16 (AVX-512), 8 (AVX2 with FMA), 1 (plain loops: a CPU
    with neither), 0 (not loaded). The library says so itself (``gqa::simd_width``; it is built ``-march=native``)."""
    return _simd if available() else 0


def vectorized() -> bool:
    """Whether the kernels are loaded *and* have SIMD paths (AVX-512 or AVX2 + FMA; ``simd_width``). As plain scalar
    loops (other CPUs) they are slower than PyTorch's own ops for float32, so callers that pick a path for speed ask
    this; ``available`` only says the ops exist (docs/performance.md, "Native CPU kernels")."""
    return simd_width() > 1


def lane_rows() -> int:
    """The fewest input rows the quantized kernel runs in SIMD lanes (``ops.lane_rows``); 0: not loaded, or a build
    without those kernels (no AVX-512 VNNI)."""
    return _lane_rows if available() else 0


def _loaded_now() -> None:
    global _loaded, _simd, _lane_rows
    from . import ops

    ops.register_fakes()
    _simd = ops.simd_width()
    _lane_rows = ops.lane_rows()
    _loaded = True
