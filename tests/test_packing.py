import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.formats.packing import pack, packed_bytes, unpack


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 4), n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip_exactly(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (rows, packed_bytes(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_nibble_order_low_is_even():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    assert pack(codes, 4)[0].tolist() == [0x21, 0x43, 0x65, 0x87]


def test_two_bit_order_and_three_bit_density():
    codes = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert pack(codes, 2)[0].tolist() == [0b00111001, 0]
    assert pack(torch.full((1, 8), 7, dtype=torch.uint8), 3)[0].tolist() == [255, 255, 255]


def test_rejects_wrong_dtype_and_length():
    with pytest.raises(TypeError):
        pack(torch.zeros(1, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError):
        unpack(torch.zeros(1, 3, dtype=torch.uint8), 4, 16)


@pytest.mark.parametrize("bits", (3, 6))
def test_three_and_six_bit_byte_paths_are_the_word_path(bits):
    """3- and 6-bit codes (Q3_K, Q6_K) are packed by byte shifts: the same little-endian bit stream as the int64
    word path."""
    from lowbit.formats.packing import _pack_words

    codes = torch.randint(0, 2**bits, (5, 40), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    codes[0] = 2**bits - 1
    assert torch.equal(pack(codes, bits), _pack_words(codes.reshape(-1, 8), bits).reshape(5, -1))


def test_six_bit_bytes():
    assert pack(torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0]], dtype=torch.uint8), 6)[0, :3].tolist() == [
        1 | 2 << 6, 2 >> 2 | 3 << 4, 3 >> 4 | 4 << 2]
