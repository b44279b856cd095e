import pytest
import torch

from k3_kernels.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4


def _scale(rows, byte):
    return torch.full((rows, 1), byte, dtype=torch.uint8)


def test_unpack_low_nibble_is_even_element():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21  # low nibble 1 -> 0.5 (element 0), high nibble 2 -> 1.0 (element 1)
    out = dequantize_mxfp4(packed, _scale(1, 127), torch.float32)
    assert out.shape == (1, 32)
    assert out[0, 0].item() == 0.5 and out[0, 1].item() == 1.0
    assert torch.all(out[0, 2:] == 0)


@pytest.mark.parametrize("byte,factor", [(127, 1.0), (128, 2.0), (126, 0.5), (130, 8.0), (0, 2.0**-127), (254, 2.0**127)])
def test_scale_bytes(byte, factor):
    packed = torch.full((2, 16), 0x21, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, _scale(2, byte), torch.float32)
    expected = torch.tensor([0.5, 1.0] * 16).repeat(2, 1) * factor
    assert torch.equal(out, expected)


def test_full_code_table_and_groups():
    codes = torch.arange(16, dtype=torch.uint8)
    # element 2j = code j, element 2j+1 = code 15-j
    packed = (codes | ((15 - codes) << 4)).to(torch.uint8).repeat(1, 2)  # [1, 32] -> 64 cols, two groups
    scale = torch.tensor([[127, 129]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scale, torch.float32)
    table = torch.tensor(E2M1_VALUES)
    row = torch.stack([table, table.flip(0)], dim=-1).reshape(32)
    assert torch.equal(out[0, :32], row)
    assert torch.equal(out[0, 32:], row * 4)
    assert torch.signbit(out[0, 16])  # code 8 is -0


def test_batched_and_dtype():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 64, generator=g)
    p, s = quantize_mxfp4(w)
    assert p.shape == (3, 8, 32) and s.shape == (3, 8, 2) and p.dtype == s.dtype == torch.uint8
    out = dequantize_mxfp4(p, s)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 8, 64)
    assert torch.equal(out[1], dequantize_mxfp4(p[1], s[1]))
    assert torch.equal(out.float(), dequantize_mxfp4(p, s, torch.float32))  # grid values are exact in bf16


def test_quantize_rule():
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # amax 6 -> e = 2 - 2 = 0 -> byte 127
    x[0, 8] = -7.9  # saturates at -6
    x[0, 9] = -0.1  # rounds to zero, keeps its sign bit (-0, code 8)
    p, s = quantize_mxfp4(x)
    assert s.item() == 127
    out = dequantize_mxfp4(p, s, torch.float32)[0]
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert out[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert out[8].item() == -6.0
    assert out[9].item() == 0.0 and torch.signbit(out[9])
    assert (p[0, 0] & 0xF).item() == 7 and (p[0, 4] >> 4).item() == 8


def test_zero_group_uses_byte_zero_and_positive_zero():
    p, s = quantize_mxfp4(torch.zeros(2, 64))
    assert torch.all(s == 0) and torch.all(p == 0)


def test_scale_exponent_from_amax():
    x = torch.zeros(4, 32)
    x[:, 0] = torch.tensor([1.0, 7.99, 8.0, 1e-3])
    _, s = quantize_mxfp4(x)
    # floor(log2(amax)) - 2 + 127
    assert s[:, 0].tolist() == [125, 127, 128, int(torch.floor(torch.log2(torch.tensor(1e-3)))) - 2 + 127]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_idempotent(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)
    w[3, :32] = 0.0
    w[5, 32:64] = 1e-40  # tiny groups: exponent clamped to -127
    p, s = quantize_mxfp4(w.to(dtype))
    deq = dequantize_mxfp4(p, s, dtype)
    p2, s2 = quantize_mxfp4(deq)
    assert torch.equal(p, p2) and torch.equal(s, s2)
    # arbitrary bytes with OCP-canonical scales round-trip too
    assert torch.equal(dequantize_mxfp4(p2, s2, dtype), deq)


def test_quantization_error_bounded():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 128, generator=g)
    deq = dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)
    amax = w.view(16, 4, 32).abs().amax(-1, keepdim=True)
    err = (deq - w).view(16, 4, 32).abs()
    assert torch.all(err <= amax / 4 + 1e-6)  # half the coarsest grid step (2 * 2**e) relative to amax in [4, 8)*2**e


def test_errors():
    p = torch.zeros(4, 16, dtype=torch.uint8)
    s = torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="weight_packed"):
        dequantize_mxfp4(p.to(torch.int8), s)
    with pytest.raises(ValueError, match="weight_scale"):
        dequantize_mxfp4(p, s.float())
    with pytest.raises(ValueError, match="weight_scale"):
        dequantize_mxfp4(p, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_packed"):
        dequantize_mxfp4(torch.zeros(4, 15, dtype=torch.uint8), s)
    with pytest.raises(ValueError, match="leading"):
        dequantize_mxfp4(p, torch.zeros(3, 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quantize_mxfp4(torch.zeros(4, 30))
    with pytest.raises(ValueError):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
