"""The Gluon paged MLA decode split kernel (`k3_kernels.mla.gluon_decode`, through
`mla_paged_decode(gluon=True)`) against the paged torch reference, at K3's latent shapes (r = 512, dr = 64).

Gluon kernels do not run under `TRITON_INTERPRET`, so the numeric tests run on a Hopper GPU only; on the CPU this
file checks the errors. Tolerance rule, as for the Triton kernel's bf16 cases: bf16 operands with fp32
accumulation, P rounded to bf16 before its product, so rel_err <= 2e-2 against the fp32 reference on the same
inputs.
"""

import logging
import math

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from helpers import rel_err  # noqa: E402
from k3_kernels.mla.reference import mla_paged_decode_reference  # noqa: E402
from k3_kernels.mla.triton_decode import mla_paged_decode  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon wgmma kernels need a Hopper GPU")
R, DR = 512, 64


def _inputs(lengths, H, Tq, page, seed, dtype=torch.bfloat16):
    """Shuffled pages, with spare pages of NaN that no sequence owns (they must never be read)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    n_blocks = max(1, math.ceil(max(lengths) / page))
    num_pages = B * n_blocks + 3
    pool = torch.randn(num_pages, page, R + DR, generator=g).to(dtype)
    ids = torch.randperm(num_pages, generator=g)
    table = ids[: B * n_blocks].view(B, n_blocks).to(torch.int32)
    pool[ids[B * n_blocks:]] = float("nan")
    q_lat = (torch.randn(B, Tq, H, R, generator=g) / R**0.25).to(dtype)
    q_pe = (torch.randn(B, Tq, H, DR, generator=g) / DR**0.25).to(dtype)
    return [t.to(DEV) for t in (q_lat, q_pe, pool, table, torch.tensor(lengths, dtype=torch.int32))]


@needs_hopper
@pytest.mark.parametrize("block_n,stages", [(64, 2), (32, 2), (32, 3)])
@pytest.mark.parametrize("H,Tq,page,lengths,splits", [
    (96, 1, 64, [1, 63, 64, 65, 1000], None),  # K3's heads: row blocks of 64 and 32; tile and page edges
    (96, 3, 16, [3, 17, 100, 777], 3),  # three query tokens (288 rows), 16-token pages inside a tile
    (6, 2, 64, [2, 129, 2048], 1),  # few rows (12 of a 64-row block), one split: the direct write
    (16, 1, 128, [0, 5, 300], 5),  # an empty sequence and splits past a sequence's end
])
def test_matches_reference(H, Tq, page, lengths, splits, block_n, stages):
    q_lat, q_pe, pool, table, lens = _inputs(lengths, H, Tq, page, seed=H * page + Tq)
    scale = (128 + DR) ** -0.5
    out = torch.full(q_lat.shape, float("nan"), dtype=q_lat.dtype, device=DEV)  # every element must be written
    got = mla_paged_decode(q_lat, q_pe, pool, table, lens, scale, out=out, num_splits=splits, gluon=True,
                           block_n=block_n, num_stages=stages)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lens, scale)
    assert rel_err(got.float(), want.float()) <= 2e-2
    if 0 in lengths:
        assert (got[lengths.index(0)] == 0).all()


@needs_hopper
def test_mask_and_the_triton_kernel():
    """A key mask ANDed with the causal rule; the Triton kernel on the same inputs agrees to the tolerance."""
    lengths = [40, 300, 129]
    q_lat, q_pe, pool, table, lens = _inputs(lengths, 96, 1, 64, seed=9)
    mask = torch.ones(len(lengths), 1, table.shape[1] * 64, dtype=torch.bool, device=DEV)
    mask[1, :, :70] = False
    mask[2, :, 3:11] = False
    got = mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1, mask=mask, gluon=True)
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lens, 0.1, mask=mask)
    assert rel_err(got.float(), want.float()) <= 2e-2
    assert rel_err(got.float(), mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1, mask=mask).float()) <= 2e-2
    unmasked = mla_paged_decode_reference(q_lat, q_pe, pool, table, lens, 0.1)
    assert rel_err(got[1:].float(), unmasked[1:].float()) > 1e-2  # the mask really changed something


def test_default_choice(monkeypatch, caplog):
    """By default K3's shapes run on the Gluon kernel where it can run; a Triton launch parameter, or a device
    without it, picks the Triton kernel (warning once in the second case), with the same result."""
    from k3_kernels import dispatch
    from k3_kernels.mla import gluon_decode

    calls = []
    orig = gluon_decode.mla_split_gluon
    monkeypatch.setattr(gluon_decode, "mla_split_gluon", lambda *a, **kw: calls.append(kw) or orig(*a, **kw))
    monkeypatch.setattr(dispatch, "_warned", set())
    q_lat, q_pe, pool, table, lens = _inputs([5, 70], 4, 1, 16, seed=2)
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lens, 0.1)
    if HOPPER:
        got = mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1)
        assert len(calls) == 1 and (calls[0]["block_n"], calls[0]["stages"]) == (64, 2)  # the measured launch
        assert rel_err(got.float(), want.float()) <= 2e-2
        mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1, block_n=32)  # a Triton launch parameter
        assert len(calls) == 1
    else:  # the Triton kernel under the interpreter
        with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
            for _ in range(2):
                got = mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1)
        assert sum("MLA decode uses the Triton split kernel" in r.getMessage() for r in caplog.records) == 1
        assert calls == [] and rel_err(got.float(), want.float()) <= 2e-2


def test_bad_requests():
    q_lat, q_pe, pool, table, lens = _inputs([5], 4, 1, 16, seed=1)
    if not HOPPER:
        with pytest.raises(RuntimeError, match="compute capability 9"):
            mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1, gluon=True)
        return
    with pytest.raises(ValueError, match="block_n 32 or 64"):
        mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1, gluon=True, block_n=128)
    with pytest.raises(ValueError, match="num_stages"):
        mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.1, gluon=True, num_stages=3)  # 64-token buffers
    with pytest.raises(RuntimeError, match="r = 512"):
        mla_paged_decode(q_lat[..., :256].contiguous(), q_pe, pool[..., 256:].contiguous(), table, lens, 0.1,
                         gluon=True)
