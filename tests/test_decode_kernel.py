"""covey's decode kernel: the products of F.linear, built once per machine, and never in the way."""

import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from covey import decode_kernel


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernel built anew into an empty cache folder, and forgotten again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decode_kernel._library.cache_clear()
    yield tmp_path / "covey"
    decode_kernel._library.cache_clear()


def should_run_here() -> bool:
    return (platform.system() == "Linux" and platform.machine() == "x86_64"
            and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and shutil.which(os.environ.get("CC") or "cc") is not None
            and os.environ.get("COVEY_DECODE_KERNEL", "1") != "0")


def test_the_kernel_builds_and_passes_its_self_check_wherever_it_should(fresh_build):
    if not should_run_here():
        pytest.skip("needs Linux on x86-64 with AVX-512 and a C compiler")
    assert decode_kernel.available()  # a kernel that disagreed with F.linear would be turned away here
    built = list(fresh_build.glob("decode_linear-*.so"))
    assert len(built) == 1
    modified = built[0].stat().st_mtime_ns
    decode_kernel._library.cache_clear()
    assert decode_kernel.available() and built[0].stat().st_mtime_ns == modified  # reused, not rebuilt


@pytest.mark.parametrize("K", [16, 64, 37, 5])
def test_kernel_products_equal_linear_ones(K):
    if not decode_kernel.available():
        pytest.skip("the decode kernel does not run here")
    generator = torch.Generator().manual_seed(K)
    # several matrices side by side, with and without biases, of 1 row to rows past a tile of 4
    parts = [(torch.randn(n, K, generator=generator), torch.randn(n, generator=generator) if n % 2 else None)
             for n in (1, 4, 7, 130)]
    multiply = decode_kernel.matrices(parts)
    for rows in (1, 2, 3, 4, 5, 8, 13, 32, 40):
        x = torch.randn(2, rows, K, generator=generator)[1]  # a view that does not start at its storage's start
        expected = torch.cat([F.linear(x, w, b) for w, b in parts], -1)
        assert torch.allclose(multiply(x), expected, atol=1e-5, rtol=1e-5), rows
        # leading dimensions carried through
        assert torch.allclose(multiply(x.view(1, rows, K)), expected[None], atol=1e-5, rtol=1e-5)


def test_kernel_refuses_other_dtypes():
    if not decode_kernel.available():
        pytest.skip("the decode kernel does not run here")
    with pytest.raises(ValueError, match="float32"):
        decode_kernel.matrices([(torch.randn(4, 16, dtype=torch.bfloat16), None)])


def test_turned_off_it_is_not_built(fresh_build, monkeypatch):
    monkeypatch.setenv("COVEY_DECODE_KERNEL", "0")
    assert not decode_kernel.available()
    assert not fresh_build.exists()


def test_a_failing_build_warns_and_leaves_the_general_products(fresh_build, monkeypatch, tmp_path, tiny_model):
    if not should_run_here():
        pytest.skip("needs Linux on x86-64 with AVX-512 and a C compiler")
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'broken-cc 1.0'\n[ \"$1\" = --version ] || { echo 'no luck' >&2; exit 1; }\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.warns(RuntimeWarning, match="(?s)could not be built.*no luck"):
        assert not decode_kernel.available()
    assert list(fresh_build.iterdir()) == []  # no half-built library left behind
    from covey.decoder import LeanDecoder

    assert LeanDecoder(tiny_model, torch.float32, max_length=8).products_for(8).kind != "kernel"
    with pytest.raises(ValueError, match="decode kernel cannot run here"):
        LeanDecoder(tiny_model, torch.float32, max_length=8, products="kernel")


def test_without_a_compiler_it_is_quietly_not_used(fresh_build, monkeypatch, recwarn):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    assert not decode_kernel.available()
    assert not [w for w in recwarn if "decode kernel" in str(w.message)]
