"""Where models live: the device covey loads them on, bfloat16 autocast there (with its products in
float32 on a CPU that has no bfloat16 ones), and how the C library handles the CPU memory of freed tensors."""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

def default_device(use_cpu: bool = False) -> torch.device:
    """Where covey puts the models it loads: the current CUDA device when there is one (and ``use_cpu``
    is not asked), else the CPU (a model object handed to the trainer stays where it is)."""
    return torch.device("cuda") if torch.cuda.is_available() and not use_cpu else torch.device("cpu")


def keep_freed_memory() -> bool:
    """Have the C library keep the memory of freed tensors for the next ones, rather than hand every
    large block back to the system at free and take it again (zeroed page by page) at the next
    allocation, as glibc does by default for blocks over 32 MB or so: on CPU each training step
    allocates and frees its activations, gradients and vocabulary-wide logits. Measured on the
    default step: half the page faults, a third less system time (docs/benchmark-history.md), a step
    about 5% faster (BENCHMARKS.md). But where a later phase cannot reuse the blocks an earlier one
    freed, they stay held: examples/gsm8k.yaml's step peaked 7% higher (docs/plan.md), beyond what
    covey plan estimates, so it is off unless asked for (``keep_freed_memory: true``).
    Process-wide; the process's memory then stays near its peak instead of shrinking between passes.
    True where applied (Linux with glibc), False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>; musl's mallopt accepts nothing and returns 0
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))



@contextlib.contextmanager
def autocast(device: torch.device, enabled: bool):
    """bfloat16 autocast on ``device`` when enabled (the `bf16` setting), a no-op otherwise; where torch
    multiplies bfloat16 in software there, its products are computed in float32 (``float32_products``)."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled), float32_products(device, enabled):
        yield


def bfloat16_products_in_software(device: torch.device) -> bool:
    """Whether torch multiplies bfloat16 matrices in software on ``device``: a CPU for which its oneDNN has
    no bfloat16 products (one without AVX-512 or AMX, or an Arm without BF16), where its own loops run
    them about 80 times slower than float32. False where this torch build cannot say (no oneDNN)."""
    if device.type != "cpu":
        return False
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def float32_products(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """Where bfloat16 is ``enabled`` and ``device`` multiplies it in software, a context in which every
    bfloat16 product is computed in float32 (``Float32Products``); else a no-op."""
    return Float32Products() if enabled and bfloat16_products_in_software(device) else contextlib.nullcontext()


aten = torch.ops.aten
# the operations that multiply matrices, as autograd calls them in a forward, a backward and a recomputed forward
PRODUCTS = frozenset((aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.mv.default,
                      aten.convolution.default, aten.convolution_backward.default))


class Float32Products(TorchDispatchMode):
    """Each matrix product (and convolution) of bfloat16 CPU tensors computed in float32 from the same
    bfloat16 operands, its result rounded to bfloat16: the numbers of a bfloat16 product summed in
    float32, as bfloat16 instructions give them, at nearly float32's speed on a CPU without them (the
    operands are exact in float32; only the order of the sums may differ). Below autograd, so the graph,
    the tensors it saves and the gradients' dtypes are those of bfloat16; only how a product is
    computed changes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and any(_bfloat16_on_cpu(a) for a in args):
            return in_float32(func, args, kwargs)
        return func(*args, **kwargs)


def _bfloat16_on_cpu(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.device.type == "cpu"


def in_float32(func, args: tuple, kwargs: dict):
    """``func`` of bfloat16 tensors computed on their float32 copies, its tensors rounded to bfloat16."""
    if func is aten.mm.default:
        return matrix_product(*args)
    if func is aten.addmm.default:
        return matrix_product(args[1], args[2], args[0], **kwargs)

    def widen(value):
        return value.float() if _bfloat16_on_cpu(value) else value

    def narrow(value):
        return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) else value
    return tree_map(narrow, func(*tree_map(widen, args), **tree_map(widen, kwargs)))


# Values of a product's float32 copies made at once; past it the product is computed a block at a time, so
# that widening a large matrix (a 152k-vocabulary head, its logits) costs a block of memory, not a float32
# copy of it and of its result
BLOCK_VALUES = 2**22


def matrix_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, beta: float = 1,
                   alpha: float = 1) -> torch.Tensor:
    """``alpha * a @ b + beta * bias`` (``addmm``; ``a @ b`` without bias) of bfloat16 matrices, in float32
    and rounded to bfloat16; past ``BLOCK_VALUES`` a block at a time along the largest of its three
    dimensions (along the summed one, the blocks' products summed in float32)."""
    (N, K), M = a.shape, b.shape[1]
    added = None if bias is None or beta == 0 else bias.float().expand(N, M)

    def rounded(product: torch.Tensor, rows: slice = slice(None), columns: slice = slice(None)) -> torch.Tensor:
        if alpha != 1:
            product = product.mul_(alpha)
        if added is not None:
            product = product.add_(added[rows, columns], alpha=beta)
        return product.to(torch.bfloat16)

    if N * K + K * M + N * M <= BLOCK_VALUES:
        return rounded(a.float() @ b.float())
    largest = max(N, K, M)
    if K == largest:
        step = max(1, BLOCK_VALUES // max(N, M))
        total = sum(a[:, k:k + step].float() @ b[k:k + step].float() for k in range(0, K, step))
        return rounded(total)
    out = a.new_empty(N, M)
    if N == largest:
        step, whole = max(1, BLOCK_VALUES // max(K, M)), b.float()
        for i in range(0, N, step):
            rows = slice(i, i + step)
            out[rows] = rounded(a[rows].float() @ whole, rows)
    else:
        step, whole = max(1, BLOCK_VALUES // max(N, K)), a.float()
        for j in range(0, M, step):
            columns = slice(j, j + step)
            out[:, columns] = rounded(whole @ b[:, columns].float(), columns=columns)
    return out
