"""Block-quantized weights (GGUF ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1`` and the K formats ``Q4_K``,
``Q5_K``, ``Q6_K``) kept as they are in memory.

Decoding streams every weight once per token, so the bytes per weight set the speed: 8.5 bits (q8_0), 4.5 (q4_0),
5 (q4_1), 5.5 (q5_0) or 6 (q5_1) instead of 16 (bf16) or 32. (Q5_0 is what llama.cpp's Q4_K_M quantizer writes for
rows that are not a multiple of 256 values, e.g. every matrix of SmolLM2-135M.) A weight ``(M, K)`` is ``M`` rows of
``K / 32`` blocks of 32 values (one ``float16`` scale ``d``, for q4_1 and q5_1 also a minimum ``m``):

* ``q8_0`` — 34 bytes: ``d``, 32 ``int8`` ``q``;                ``w = d * q``
* ``q4_0`` — 18 bytes: ``d``, 16 bytes of 4-bit ``q``;           ``w = d * (q - 8)``
* ``q4_1`` — 20 bytes: ``d``, ``m``, 16 bytes of 4-bit ``q``;    ``w = d * q + m``
* ``q5_0`` — 22 bytes: ``d``, 4 bytes of fifth bits, 16 bytes of low nibbles;   ``w = d * (q - 16)``
* ``q5_1`` — 24 bytes: ``d``, ``m``, 4 bytes of fifth bits, 16 bytes of low nibbles;   ``w = d * q + m``

llama.cpp's K formats (what ``Q4_K_M``/``Q5_K_M``/``Q6_K`` files hold) group 256 values in a super-block of eight
32-value sub-blocks, each with its own 6-bit scale and minimum (or, q6_k, an int8 scale per 16 values), so a row's
``K`` must be a multiple of 256 (``kernels/csrc/k_quants.h`` has the byte layouts):

* ``q4_k`` — 144 bytes per 256 values (4.5 bits): ``w = d * sc_j * q - dmin * m_j``, ``q`` in 0..15
* ``q5_k`` — 176 bytes (5.5 bits): the same with a fifth bit, ``q`` in 0..31
* ``q6_k`` — 210 bytes (6.5625 bits): ``w = d * sc_k * (q - 32)``, ``q`` in 0..63

``QuantizedLinear`` multiplies a few rows (decode) with the native kernel ``gqa::qlinear_rows_n``, which quantizes
each 32-value block of the input to ``int8`` and takes integer dot products with the blocks (llama.cpp's scheme), and
larger inputs (prefill) through the dequantized weight and ``F.linear`` — except where the kernel puts the rows in
SIMD lanes (AVX-512 VNNI): there float32 prompts of any length and bfloat16 ones up to 64 rows take the kernel too.
``QuantizedEmbedding`` dequantizes the rows it looks up. ``quantize`` makes blocks from float weights
(``gguf.quants``, bit-exact with llama.cpp's reference; the K formats only come from files: gguf has no quantizer for
them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..hardware import amx_tiles
from ..kernels import ops

BLOCK = 32


@dataclass(frozen=True)
class Format:
    """One block format: its name, the kernels' code for it, the bytes of one block and the weights it holds (32, or
    a super-block of 256 for the K formats)."""

    name: str
    code: int
    block_bytes: int
    block_values: int = BLOCK

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_values


# name: (code, block bytes, values per block)
_CODES = {
    "q8_0": (0, 34, 32),
    "q4_0": (1, 18, 32),
    "q4_1": (2, 20, 32),
    "q5_0": (3, 22, 32),
    "q5_1": (4, 24, 32),
    "q4_k": (5, 144, 256),
    "q5_k": (6, 176, 256),
    "q6_k": (7, 210, 256),
}
FORMATS: dict[str, Format] = {name: Format(name, *spec) for name, spec in _CODES.items()}
QUANTIZABLE = tuple(name for name, f in FORMATS.items() if f.block_values == BLOCK)  # what ``quantize`` makes


def get_format(name: str) -> Format:
    """The ``Format`` called ``name`` (``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q4_k"``,
    ``"q5_k"``, ``"q6_k"``, any case); ``ValueError`` otherwise."""
    fmt = FORMATS.get(str(name).lower())
    if fmt is None:
        raise ValueError(f"unknown quantization format {name!r}; choose from {', '.join(FORMATS)}")
    return fmt


def _gguf_type(fmt: Format):  # gguf.GGMLQuantizationType, imported lazily
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[fmt.name.upper()]


@dataclass
class QuantizedTensor:
    """A ``(M, K)`` weight as blocks: ``blocks (M, K / block_values * block_bytes)`` ``uint8`` in ``format``."""

    blocks: torch.Tensor
    format: Format
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        M, K = self.shape
        values = self.format.block_values
        if K % values:
            raise ValueError(f"a {self.format.name} weight needs K divisible by {values}, got shape {self.shape}")
        want = (M, K // values * self.format.block_bytes)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(
                f"{self.format.name} blocks of a {self.shape} weight must be uint8 {want}, got "
                f"{self.blocks.dtype} {tuple(self.blocks.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``(M, K)`` (exactly ``d * q (+ m)``, rounded to ``dtype``)."""
        return dequantize(self.blocks, self.format, self.shape[1], dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, start + length)`` as a ``QuantizedTensor`` of their own
        blocks, copied (a tensor-parallel rank's shard: the rest of the file's pages are never kept). Columns must
        begin and end on a block boundary (``block_values`` apart); ``ValueError`` otherwise."""
        M, K = self.shape
        if dim not in (0, 1):
            raise ValueError(f"dim must be 0 (rows) or 1 (columns), got {dim}")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"[{start}, {start + length}) is outside the {self.shape[dim]} of dim {dim}")
        if dim == 0:
            return QuantizedTensor(self.blocks.narrow(0, start, length).clone(), self.format, (length, K))
        values, size = self.format.block_values, self.format.block_bytes
        if start % values or length % values:
            raise ValueError(
                f"columns [{start}, {start + length}) of a {self.format.name} weight do not fall on its blocks of "
                f"{values} values"
            )
        blocks = self.blocks.narrow(1, start // values * size, length // values * size).contiguous()
        return QuantizedTensor(blocks, self.format, (M, length))


def dequantize(blocks: torch.Tensor, fmt: Format, K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of blocks ``(M, K / block_values * block_bytes)`` -> float ``(M, K)`` of ``dtype``."""
    if kernels.available() and blocks.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16):
        return ops.dequantize_rows(blocks.contiguous(), fmt.code, K, dtype)
    from gguf.quants import dequantize as gguf_dequantize

    rows = gguf_dequantize(blocks.cpu().numpy(), _gguf_type(fmt)).reshape(blocks.shape[0], K)
    return torch.from_numpy(np.ascontiguousarray(rows)).to(device=blocks.device, dtype=dtype)


def quantize(weight: torch.Tensor, fmt: Format | str) -> QuantizedTensor:
    """Blocks of a float ``weight (M, K)`` (``K % 32 == 0``) in ``fmt``, as llama.cpp's reference quantizer makes
    them."""
    from gguf.quants import quantize as gguf_quantize

    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.block_values != BLOCK:
        raise ValueError(f"{fmt.name} blocks come from GGUF files only (gguf has no quantizer for them)")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"quantize needs a 2-D weight with K divisible by {BLOCK}, got {tuple(weight.shape)}")
    data = weight.detach().float().cpu().numpy()
    blocks = torch.from_numpy(np.ascontiguousarray(gguf_quantize(data, _gguf_type(fmt))))
    return QuantizedTensor(blocks.reshape(weight.shape[0], -1), fmt, (int(weight.shape[0]), int(weight.shape[1])))


# Up to this many rows of x the kernel streams the blocks once for all of them; more rows go through F.linear, except
# where the kernel puts the rows in SIMD lanes (``kernels.lane_rows``: AVX-512 VNNI) — there it takes any number of
# float32 rows (2-4x faster than F.linear even on a kept float32 copy of the weight) and of bfloat16 ones, but on a CPU
# with AMX tiles only up to LANE_MAX_BF16_ROWS: beyond, oneDNN's bf16 GEMM on the dequantized weight catches up there
# (docs/performance.md). Without AMX (AVX512-BF16 alone: AMD Zen 4) that GEMM is the slow one: dequantize + F.linear
# took a 3B Q4_K_M model's 128-token prefill at 1/6 the lanes' speed (docs/bench/models-3b-8b.md).
KERNEL_MAX_ROWS = 8
LANE_MAX_BF16_ROWS = 64
# F.linear on more rows takes the weight dequantized about this many values at a time (a 1B model's 2048 x 8192
# down projection: 2 MiB of bfloat16 at once, not 32; measured as fast on a 512-token prompt)
DEQUANTIZED_VALUES = 2**20


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether ``QuantizedLinear`` runs the native kernel for input ``x``."""
    if not (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.numel() > 0
        and not (torch.is_grad_enabled() and x.requires_grad)
        and kernels.vectorized()
    ):
        return False
    rows = x.numel() // x.shape[-1]
    if rows <= KERNEL_MAX_ROWS:
        return True
    return kernels.lane_rows() > 0 and (x.dtype == torch.float32 or rows <= LANE_MAX_BF16_ROWS or not amx_tiles())


class QuantizedLinear(nn.Module):
    """``nn.Linear`` (no training) whose weight is held as blocks: ``x (*, in) -> (*, out)`` in ``x``'s dtype.

    Buffers: ``blocks`` (``uint8``), ``bias`` (optional, float). ``format`` names the block format.
    """

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight_nbytes(self) -> int:
        return self.blocks.nbytes

    def quantized(self) -> QuantizedTensor:
        return QuantizedTensor(self.blocks, self.format, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input of shape {tuple(x.shape)} does not end in in_features={self.in_features}")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if uses_kernel(x):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            out = ops.qlinear_rows_n(rows, [self.blocks], [self.format.code], [bias])[0]
            return out.view(*x.shape[:-1], self.out_features)
        kept = getattr(self, "_dequantized", None)
        if kept is not None and kept.dtype == x.dtype:
            return F.linear(x, kept, bias)
        step = max(1, DEQUANTIZED_VALUES // self.in_features)  # output rows per slice
        if self.out_features <= step:
            return F.linear(x, dequantize(self.blocks, self.format, self.in_features, x.dtype), bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for m0 in range(0, self.out_features, step):  # a slice of the weight in float at a time
            m1 = min(m0 + step, self.out_features)
            part = dequantize(self.blocks[m0:m1], self.format, self.in_features, x.dtype)
            out[..., m0:m1] = F.linear(x, part, None if bias is None else bias[m0:m1])
        return out

    def keep_dequantized(self, dtype: torch.dtype | None) -> None:
        """Keep the weight dequantized in ``dtype`` (``None``: drop it) for inputs of more rows than the kernel
        takes (a prompt): ``F.linear`` on the copy instead of dequantizing every block at every call. Memory for
        speed: a server prefilling prompt after prompt wants it. Not part of the ``state_dict``."""
        self._dequantized = None if dtype is None else dequantize(self.blocks, self.format, self.in_features, dtype)


def quantized_linears(x: torch.Tensor, layers: list[QuantizedLinear]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` in one kernel call (one pass of the threads over all the blocks)."""
    if not uses_kernel(x):
        return [layer(x) for layer in layers]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    biases = [None if m.bias is None else m.bias.to(x.dtype) for m in layers]
    outs = ops.qlinear_rows_n(rows, [m.blocks for m in layers], [m.format.code for m in layers], biases)
    return [out.view(*x.shape[:-1], out.shape[-1]) for out in outs]


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` whose table is held as blocks; looked-up rows come out dequantized in ``dtype``.

    ``dtype`` is that of an empty float buffer (not saved in ``state_dict``), so ``model.to(dtype)``, ``.float()`` or
    ``.bfloat16()`` change it with the rest of the model's activations; the ``uint8`` blocks are never cast.
    """

    def __init__(self, weight: QuantizedTensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise TypeError(f"QuantizedEmbedding gives rows in a float dtype, got {dtype}")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.format = weight.format
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("_rows_dtype", torch.empty(0, dtype=dtype, device=weight.blocks.device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows it gives (follows ``Module.to``)."""
        return self._rows_dtype.dtype

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.name}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        return dequantize(rows, self.format, self.embedding_dim, self.dtype).view(*ids.shape, self.embedding_dim)


def install_quantized(model: nn.Module, weights: dict[str, QuantizedTensor], dtype: torch.dtype) -> None:
    """Replace each ``nn.Linear`` / ``nn.Embedding`` of ``model`` whose ``<name>.weight`` is in ``weights`` by
    ``QuantizedLinear`` / ``QuantizedEmbedding`` holding those blocks (the Linear's bias is kept); embeddings give
    rows in ``dtype``."""
    for key, weight in weights.items():
        parent_name, _, child = key.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantizedEmbedding(weight, dtype)
        elif isinstance(old, nn.Linear):
            new = QuantizedLinear(weight, old.bias)
        else:
            raise TypeError(f"{key}: cannot hold a quantized weight in a {type(old).__name__}")
        if (old.weight.shape[0], old.weight.shape[1]) != weight.shape:
            raise ValueError(
                f"{key}: quantized weight of shape {weight.shape}, the model has {tuple(old.weight.shape)}"
            )
        setattr(parent, child, new)


def quantize_model(model: nn.Module, fmt: Format | str, *, head_format: Format | str = "q8_0") -> None:
    """Quantize ``model``'s decoder ``nn.Linear`` weights (``model.layers.*``) to ``fmt`` and its embeddings and
    ``lm_head`` to ``head_format`` (q8_0: as llama.cpp, the output matrix keeps more bits than the layers), in
    place; a weight whose ``K`` is not a multiple of 32 stays float."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    head = get_format(head_format) if isinstance(head_format, str) else head_format
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    weights: dict[str, QuantizedTensor] = {}
    done: dict[int, QuantizedTensor] = {}  # tied weights are quantized once and shared
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or module.weight.shape[1] % BLOCK:
            continue
        if id(module.weight) not in done:
            done[id(module.weight)] = quantize(module.weight, fmt if name.startswith("model.layers.") else head)
        weights[f"{name}.weight"] = done[id(module.weight)]
    install_quantized(model, weights, dtype)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of ``model``'s weights by storage format: quantized blocks by format name, float parameters by
    dtype name (``"bfloat16"``); a tensor shared by two modules (tied embeddings) is counted once."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            tensors = [(module.format.name, module.blocks)]
        else:
            tensors = [(str(p.dtype).removeprefix("torch."), p) for p in module.parameters(recurse=False)]
        for name, t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                sizes[name] = sizes.get(name, 0) + t.nbytes
    return sizes
