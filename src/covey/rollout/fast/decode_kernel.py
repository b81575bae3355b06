"""covey's own decode kernel for CPUs (``decode_kernel.c``): float32, and bfloat16 where the CPU has AMX.

At a decode step's 1-32 rows, a matrix product is bound by streaming the weights from memory, and
general matrix libraries stream them well below the machine's bandwidth there; the rest of a step
(norms, rotary embedding, attention over a short cache, the MLP's activation) is hundreds of small
torch operations, each paying its dispatch. The kernel streams each weight row once, prefetching far
ahead, on the model's matrices as they are (no second copy), and runs a whole step of the layer
stack in one call: ``matrices`` for products alone, ``LayerStack`` for the whole step. In bfloat16
the matrices are laid out once in AMX tiles (``tile_bf16``), x is rounded to bfloat16 at each product,
and everything else (sums, norms, attention, the cache) stays float32.

It is compiled on first use with the system C compiler for this CPU (``-march=native``) into covey's
cache folder (``$XDG_CACHE_HOME/covey``, else ``~/.cache/covey``; where that cannot be written, a
folder of the user's own in the temporary directory), and runs on PyTorch's own OpenMP threads.
``available()`` is False (and the lean decoder uses oneDNN or ``F.linear``) where it cannot run: not
Linux on x86-64 with AVX-512, no C compiler, a failed build or self-check, or ``COVEY_DECODE_KERNEL=0``
in the environment; ``available(torch.bfloat16)`` besides needs AMX (and Linux's leave to use it).
Measured in BENCHMARKS.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from covey.errors import warn

SOURCE = Path(__file__).with_name("decode_kernel.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = ("-lm",)
# forwards of more rows than this (prefills) multiply through a general matrix library, as fast from
# about here on (products alone, measured in BENCHMARKS.md); a whole decode step runs in the kernel
# whatever its rows
MAX_ROWS = 32

_pointer = ctypes.c_void_p


def _cache_folders() -> list[tuple[Path, bool]]:
    """Where the built library is kept, in order of preference, each with whether the folder must be
    this user's alone: the user's cache folder, then (where that cannot be written, as with a read-only
    home) a folder in the temporary directory, where other users could have made it first."""
    return [(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "covey", False),
            (Path(tempfile.gettempdir()) / f"covey-{os.getuid()}", True)]


def _private(folder: Path) -> bool:
    """Whether only this user can write into folder (a library there is loaded as code)."""
    status = folder.stat()
    return status.st_uid == os.getuid() and not status.st_mode & 0o022


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


class _NoCompiler(Exception):
    pass


def _build() -> Path:
    """The compiled library for this source, compiler and CPU, built if not in the cache yet."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise _NoCompiler(compiler)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS + LIBRARIES), version, _cpu_flags()]).encode()).hexdigest()
    name = f"decode_kernel-{key[:16]}.so"
    folders = _cache_folders()
    for folder, must_be_private in folders:
        if (folder / name).exists() and (not must_be_private or _private(folder)):
            return folder / name
    refused = []
    for folder, must_be_private in folders:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if must_be_private and not _private(folder):
                raise PermissionError("others can write to it")
            # built under a name of its own, then renamed: processes building at once never load half a file
            handle, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError as error:
            refused.append(f"{folder}: {error.strerror or error}")
            continue
        os.close(handle)
        try:
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial, *LIBRARIES], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr.strip()[-2000:]}")
            os.replace(partial, folder / name)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return folder / name
    raise OSError(f"no folder to build it in ({'; '.join(refused)}): set XDG_CACHE_HOME to a folder this user can write")


def could_run_here() -> bool:
    """Whether this machine is one the kernel is for (Linux, x86-64, AVX-512) and it is not turned off;
    it still needs a C compiler and a build that passes its self-check (``available``)."""
    return (os.environ.get("COVEY_DECODE_KERNEL", "1") != "0" and platform.system() == "Linux"
            and platform.machine() == "x86_64" and torch.backends.cpu.get_cpu_capability() == "AVX512")


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not could_run_here():
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except _NoCompiler:  # the general products, without a word
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        warn(f"covey's decode kernel could not be built, so sampling uses the general matrix "
                      f"products (slower at few rows): {error}", RuntimeWarning, stacklevel=3)
        return None
    function = library.covey_decode_linear
    function.argtypes = [_pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int, _pointer, _pointer, _pointer,
                         _pointer, ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    step = library.covey_decode_step
    step.argtypes = [_pointer, *[ctypes.c_int] * 7, ctypes.c_float, ctypes.c_float, _pointer, _pointer, _pointer,
                     _pointer, _pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int, _pointer, ctypes.c_int, ctypes.c_int]
    step.restype = ctypes.c_int
    if not _agrees_with_linear(library, torch.float32):
        warn("covey's decode kernel gave other products than F.linear on this machine, so sampling "
                      "uses the general matrix products; please report it", RuntimeWarning, stacklevel=3)
        return None
    return library


@functools.cache
def _amx_library() -> ctypes.CDLL | None:
    """The library, where its bfloat16 products run: the CPU has AMX, Linux lets this process use it,
    and they agree with ``F.linear``."""
    library = _library()
    if library is None or not {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(_cpu_flags().split()) \
            or library.covey_amx_ready() != 0:
        return None
    library.covey_tile_bf16.argtypes = [_pointer, ctypes.c_int, ctypes.c_int, _pointer, ctypes.c_int]
    if not _agrees_with_linear(library, torch.bfloat16):
        warn("covey's decode kernel gave other bfloat16 products than F.linear on this machine, so "
                      "sampling in bfloat16 uses the general matrix products; please report it", RuntimeWarning,
                      stacklevel=3)
        return None
    return library


def _agrees_with_linear(library: ctypes.CDLL, dtype: torch.dtype) -> bool:
    """The kernel's products equal ``F.linear``'s on odd shapes (tails of rows and columns, biases); in
    bfloat16, those of x rounded to bfloat16, summed in float32."""
    generator = torch.Generator().manual_seed(0)
    parts = [(torch.randn(9, 37, generator=generator).to(dtype), torch.randn(9, generator=generator)),
             (torch.randn(6, 37, generator=generator).to(dtype), None)]
    x = torch.randn(7, 37, generator=generator)
    expected = torch.cat([F.linear(x.to(dtype).float(), w.float(), b) for w, b in parts], -1)
    if dtype == torch.bfloat16:
        parts = [(tile_bf16(w), b) for w, b in parts]
    return torch.allclose(_Matrices(library, parts)(x), expected, atol=1e-5)


@dataclass
class BF16Tiles:
    """A bfloat16 matrix of ``shape`` laid out for the kernel's AMX products (``tile_bf16``)."""

    tiles: torch.Tensor
    shape: tuple[int, int]

    def data_ptr(self) -> int:
        return self.tiles.data_ptr()


def tile_bf16(weight: torch.Tensor) -> BF16Tiles:
    """``weight`` (N, K) in bfloat16, in blocks of 16 rows x 32 columns, zero-padded to whole blocks, in the
    order the kernel multiplies them (a block row's blocks left to right): the kernel then streams one run of
    memory. Within a block, pair by pair of columns, each row's pair: the layout of an AMX tile product's
    second operand, so that the sums come out laid out as the outputs are. A float32 matrix is rounded
    (to nearest even) and laid out in one pass by the kernel where it runs in bfloat16."""
    N, K = weight.shape
    library = _amx_library() if weight.dtype == torch.float32 and weight.device.type == "cpu" else None
    if library is not None:
        source = weight.contiguous()
        tiles = torch.empty(-(-N // 16), -(-K // 32), 16, 16, 2, dtype=torch.bfloat16)
        library.covey_tile_bf16(source.data_ptr(), N, K, tiles.data_ptr(), torch.get_num_threads())
        return BF16Tiles(tiles, (N, K))
    padded = weight.to(torch.bfloat16)
    if K % 32 or N % 16:
        padded = F.pad(padded, (0, -K % 32, 0, -N % 16))
    # each pair of columns moved as one int32 (several times faster than moving bfloat16 two by two)
    pairs = padded.view(torch.int32).view(padded.shape[0] // 16, 16, padded.shape[1] // 32, 16)  # (row block, row, block, pair)
    blocks = pairs.permute(0, 2, 3, 1).contiguous().view(torch.bfloat16)
    return BF16Tiles(blocks.view(*blocks.shape[:-1], 16, 2), (N, K))


class _Matrices:
    """x times each (weight, bias) of ``parts``, outputs side by side, through the kernel."""

    def __init__(self, library: ctypes.CDLL, parts: list[tuple[torch.Tensor | BF16Tiles, torch.Tensor | None]]):
        self.function = library.covey_decode_linear
        self.bf16 = isinstance(parts[0][0], BF16Tiles)
        self.parts = parts  # contiguous; the kernel reads them through these pointers: they are held here
        n = len(self.parts)
        self.weights = (_pointer * n)(*[w.data_ptr() for w, _ in self.parts])
        self.biases = (_pointer * n)(*[b.data_ptr() if b is not None else None for _, b in self.parts])
        self.rows = (ctypes.c_int * n)(*[w.shape[0] for w, _ in self.parts])
        self.width = sum(w.shape[0] for w, _ in self.parts)
        self.inputs = self.parts[0][0].shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x = x.reshape(-1, self.inputs).float().contiguous()
        y = torch.empty(x.shape[0], self.width)
        if self.function(x.data_ptr(), x.shape[0], self.inputs, len(self.parts), self.weights, self.biases,
                         self.rows, y.data_ptr(), self.bf16, torch.get_num_threads()) != 0:
            raise MemoryError(f"the decode kernel could not allocate room for {x.shape[0]} rows")
        return y.view(*leading, self.width)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel multiplies matrices of ``dtype`` here (built on first asking)."""
    return (_library() if dtype == torch.float32 else _amx_library() if dtype == torch.bfloat16 else None) is not None


def describe() -> str:
    """Whether the kernel runs here, in a line for people (``covey env``): built on first asking, with the
    loader's own reason where it does not run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        float32, bfloat16 = available(torch.float32), available(torch.bfloat16)
    if float32:
        return (f"runs: float32{', and bfloat16 with AMX' if bfloat16 else ' (bfloat16 products need AMX, not usable here)'}"
                f"; built as {_build()}")
    if os.environ.get("COVEY_DECODE_KERNEL", "1") == "0":
        why = "turned off by COVEY_DECODE_KERNEL=0"
    elif caught:
        why = "; ".join(str(w.message) for w in caught)
    elif not could_run_here():
        why = "it runs on Linux on x86-64 CPUs with AVX-512 only"
    elif shutil.which(os.environ.get("CC") or "cc") is None:
        why = f"no C compiler ({os.environ.get('CC') or 'cc'}) found: install one (e.g. gcc) or set CC"
    else:
        why = "its build or self-check failed earlier in this process; a warning then said why"
    return f"does not run here ({why}); sampling multiplies with the general matrix products"


def _check_matrices(parts: list[tuple], where: str) -> bool:
    """Whether ``parts`` are bfloat16 tiles (else float32 matrices); a ValueError unless they are all one or
    the other, contiguous on the CPU, with float32 biases."""
    bf16 = all(isinstance(w, BF16Tiles) for w, _ in parts)
    float32 = all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.is_contiguous() for w, _ in parts)
    biases = all(b is None or (b.dtype == torch.float32 and b.is_contiguous()) for _, b in parts)
    on_cpu = (bf16 or float32) and all((w.tiles if bf16 else w).device.type == "cpu" for w, _ in parts)
    if not (on_cpu and biases):
        raise ValueError(f"{where} multiplies contiguous float32 matrices or bfloat16 ones laid out by tile_bf16, "
                         "all one or the other, with float32 biases, on the CPU")
    if bf16 and not available(torch.bfloat16):
        raise ValueError(f"{where} cannot multiply bfloat16 matrices here (it needs AMX)")
    return bf16


def matrices(parts: list[tuple[torch.Tensor | BF16Tiles, torch.Tensor | None]]):
    """A function x -> x times each (weight, bias) of ``parts`` (float32 matrices, or bfloat16 ones from
    ``tile_bf16``, on the CPU), outputs side by side. In float32 for at most ``MAX_ROWS`` rows of x, in
    bfloat16 for any. Only where ``available`` for their dtype."""
    parts = [(w.contiguous() if isinstance(w, torch.Tensor) else w, b) for w, b in parts]
    _check_matrices(parts, "the decode kernel")
    return _Matrices(_library(), parts)


class LayerStack:
    """The layers of a Llama-family model for a whole decode step in one call (``step``): norms,
    products, rotary embedding, cache writes, attention and the MLP, one token per row, in float32 on
    the model's own matrices, or with bfloat16 ones laid out by ``tile_bf16``. Only where ``available``
    for their dtype.

    ``layers``: each layer's (weight, bias) of its products by name (``decoder.layer_parts``; biases
    may be None); ``norms`` the (attention, MLP) norm weights of each layer (float32)."""

    # the C step takes a layer's products in this order, each its weights then its biases
    PRODUCTS = ("qkv", "o", "gate_up", "down")

    def __init__(self, layers: list[dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]]],
                 norms: list[tuple[torch.Tensor, torch.Tensor]], n_heads: int, n_kv_heads: int, head_dim: int,
                 eps: float, scale: float):
        library = _library()
        self.function = library.covey_decode_step
        self.per_layer = library.covey_layer_pointers()
        self.shape = (n_heads, n_kv_heads, head_dim)
        self.eps, self.scale = eps, scale
        self.bf16 = _check_matrices([part for products in layers for name in self.PRODUCTS for part in products[name]],
                                    "the decode step")
        if any(n.dtype != torch.float32 or not n.is_contiguous() for pair in norms for n in pair):
            raise ValueError("the decode step takes contiguous float32 norm weights")
        self.tensors = []  # the kernel reads them through the pointers: held here
        pointers = []
        for products, (attn_norm, mlp_norm) in zip(layers, norms):
            layer = []
            for name in self.PRODUCTS:
                weights, biases = zip(*products[name])
                layer += [*weights, *biases]
            layer += [attn_norm, mlp_norm]
            self.tensors += layer
            pointers += [t.data_ptr() if t is not None else None for t in layer] + [None, None]  # the cache's, per step
        self.intermediate = layers[0]["gate_up"][0][0].shape[0]
        self.pointers = (_pointer * len(pointers))(*pointers)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: torch.Tensor, slots: torch.Tensor,
             position: int, keys: list[torch.Tensor], values: list[torch.Tensor], prefix_slots: torch.Tensor | None = None,
             prefix_length: int = 0) -> None:
        """Run every layer on x (B, hidden), in place. Row b's cache is row ``slots[b]`` (int32) of
        ``keys``/``values`` (each (n, kv heads, max length, head dim)): its key and value go to position
        ``position`` there, and it attends to the positions up to that one where ``attend`` (B, max
        length, bool) is True; the first ``prefix_length`` of them (its prompt's, shared by its group) it
        reads from row ``prefix_slots[b]`` (int32) instead. cos/sin (B, head dim): the rotary embedding of
        each row's position."""
        n_slots = len(keys[0])
        for name, rows in (("slots", slots), ("prefix_slots", prefix_slots if prefix_length else slots)):
            if rows.dtype != torch.int32 or len(rows) != len(x) or not 0 <= int(rows.min()) <= int(rows.max()) < n_slots:
                raise ValueError(f"{name} must be {len(x)} int32 rows of a cache of {n_slots}")
        if not 0 <= prefix_length <= position:
            raise ValueError(f"the shared prefix ({prefix_length} positions) must end at or before position {position}")
        n_heads, n_kv_heads, head_dim = self.shape
        for t in (keys[0], values[0]):  # all made alike by the lean decoder
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1:] != (n_kv_heads, attend.shape[1], head_dim):
                raise ValueError(f"the cache must be contiguous float32 tensors of (rows, {n_kv_heads}, "
                                 f"{attend.shape[1]}, {head_dim}), not {t.dtype} {tuple(t.shape)}")
        for i, (k, v) in enumerate(zip(keys, values)):
            self.pointers[(i + 1) * self.per_layer - 2] = k.data_ptr()
            self.pointers[(i + 1) * self.per_layer - 1] = v.data_ptr()
        B, H = x.shape
        if self.function(x.data_ptr(), B, H, n_heads, n_kv_heads, head_dim, self.intermediate, len(keys), self.eps,
                         self.scale, cos.data_ptr(), sin.data_ptr(), attend.data_ptr(), slots.data_ptr(),
                         prefix_slots.data_ptr() if prefix_length else None, prefix_length, position,
                         attend.shape[1], self.pointers, self.bf16, torch.get_num_threads()) != 0:
            raise MemoryError(f"the decode kernel could not allocate its scratch memory for {B} rows")
