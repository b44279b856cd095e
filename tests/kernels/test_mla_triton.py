"""The Triton paged MLA decode kernel against the paged torch reference and the gathered-latent reference.

Runs on the CPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU).
"""

import copy
import math

import pytest
import torch

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).
pytest.importorskip("triton")

from k3_kernels.mla.reference import mla_absorbed_attention, mla_paged_decode_reference  # noqa: E402
from helpers import rel_err  # noqa: E402

H, DN, DV, R, DR, PAGE = 4, 8, 8, 32, 16, 16
LENGTHS = [1, 17, 40]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Compiled on a GPU machine (the kernel needs CUDA tensors there), interpreted on the CPU otherwise.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _paged_inputs(dtype, Tq, shuffle, seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    n_blocks = math.ceil(max(lengths) / PAGE)
    num_pages = B * n_blocks + 2  # spare pages that no sequence owns: they must never be read
    pool = torch.randn(num_pages, PAGE, R + DR, generator=g).to(dtype)
    ids = torch.randperm(num_pages, generator=g) if shuffle else torch.arange(num_pages)
    block_table = ids[: B * n_blocks].view(B, n_blocks)
    pool[ids[B * n_blocks:]] = float("nan")
    q_nope = torch.randn(B, Tq, H, DN, generator=g).to(dtype)
    q_pe = torch.randn(B, Tq, H, DR, generator=g).to(dtype)
    w = (torch.randn(H * (DN + DV), R, generator=g) / R**0.5).to(dtype)
    return tuple(t.to(DEV) for t in (pool, block_table, torch.tensor(lengths), q_nope, q_pe, w))


def _absorb(q_nope, w):
    w_k = w.view(H, DN + DV, R)[:, :DN]
    return torch.einsum("bthd,hdr->bthr", q_nope.float(), w_k.float()).to(q_nope.dtype)  # [B, Tq, H, R]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Tq", [1, 3])
@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous_pages", "shuffled_pages"])
def test_triton_matches_references(dtype, Tq, shuffle):
    from k3_kernels.mla.triton_decode import mla_paged_decode

    pool, table, lengths, q_nope, q_pe, w = _paged_inputs(dtype, Tq, shuffle)
    scale = (DN + DR) ** -0.5
    q_lat = _absorb(q_nope, w)
    out = torch.full(q_lat.shape, float("nan"), dtype=dtype, device=DEV)  # every element must be written
    got = mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert not torch.isnan(got).any()
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lengths, scale)
    assert rel_err(got, want) <= TOL[dtype]

    # Against the existing absorbed attention on each sequence's gathered latent, after W_uv.
    w_v = w.view(H, DN + DV, R)[:, DN:]
    for b, L in enumerate(LENGTHS):
        pos = torch.arange(L, device=DEV)
        rows = pool[table[b, pos // PAGE], pos % PAGE]  # [L, R + DR]
        t = torch.arange(Tq, device=DEV)
        mask = (pos[None, :] < (L - Tq + t + 1)[:, None])[None, None]  # [1, 1, Tq, L]
        seen = mask[0, 0].any(-1)  # a query with no visible key is NaN in the reference, 0 in ours
        ref = mla_absorbed_attention(q_nope[b:b + 1], q_pe[b:b + 1], rows[None, :, :R], rows[None, :, R:],
                                     w, DV, scale, mask)[0]  # [Tq, H, DV]
        ours = torch.einsum("thr,hdr->thd", got[b].float(), w_v.float())
        assert rel_err(ours[seen], ref[seen]) <= TOL[dtype]
        assert (got[b][~seen] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_counts_agree(num_splits):
    """Split-K with empty splits and a single split (direct write) give the same result."""
    from k3_kernels.mla.triton_decode import mla_paged_decode

    pool, table, lengths, q_nope, q_pe, w = _paged_inputs(torch.float32, 3, True, seed=1)
    q_lat = _absorb(q_nope, w)
    got = mla_paged_decode(q_lat, q_pe, pool, table, lengths, 0.3, num_splits=num_splits)
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lengths, 0.3)
    assert rel_err(got, want) <= 1e-5


def test_many_splits_merge():
    """19 splits (more than the merge takes in one step, with a ragged last step), an empty sequence and splits
    past a sequence's end: the merge's two passes and its column slices against the reference."""
    from k3_kernels.mla.triton_decode import mla_paged_decode

    lengths = [150, 0, 301]
    pool, table, lens, q_nope, q_pe, w = _paged_inputs(torch.float32, 2, True, seed=5, lengths=lengths)
    q_lat = _absorb(q_nope, w)
    out = torch.full(q_lat.shape, float("nan"), device=DEV)
    got = mla_paged_decode(q_lat, q_pe, pool, table, lens, 0.3, num_splits=23, out=out)
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lens, 0.3)
    assert (got[1] == 0).all()  # no visible key: 0
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("heads,dr", [(6, DR), (5, 0)], ids=["rows_span_head_blocks", "no_pe_dims"])
def test_row_blocks_and_no_pe(heads, dr):
    """Tq * H = 18 or 15 rows over 16-row blocks (a block holds parts of two query tokens), and dr = 0."""
    from k3_kernels.mla.triton_decode import mla_paged_decode

    pool, table, lengths, _, _, _ = _paged_inputs(torch.float32, 3, True, seed=3)
    pool = pool[..., : R + dr].contiguous()
    g = torch.Generator().manual_seed(4)
    q_lat = torch.randn(len(LENGTHS), 3, heads, R, generator=g).to(DEV)
    q_pe = torch.randn(len(LENGTHS), 3, heads, dr, generator=g).to(DEV) if dr else None
    got = mla_paged_decode(q_lat, q_pe, pool, table, lengths, 0.2, block_m=16)
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lengths, 0.2)
    assert rel_err(got, want) <= 1e-5


def test_padding_mask():
    """A key mask (left padding) is ANDed with the causal rule."""
    from k3_kernels.mla.triton_decode import mla_paged_decode

    pool, table, lengths, q_nope, q_pe, w = _paged_inputs(torch.float32, 1, True, seed=2)
    q_lat = _absorb(q_nope, w)
    mask = torch.ones(len(LENGTHS), 1, table.shape[1] * PAGE, dtype=torch.bool, device=DEV)
    mask[1, :, :5] = False
    mask[2, :, 3:11] = False
    got = mla_paged_decode(q_lat, q_pe, pool, table, lengths, 0.3, mask=mask)
    want = mla_paged_decode_reference(q_lat, q_pe, pool, table, lengths, 0.3, mask=mask)
    unmasked = mla_paged_decode_reference(q_lat, q_pe, pool, table, lengths, 0.3)
    assert rel_err(got, want) <= 1e-5
    assert rel_err(got[1:], unmasked[1:]) > 1e-3  # the mask really changed something


def test_bad_inputs_raise():
    from k3_kernels.mla.triton_decode import mla_paged_decode

    pool, table, lengths, q_nope, q_pe, w = _paged_inputs(torch.float32, 1, False)
    q_lat = _absorb(q_nope, w)
    with pytest.raises(ValueError, match="q_pe"):
        mla_paged_decode(q_lat, q_pe[..., :4], pool, table, lengths, 0.3)
    with pytest.raises(ValueError, match="page_size"):
        mla_paged_decode(q_lat, q_pe, pool[:, :12], table, lengths, 0.3)
    with pytest.raises(ValueError, match="lengths"):
        mla_paged_decode(q_lat, q_pe, pool, table, lengths[:2], 0.3)


def test_registered_name():
    import transformers_k3  # noqa: F401
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "k3_mla_paged" in ALL_ATTENTION_FUNCTIONS
    assert "k3_mla_paged" in AttentionInterface().valid_keys()
    assert "k3_mla_paged" in ALL_MASK_ATTENTION_FUNCTIONS


def _tiny_lm(attn_implementation):
    from transformers_k3 import KimiK3ForCausalLM
    from transformers_k3.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=4).text_config
    # The supported way: transformers validates the name against the registry (`valid_keys()`).
    return KimiK3ForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32).eval()


def _cached_logits(model, ids, mask):
    """Cached prefill of 5 tokens, one decode step, then a 2-token continuation (speculative verify shape)."""
    from transformers_k3 import KimiK3Cache

    cache = KimiK3Cache(model.config)
    out = []
    for lo, hi in ((0, 5), (5, 6), (6, 8)):
        res = model(input_ids=ids[:, lo:hi], attention_mask=mask[:, :hi], past_key_values=cache, use_cache=True)
        out.append(res.logits)
    return torch.cat(out, dim=1)


def test_model_paged_matches_sdpa():
    paged = _tiny_lm("k3_mla_paged").to(DEV)
    assert paged.config._attn_implementation == "k3_mla_paged"
    ref = _tiny_lm("sdpa").to(DEV)
    ref.load_state_dict(paged.state_dict())
    ids = torch.randint(0, 500, (2, 8), device=DEV)
    mask = torch.ones(2, 8, dtype=torch.long, device=DEV)
    mask[1, :2] = 0  # left padding: the kernel must honour the key mask
    with torch.no_grad():
        got, want = _cached_logits(paged, ids, mask), _cached_logits(ref, ids, mask)
        # Without a cache the registered function is SDPA over expanded K/V.
        full_got = paged(input_ids=ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    assert rel_err(got[keep], want[keep]) <= 1e-5
    assert rel_err(full_got[keep], want[keep]) <= 1e-4


def test_model_paged_on_cpu_raises(monkeypatch):
    model = _tiny_lm("k3_mla_paged")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a plain CPU run: no interpreter, no GPU
    ids = torch.randint(0, 500, (1, 4))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="k3_mla_paged"):
            model(input_ids=ids, use_cache=True)
        with pytest.raises(RuntimeError, match="k3_mla_paged"):
            model(input_ids=ids, use_cache=False)


def test_from_pretrained_generate_matches(tiny_dir, lm):
    """`from_pretrained(..., attn_implementation="k3_mla_paged")` reaches the text model; greedy decode agrees."""
    from transformers_k3 import KimiK3ForConditionalGeneration

    model = KimiK3ForConditionalGeneration.from_pretrained(
        tiny_dir, dtype=torch.float32, attn_implementation="k3_mla_paged"
    ).eval().to(DEV)
    paged = model.language_model
    lm = copy.deepcopy(lm).to(DEV)  # the session fixture itself stays on the CPU
    assert paged.config._attn_implementation == "k3_mla_paged"
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEV)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    got, want = paged.generate(ids, **kw), lm.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert rel_err(torch.stack(got.scores), torch.stack(want.scores)) <= 1e-5


def test_without_triton_the_error_says_so(monkeypatch):
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "k3_kernels.mla.triton_decode", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now fails as if it were not installed
    with pytest.raises(ImportError, match="k3_mla_paged.*Triton"):
        importlib.import_module("k3_kernels.mla.triton_decode")
