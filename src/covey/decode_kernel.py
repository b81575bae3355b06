"""covey's own decode kernel for CPUs (``decode_kernel.c``), float32.

At a decode step's 1-32 rows, a matrix product is bound by streaming the weights from memory, and
general matrix libraries stream them well below the machine's bandwidth there; the rest of a step
(norms, rotary embedding, attention over a short cache, the MLP's activation) is hundreds of small
torch operations, each paying its dispatch. The kernel streams each weight row once, prefetching far
ahead, on the model's matrices as they are (no second copy), and runs a whole step of the layer
stack in one call: ``matrices`` for products alone, ``LayerStack`` for the whole step.

It is compiled on first use with the system C compiler for this CPU (``-march=native``) into covey's
cache folder (``$XDG_CACHE_HOME/covey``, else ``~/.cache/covey``), and runs on PyTorch's own OpenMP
threads. ``available()`` is False (and the lean decoder uses oneDNN or ``F.linear``) where it cannot
run: not Linux on x86-64 with AVX-512, no C compiler, a failed build or self-check, or
``COVEY_DECODE_KERNEL=0`` in the environment. Measured in BENCHMARKS.md.
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
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("decode_kernel.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = ("-lm",)
# forwards of more rows than this (prefills) multiply through a general matrix library, as fast from
# about here on (products alone, measured in BENCHMARKS.md); a whole decode step runs in the kernel
# whatever its rows
MAX_ROWS = 32

_pointer = ctypes.c_void_p


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "covey"


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
    library = _cache_folder() / f"decode_kernel-{key[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # built under a name of its own, then renamed: processes building at once never load half a file
        handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(handle)
        try:
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial, *LIBRARIES], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr.strip()[-2000:]}")
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("COVEY_DECODE_KERNEL", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64" \
            or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except _NoCompiler:  # the general products, without a word
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        warnings.warn(f"covey's decode kernel could not be built, so sampling uses the general matrix "
                      f"products (slower at few rows): {error}", RuntimeWarning, stacklevel=3)
        return None
    function = library.covey_decode_linear
    function.argtypes = [_pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int, _pointer, _pointer, _pointer,
                         _pointer, ctypes.c_int]
    function.restype = None
    step = library.covey_decode_step
    step.argtypes = [_pointer, *[ctypes.c_int] * 7, ctypes.c_float, ctypes.c_float, _pointer, _pointer, _pointer,
                     _pointer, ctypes.c_int, ctypes.c_int, _pointer, ctypes.c_int]
    step.restype = ctypes.c_int
    if not _agrees_with_linear(library):
        warnings.warn("covey's decode kernel gave other products than F.linear on this machine, so sampling "
                      "uses the general matrix products; please report it", RuntimeWarning, stacklevel=3)
        return None
    return library


def _agrees_with_linear(library: ctypes.CDLL) -> bool:
    """The kernel's products equal ``F.linear``'s on odd shapes (tails of rows and columns, biases)."""
    generator = torch.Generator().manual_seed(0)
    parts = [(torch.randn(9, 37, generator=generator), torch.randn(9, generator=generator)),
             (torch.randn(6, 37, generator=generator), None)]
    x = torch.randn(7, 37, generator=generator)
    expected = torch.cat([F.linear(x, w, b) for w, b in parts], -1)
    return torch.allclose(_Matrices(library, parts)(x), expected, atol=1e-5)


class _Matrices:
    """x times each (weight, bias) of ``parts``, outputs side by side, through the kernel."""

    def __init__(self, library: ctypes.CDLL, parts: list[tuple[torch.Tensor, torch.Tensor | None]]):
        self.function = library.covey_decode_linear
        # the kernel reads the tensors through these pointers: they are held here
        self.parts = [(w.contiguous(), b.contiguous() if b is not None else None) for w, b in parts]
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
        self.function(x.data_ptr(), x.shape[0], self.inputs, len(self.parts), self.weights, self.biases, self.rows,
                      y.data_ptr(), torch.get_num_threads())
        return y.view(*leading, self.width)


def available() -> bool:
    """Whether the kernel runs here (built on first asking)."""
    return _library() is not None


def matrices(parts: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """A function x -> x times each (weight, bias) of ``parts`` (float32, on the CPU), outputs side by
    side, for at most ``MAX_ROWS`` rows of x. Only where ``available()``."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for part in parts for t in part if t is not None):
        raise ValueError("the decode kernel multiplies float32 matrices on the CPU")
    return _Matrices(_library(), parts)


class LayerStack:
    """The layers of a Llama-family model for a whole decode step in one call (``step``): norms,
    products, rotary embedding, cache writes, attention and the MLP, one token per row, in float32 on
    the model's own matrices. Only where ``available()``.

    ``layers``: each layer's (weight, bias) of its products by name (``decoder.layer_parts``; biases
    may be None); ``norms`` the (attention, MLP) norm weights of each layer."""

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
        self.tensors = []  # the kernel reads them through the pointers: held here
        pointers = []
        for products, (attn_norm, mlp_norm) in zip(layers, norms):
            layer = []
            for name in self.PRODUCTS:
                weights, biases = zip(*products[name])
                layer += [*weights, *biases]
            layer += [attn_norm, mlp_norm]
            if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in layer):
                raise ValueError("the decode step multiplies contiguous float32 matrices")
            self.tensors += layer
            pointers += [t.data_ptr() if t is not None else None for t in layer] + [None, None]  # the cache's, per step
        self.intermediate = layers[0]["gate_up"][0][0].shape[0]
        self.pointers = (_pointer * len(pointers))(*pointers)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: torch.Tensor, slots: torch.Tensor,
             position: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Run every layer on x (B, hidden), in place. Row b's cache is row ``slots[b]`` (int32) of
        ``keys``/``values`` (each (n, kv heads, max length, head dim)): its key and value go to position
        ``position`` there, and it attends to the positions up to that one where ``attend`` (B, max
        length, bool) is True. cos/sin (B, head dim): the rotary embedding of each row's position."""
        n_slots = len(keys[0])
        if slots.dtype != torch.int32 or len(slots) != len(x) or not 0 <= int(slots.min()) <= int(slots.max()) < n_slots:
            raise ValueError(f"slots must be {len(x)} int32 rows of a cache of {n_slots}")
        n_heads, n_kv_heads, head_dim = self.shape
        for i, (k, v) in enumerate(zip(keys, values)):
            self.pointers[(i + 1) * self.per_layer - 2] = k.data_ptr()
            self.pointers[(i + 1) * self.per_layer - 1] = v.data_ptr()
        B, H = x.shape
        if self.function(x.data_ptr(), B, H, n_heads, n_kv_heads, head_dim, self.intermediate, len(keys), self.eps,
                         self.scale, cos.data_ptr(), sin.data_ptr(), attend.data_ptr(), slots.data_ptr(), position,
                         attend.shape[1], self.pointers, torch.get_num_threads()) != 0:
            raise MemoryError(f"the decode kernel could not allocate its scratch memory for {B} rows")
