"""Backend choice for KDA (`k3_kernels.dispatch.kda_ops`), with device and Triton availability mocked, and the
model's decode through the Triton recurrent kernel (CPU interpreter) updating the cache state in place.
Tolerance of the model check: rel_err (max-norm) < 5e-5, the hybrid-invariant tolerance.
"""

import copy
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).

import pytest
import torch

from helpers import rel_err
from k3_kernels import dispatch
from k3_kernels.kda import reference as ref

CHUNK_MOD = "k3_kernels.kda.triton_chunk"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())


def _without_chunk_module(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == CHUNK_MOD else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _with_fake_chunk_module(monkeypatch):
    fake = types.ModuleType(CHUNK_MOD)
    fake.__spec__ = importlib.machinery.ModuleSpec(CHUNK_MOD, None)

    def chunk_kda(*args, **kwargs):
        raise AssertionError("not called")

    fake.chunk_kda = chunk_kda
    monkeypatch.setitem(sys.modules, CHUNK_MOD, fake)
    return chunk_kda


def test_torch_everywhere():
    for device in ("cpu", "cuda"):
        assert dispatch.kda_ops("torch", device) == (ref.chunk_kda, ref.fused_recurrent_kda)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="kda_backend"):
        dispatch.kda_ops("cutlass", "cuda")


def test_triton_without_cuda_or_triton_raises(monkeypatch):
    with pytest.raises(RuntimeError, match="CUDA"):
        dispatch.kda_ops("triton", "cpu")
    monkeypatch.setattr(dispatch, "_triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        dispatch.kda_ops("triton", "cuda")


def test_fla_without_cuda_raises():
    with pytest.raises(RuntimeError, match="fla"):
        dispatch.kda_ops("fla", "cpu")


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_triton_on_cuda_uses_triton_kernels(monkeypatch, backend):
    pytest.importorskip("triton")
    from k3_kernels.kda.triton_recurrent import fused_recurrent_kda

    monkeypatch.setattr(dispatch, "_triton_available", lambda: True)
    fake_chunk = _with_fake_chunk_module(monkeypatch)
    assert dispatch.kda_ops(backend, "cuda") == (fake_chunk, fused_recurrent_kda)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_missing_triton_chunk_falls_back_once(monkeypatch, caplog, backend):
    pytest.importorskip("triton")
    from k3_kernels.kda.triton_recurrent import fused_recurrent_kda

    monkeypatch.setattr(dispatch, "_triton_available", lambda: True)
    _without_chunk_module(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        for _ in range(3):
            assert dispatch.kda_ops(backend, "cuda") == (ref.chunk_kda, fused_recurrent_kda)
    assert sum("Triton chunk" in r.getMessage() for r in caplog.records) == 1


def test_head_dim_the_chunk_kernel_cannot_tile(monkeypatch, caplog):
    """head_dim 48: explicit "triton" raises naming the field; "auto" prefills on the torch reference (one warning)
    and keeps the Triton decode kernel; a power of two keeps both Triton kernels."""
    pytest.importorskip("triton")
    from k3_kernels.kda.triton_recurrent import fused_recurrent_kda

    monkeypatch.setattr(dispatch, "_triton_available", lambda: True)
    fake_chunk = _with_fake_chunk_module(monkeypatch)
    with pytest.raises(ValueError, match="head_dim = 48"):
        dispatch.kda_ops("triton", "cuda", head_dim=48)
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        for _ in range(3):
            assert dispatch.kda_ops("auto", "cuda", head_dim=48) == (ref.chunk_kda, fused_recurrent_kda)
    assert sum("head_dim 48" in r.getMessage() for r in caplog.records) == 1
    assert dispatch.kda_ops("auto", "cuda", head_dim=64) == (fake_chunk, fused_recurrent_kda)
    assert dispatch.kda_ops("triton", "cuda", head_dim=128) == (fake_chunk, fused_recurrent_kda)


def test_auto_cuda_without_triton_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_triton_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        for _ in range(3):
            assert dispatch.kda_ops("auto", "cuda") == (ref.chunk_kda, ref.fused_recurrent_kda)
    assert sum("torch reference" in r.getMessage() for r in caplog.records) == 1


def test_auto_cpu_is_torch_silently(caplog):
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        assert dispatch.kda_ops("auto", "cpu") == (ref.chunk_kda, ref.fused_recurrent_kda)
    assert not caplog.records


@torch.no_grad()
def test_model_decode_through_triton_recurrent_updates_cache_in_place(lm, monkeypatch):
    """Cached token-by-token decode with the Triton recurrent kernel equals the full torch forward, and the
    cache keeps the same state tensors (updated in place, not replaced)."""
    pytest.importorskip("triton")
    from transformers_k3 import KimiK3Cache

    from k3_kernels.kda.triton_recurrent import fused_recurrent_kda

    calls = []

    def recurrent(*args, **kwargs):
        calls.append(kwargs.get("inplace_final_state", False))
        return fused_recurrent_kda(*args, **kwargs)

    recurrent.supports_inplace_state = True
    # Compiled Triton needs CUDA tensors; without a GPU the interpreter runs on the CPU ones.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = copy.deepcopy(lm).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 500, (2, 9), generator=g).to(device)
    full = lm(input_ids=x, use_cache=False).logits
    monkeypatch.setattr(dispatch, "kda_ops", lambda backend, device, head_dim=None: (ref.chunk_kda, recurrent))
    cache = KimiK3Cache(lm.config)
    steps = [lm(input_ids=x[:, :5], cache=cache, use_cache=True).logits]
    states = {i: s for i, s in cache.recurrent_states.items()}
    for t in range(5, 9):
        steps.append(lm(input_ids=x[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert calls and all(calls)
    assert all(cache.recurrent_states[i] is s for i, s in states.items())
    assert rel_err(torch.cat(steps, 1), full) < 5e-5
