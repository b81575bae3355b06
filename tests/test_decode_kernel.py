"""covey's decode kernel: the products of F.linear, built once per machine, and never in the way."""

import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from covey.rollout.fast import decode_kernel


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernel built anew into an empty cache folder, and forgotten again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decode_kernel._library.cache_clear(), decode_kernel._amx_library.cache_clear()
    yield tmp_path / "covey"
    decode_kernel._library.cache_clear(), decode_kernel._amx_library.cache_clear()


def should_run_here() -> bool:
    return (platform.system() == "Linux" and platform.machine() == "x86_64"
            and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and shutil.which(os.environ.get("CC") or "cc") is not None
            and os.environ.get("COVEY_DECODE_KERNEL", "1") != "0")


def skip_without_kernel(dtype: torch.dtype = torch.float32) -> None:
    if not decode_kernel.available():
        pytest.skip("covey's decode kernel does not run here (needs Linux, x86-64 with AVX-512 and a C compiler)")
    if not decode_kernel.available(dtype):
        pytest.skip(f"covey's decode kernel does not multiply {dtype} here (bfloat16 needs AMX)")


def test_the_kernel_builds_and_passes_its_self_check_wherever_it_should(fresh_build):
    if not should_run_here():
        pytest.skip("needs Linux on x86-64 with AVX-512 and a C compiler")
    assert decode_kernel.available()  # a kernel that disagreed with F.linear would be turned away here
    built = list(fresh_build.glob("decode_kernel-*.so"))
    assert len(built) == 1
    modified = built[0].stat().st_mtime_ns
    decode_kernel._library.cache_clear()
    assert decode_kernel.available() and built[0].stat().st_mtime_ns == modified  # reused, not rebuilt
    # and in bfloat16 where the CPU has AMX and Linux lets this process use it
    amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(decode_kernel._cpu_flags().split())
    if amx and decode_kernel._library().covey_amx_ready() == 0:
        assert decode_kernel.available(torch.bfloat16)


@pytest.mark.parametrize("K", [16, 64, 37, 5])
def test_kernel_products_equal_linear_ones(K):
    skip_without_kernel()
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


@pytest.mark.parametrize("K", [32, 576, 37, 5])
def test_bfloat16_kernel_products_are_those_of_x_rounded_to_bfloat16(K):
    """Sums in float32 of bfloat16 weights times x rounded to bfloat16: F.linear's on those, to float32's
    rounding, whatever the tails of rows (of 16) and columns (of 32), and for any number of rows of x."""
    skip_without_kernel(torch.bfloat16)
    generator = torch.Generator().manual_seed(K)
    parts = [(torch.randn(n, K, generator=generator).bfloat16(), torch.randn(n, generator=generator) if n % 2 else None)
             for n in (1, 16, 7, 33, 130)]
    multiply = decode_kernel.matrices([(decode_kernel.tile_bf16(w), b) for w, b in parts])
    for rows in (1, 3, 16, 17, 32, 40, 100):
        x = torch.randn(2, rows, K, generator=generator)[1]
        rounded = x.bfloat16().float()
        expected = torch.cat([F.linear(rounded, w.float(), b) for w, b in parts], -1)
        # float32 sums in another order: within a few units of rounding of the sum of the terms' sizes
        terms = torch.cat([F.linear(rounded.abs(), w.float().abs()) for w, _ in parts], -1)
        assert ((multiply(x) - expected).abs() <= 1e-6 * (terms + 1)).all(), rows


def test_bfloat16_tiles_are_the_matrix_block_by_block():
    weight = torch.arange(20 * 40, dtype=torch.float32).view(20, 40).bfloat16()
    tiled = decode_kernel.tile_bf16(weight)
    assert tiled.shape == (20, 40) and tiled.tiles.shape == (2, 2, 16, 16, 2) and tiled.tiles.is_contiguous()
    padded = torch.zeros(32, 64, dtype=torch.bfloat16)
    padded[:20, :40] = weight
    for row_block in range(2):
        for column_block in range(2):
            block = padded[16 * row_block:16 * row_block + 16, 32 * column_block:32 * column_block + 32]
            for pair in range(16):  # each row's pair of columns 2 * pair, 2 * pair + 1
                assert torch.equal(tiled.tiles[row_block, column_block, pair], block[:, 2 * pair:2 * pair + 2])


@pytest.mark.parametrize("shape", [(20, 40), (16, 32), (1, 5), (33, 576)])
def test_float32_matrices_are_tiled_by_the_kernel_as_torch_rounds_and_lays_them_out(shape):
    """The kernel's one-pass tiling of a float32 matrix: torch's rounding to bfloat16 (to nearest even,
    ties included) and ``tile_bf16``'s layout of the rounded matrix, bit for bit."""
    skip_without_kernel(torch.bfloat16)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
    weight.view(-1)[::3] = 1 + 2.0 ** -8 * torch.arange(len(weight.view(-1)[::3])).remainder(4)  # ties and neighbours
    tiled, expected = decode_kernel.tile_bf16(weight), decode_kernel.tile_bf16(weight.bfloat16())
    assert tiled.shape == expected.shape == shape
    assert torch.equal(tiled.tiles.view(torch.int16), expected.tiles.view(torch.int16))


def test_kernel_refuses_other_dtypes():
    skip_without_kernel()
    with pytest.raises(ValueError, match="float32"):
        decode_kernel.matrices([(torch.randn(4, 16, dtype=torch.bfloat16), None)])  # bfloat16, but not in tiles
    with pytest.raises(ValueError, match="all one or the other"):
        decode_kernel.matrices([(torch.randn(4, 16), None), (decode_kernel.tile_bf16(torch.randn(4, 16)), None)])


def test_turned_off_it_is_not_built(fresh_build, monkeypatch):
    monkeypatch.setenv("COVEY_DECODE_KERNEL", "0")
    assert not decode_kernel.available()
    assert not fresh_build.exists()


def test_where_its_cache_folder_cannot_be_written_it_builds_in_a_private_temporary_one(fresh_build, monkeypatch,
                                                                                      tmp_path):
    """A cache folder that cannot be written (here a file stands in its way, which stops root too): the
    library goes to a folder of this user's alone in the temporary directory, and is reused from there.
    A temporary folder others can write to is never loaded from: a warning says how to give it a folder."""
    import tempfile

    if not should_run_here():
        pytest.skip("needs Linux on x86-64 with AVX-512 and a C compiler")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert decode_kernel.available()
    private = tmp_path / f"covey-{os.getuid()}"
    built = list(private.glob("decode_kernel-*.so"))
    assert len(built) == 1 and private.stat().st_mode & 0o777 == 0o700
    modified = built[0].stat().st_mtime_ns
    decode_kernel._library.cache_clear()
    assert decode_kernel.available() and built[0].stat().st_mtime_ns == modified  # reused, not rebuilt

    private.chmod(0o777)  # now others could have put a library there
    decode_kernel._library.cache_clear()
    with pytest.warns(RuntimeWarning, match="(?s)could not be built.*others can write to it.*set XDG_CACHE_HOME"):
        assert not decode_kernel.available()


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
    from covey.rollout.fast.decoder import LeanDecoder

    assert LeanDecoder(tiny_model, torch.float32, max_length=8).products_for(8).kind != "kernel"
    with pytest.raises(ValueError, match="decode kernel cannot run here"):
        LeanDecoder(tiny_model, torch.float32, max_length=8, multiply="kernel")


def test_without_a_compiler_it_is_quietly_not_used(fresh_build, monkeypatch, recwarn):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    assert not decode_kernel.available()
    assert not [w for w in recwarn if "decode kernel" in str(w.message)]


def odd_llama(vocab_size: int):
    """A tiny Llama of awkward sizes (no multiple of 16 anywhere, 5 query heads to 1 key-value head) with
    every projection biased: the shapes and biases the whole-step kernel must handle besides the usual."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
                         num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-3)])
@pytest.mark.parametrize("build", ["llama", "odd llama"])
def test_whole_decode_steps_give_the_logits_of_the_plain_lean_decoder(tokenizer, build, dtype, tolerance):
    """Prompts of different lengths (padding), rows leaving (the kernel then reads each row's cache
    where it lies) and repeating (a copy of the cache) between steps (``keep``). In bfloat16, against
    float32 on the same (rounded) matrices: what differs is x rounded to bfloat16 at each product."""
    from covey.rollout.fast.decoder import LeanDecoder
    from covey.rollout import left_pad
    from tests.conftest import make_model

    skip_without_kernel(dtype)
    model = make_model(len(tokenizer), seed=7, layers=3) if build == "llama" else odd_llama(len(tokenizer))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(param.to(dtype))
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    ids, mask = left_pad(prompts, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, len(tokenizer), (6, 9), generator=generator)
    runs = {}
    for products in ("kernel", "plain"):
        decoder = LeanDecoder(model, dtype if products == "kernel" else torch.float32, max_length=24,
                              multiply=products)
        assert (decoder.layer_stack is not None) == (products == "kernel")
        logits = [decoder.prefill(ids, mask, positions, 3)]
        rows, position = torch.arange(6), positions[:, -1].repeat_interleave(3) + 1
        for t in range(9):
            keep = {3: [5, 0, 2], 5: [2, 0, 0, 1], 7: [3, 1]}.get(t)  # rows leave, one is repeated, rows leave
            if keep is not None:
                keep = torch.tensor(keep)
                decoder.keep(keep)
                rows, position = rows[keep], position[keep]
            logits.append(decoder.step(tokens[rows, t], position + t))
        runs[products] = logits
    for kernel, plain in zip(runs["kernel"], runs["plain"]):
        assert torch.allclose(kernel, plain, atol=tolerance, rtol=tolerance)


def test_the_decode_step_refuses_slots_outside_the_cache(tiny_model):
    """The C step indexes the cache by them: a wrong slot, or a cache unlike the one it was made as, is
    refused before it runs."""
    from covey.rollout.fast.decoder import LeanDecoder

    skip_without_kernel()
    decoder = LeanDecoder(tiny_model, torch.float32, max_length=8, multiply="kernel")
    decoder.prefill(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), torch.tensor([[0, 1]]), 2)
    assert len(decoder.keys[0]) == 3  # the prompt's row, then one per sample
    x = decoder.embed(torch.tensor([7, 8])).float()
    cos, sin = (t[:, 0].contiguous() for t in decoder.rotary(x, torch.tensor([[2], [2]])))
    cache = decoder.valid_BL, decoder.slots_B, 2, decoder.keys, decoder.values
    for slots in (torch.tensor([1, 3], dtype=torch.int32), torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(ValueError, match="slots must be"):
            decoder.layer_stack.step(x, cos, sin, decoder.valid_BL, slots, 2, decoder.keys, decoder.values)
        with pytest.raises(ValueError, match="prefix_slots must be"):
            decoder.layer_stack.step(x, cos, sin, *cache, slots, 2)
    with pytest.raises(ValueError, match="shared prefix"):
        decoder.layer_stack.step(x, cos, sin, *cache, decoder.prefix_slots_B, 3)
    # a cache of another dtype, layout or length than the one it was made as
    for wrong in (decoder.keys[0].double(), decoder.keys[0].transpose(1, 2), decoder.keys[0][:, :, :4]):
        with pytest.raises(ValueError, match="the cache must be contiguous float32"):
            decoder.layer_stack.step(x, cos, sin, decoder.valid_BL, decoder.slots_B, 2, [wrong] + decoder.keys[1:],
                                     decoder.values, decoder.prefix_slots_B, 2)


def test_a_kernel_that_disagrees_with_linear_is_turned_away_with_a_warning(fresh_build, monkeypatch):
    if not should_run_here():
        pytest.skip("needs Linux on x86-64 with AVX-512 and a C compiler")
    monkeypatch.setattr(decode_kernel, "_agrees_with_linear", lambda library, dtype: False)
    with pytest.warns(RuntimeWarning, match="other products than F.linear"):
        assert not decode_kernel.available()


def test_bfloat16_products_that_disagree_with_linear_leave_the_float32_ones(fresh_build, monkeypatch):
    skip_without_kernel(torch.bfloat16)
    monkeypatch.setattr(decode_kernel, "_agrees_with_linear", lambda library, dtype: dtype == torch.float32)
    decode_kernel._library.cache_clear(), decode_kernel._amx_library.cache_clear()
    with pytest.warns(RuntimeWarning, match="other bfloat16 products than F.linear"):
        assert not decode_kernel.available(torch.bfloat16)
    assert decode_kernel.available(torch.float32)
