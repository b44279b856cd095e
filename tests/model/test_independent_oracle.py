"""An independent float64 oracle of the Kimi K3 language-model forward pass, compared with the package.

The oracle is written from SPEC.md sections 1-5 only. It reads the weights straight out of a released-layout
``model.safetensors`` by their released names (``language_model.model.layers.{L}....``), dequantises the MXFP4
routed experts itself from the packed bytes, and implements every block on its own: a plain token-loop KDA with
its own short convolution, an expanded-K/V causal softmax MLA (no weight absorption), Block AttnRes, the sigmoid
router with bias-corrected top-k, the latent MoE and SiTU-GLU. Nothing is imported from
``transformers_k3.modeling_kimi_k3`` or ``k3_kernels``; the package is only touched to write the tiny checkpoint
and as the model under test.

Tolerance rule: max relative error ``max|a - b| / max|b|`` over the whole logits tensor, package (fp32) vs
oracle (fp64): < 1e-4. Greedy generation must match token for token.
The oracle's KDA recurrence is itself anchored to ``fla.ops.kda.naive.naive_recurrent_kda`` (fp64, < 1e-10).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

DT = torch.float64
PREFIX = "language_model."

# ----------------------------------------------------------------------------------------------------------
# Oracle
# ----------------------------------------------------------------------------------------------------------

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in/2] uint8 (low nibble = even element) + [out, in/32] E8M0 bytes -> [out, in] float64."""
    p = packed.to(torch.int64)
    out_dim, half = p.shape
    codes = torch.empty(out_dim, half * 2, dtype=torch.int64)
    codes[:, 0::2] = p & 0xF
    codes[:, 1::2] = (p >> 4) & 0xF
    table = torch.tensor(_E2M1, dtype=DT)
    mag = table[codes & 0x7]
    sign = torch.where((codes & 0x8) != 0, -1.0, 1.0).to(DT)
    vals = sign * mag
    s = torch.pow(torch.tensor(2.0, dtype=DT), scale.to(torch.int64).to(DT) - 127.0)  # [out, in/32]
    s = s.repeat_interleave(32, dim=1)
    assert s.shape == vals.shape
    return vals * s


def rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def situ_glu(g, u, b1, b2):
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def token_loop_kda(q, k, v, g, beta):
    """q, k: [T, H, K] (q already scaled), v: [T, H, V], g: [T, H, K] log decay, beta: [T, H] -> o [T, H, V].

    Written per head and per token with explicit vectors: S [K, V]; S <- S * exp(g)[:, None];
    S <- S + k (beta (v - k^T S))^T; o = q^T S (after the update)."""
    T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(T, H, V, dtype=q.dtype)
    for h in range(H):
        S = torch.zeros(K, V, dtype=q.dtype)
        for t in range(T):
            S = S * torch.exp(g[t, h])[:, None]
            pred = k[t, h] @ S  # [V]
            delta = beta[t, h] * (v[t, h] - pred)
            S = S + torch.outer(k[t, h], delta)
            o[t, h] = q[t, h] @ S
    return o


class Oracle:
    def __init__(self, ckpt_dir):
        cfg = json.loads((ckpt_dir / "config.json").read_text())
        self.top = cfg
        self.c = cfg["text_config"]
        la = self.c["linear_attn_config"]
        self.n_layers = self.c["num_hidden_layers"]
        kda1 = set(la["kda_layers"])
        mla1 = set(la["full_attn_layers"])
        assert kda1 | mla1 == set(range(1, self.n_layers + 1)) and not (kda1 & mla1)
        self.kinds = ["kda" if (i + 1) in kda1 else "mla" for i in range(self.n_layers)]
        self.kda_H, self.kda_K = la["num_heads"], la["head_dim"]
        self.lower_bound = la["gate_lower_bound"]
        self.conv_w = la["short_conv_kernel_size"]
        self.eps = self.c["rms_norm_eps"]
        self.lat_eps = self.c.get("mla_latent_norm_eps", 1e-6)
        self.b1 = self.c["activation_situ_beta"]
        self.b2 = self.c["activation_situ_linear_beta"]
        self.W = {}
        with safe_open(str(ckpt_dir / "model.safetensors"), "pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    t = f.get_tensor(name)
                    self.W[name[len(PREFIX):]] = t if t.dtype == torch.uint8 else t.to(DT)
        self.experts = {}
        for l in range(self.n_layers):
            if l < self.c["first_k_dense_replace"]:
                continue
            for e in range(self.c["num_experts"]):
                p = f"model.layers.{l}.block_sparse_moe.experts.{e}."
                self.experts[(l, e)] = tuple(
                    dequant_mxfp4(self.W[p + f"{w}.weight_packed"], self.W[p + f"{w}.weight_scale"])
                    for w in ("w1", "w3", "w2")
                )

    def w(self, name):
        return self.W[name]

    # -- blocks ------------------------------------------------------------------------------------------
    def short_conv_silu(self, x, weight):
        """Depthwise causal conv of width W, no bias: out[t, c] = sum_j w[c, 0, j] * x[t - (W-1) + j, c]."""
        T, D = x.shape
        W = weight.shape[-1]
        w = weight[:, 0, :]  # [D, W]
        out = torch.zeros_like(x)
        for t in range(T):
            for j in range(W):
                src = t - (W - 1) + j
                if src >= 0:
                    out[t] += w[:, j] * x[src]
        return torch.nn.functional.silu(out)

    def kda(self, l, x):
        p = f"model.layers.{l}.self_attn."
        H, K = self.kda_H, self.kda_K
        T = x.shape[0]
        q = self.short_conv_silu(x @ self.w(p + "q_proj.weight").T, self.w(p + "q_conv1d.weight")).view(T, H, K)
        k = self.short_conv_silu(x @ self.w(p + "k_proj.weight").T, self.w(p + "k_conv1d.weight")).view(T, H, K)
        v = self.short_conv_silu(x @ self.w(p + "v_proj.weight").T, self.w(p + "v_conv1d.weight")).view(T, H, -1)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q * K ** -0.5
        beta = torch.sigmoid(x @ self.w(p + "b_proj.weight").T)  # [T, H]
        z = ((x @ self.w(p + "f_a_proj.weight").T) @ self.w(p + "f_b_proj.weight").T).view(T, H, K)
        A = torch.exp(self.w(p + "A_log")[:H])  # padded [head_dim]; first H used
        g = self.lower_bound * torch.sigmoid(A[None, :, None] * (z + self.w(p + "dt_bias").view(H, K)))
        o = token_loop_kda(q, k, v, g, beta)
        o = rms(o, self.w(p + "o_norm.weight"), self.eps).reshape(T, -1)
        gate = torch.sigmoid(x @ self.w(p + "g_proj.weight").T)
        return (gate * o) @ self.w(p + "o_proj.weight").T

    def mla(self, l, x):
        p = f"model.layers.{l}.self_attn."
        c = self.c
        H, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        T = x.shape[0]
        qa = rms(x @ self.w(p + "q_a_proj.weight").T, self.w(p + "q_a_layernorm.weight"), self.lat_eps)
        q = (qa @ self.w(p + "q_b_proj.weight").T).view(T, H, nope + rope)
        kv_a = x @ self.w(p + "kv_a_proj_with_mqa.weight").T
        c_kv, k_pe = kv_a[:, : c["kv_lora_rank"]], kv_a[:, c["kv_lora_rank"]:]
        assert k_pe.shape[-1] == rope
        kv = (rms(c_kv, self.w(p + "kv_a_layernorm.weight"), self.lat_eps) @ self.w(p + "kv_b_proj.weight").T)
        kv = kv.view(T, H, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, rope)], dim=-1)  # no rotary (NoPE)
        scores = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v).reshape(T, H * vd)
        gate = torch.sigmoid(x @ self.w(p + "g_proj.weight").T)
        return (gate * attn) @ self.w(p + "o_proj.weight").T

    def glu_mlp(self, prefix, x):
        gt = x @ self.w(prefix + "gate_proj.weight").T
        up = x @ self.w(prefix + "up_proj.weight").T
        return situ_glu(gt, up, self.b1, self.b2) @ self.w(prefix + "down_proj.weight").T

    def moe(self, l, x):
        p = f"model.layers.{l}.block_sparse_moe."
        c = self.c
        s = torch.sigmoid(x @ self.w(p + "gate.weight").T)  # [T, E]
        biased = s + self.w(p + "gate.e_score_correction_bias")
        top = torch.topk(biased, c["num_experts_per_token"], dim=-1).indices
        z = x @ self.w(p + "routed_expert_down_proj.weight").T
        u = torch.zeros_like(z)
        for t in range(x.shape[0]):
            ws = s[t, top[t]]
            ws = ws / ws.sum() * c["routed_scaling_factor"]
            for e, pw in zip(top[t].tolist(), ws):
                w1, w3, w2 = self.experts[(l, e)]
                u[t] += pw * (situ_glu(w1 @ z[t], w3 @ z[t], self.b1, self.b2) @ w2.T)
        routed = rms(u, self.w(p + "routed_expert_norm.weight"), self.eps) @ self.w(p + "routed_expert_up_proj.weight").T
        return self.glu_mlp(p + "shared_experts.", x) + routed

    def attn_res(self, prefix, cands):
        V = torch.stack(cands)  # [n, T, d]
        keys = V * torch.rsqrt((V * V).mean(-1, keepdim=True) + 1e-5)
        wvec = self.w(prefix + "_norm.weight") * self.w(prefix + "_proj.weight")[0]
        alpha = torch.softmax((keys * wvec).sum(-1), dim=0)  # over candidates
        return (alpha[..., None] * V).sum(0)

    # -- full forward ------------------------------------------------------------------------------------
    def logits(self, ids) -> torch.Tensor:
        """ids: 1-D list/tensor of token ids (one unpadded sequence) -> [T, vocab] float64."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        P = self.w("model.embed_tokens.weight")[ids]
        blocks: list = []
        bs = self.c["attn_res_block_size"]
        for l in range(self.n_layers):
            lp = f"model.layers.{l}."
            h = self.attn_res(lp + "self_attention_res", blocks + [P]) if blocks else P
            if l % bs == 0:
                blocks.append(P)
                P = None
            x = rms(h, self.w(lp + "input_layernorm.weight"), self.eps)
            a = self.kda(l, x) if self.kinds[l] == "kda" else self.mla(l, x)
            P = a if P is None else P + a
            h = self.attn_res(lp + "mlp_res", blocks + [P])
            x = rms(h, self.w(lp + "post_attention_layernorm.weight"), self.eps)
            f = self.glu_mlp(lp + "mlp.", x) if l < self.c["first_k_dense_replace"] else self.moe(l, x)
            P = P + f
        h = self.attn_res("model.output_attn_res", blocks + [P])
        h = rms(h, self.w("model.norm.weight"), self.eps)
        return h @ self.w("lm_head.weight").T

    def greedy(self, prompt, n_new, eos=None):
        seq = list(prompt)
        out = []
        for _ in range(n_new):
            nxt = int(self.logits(seq)[-1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if eos is not None and nxt in eos:
                break
        return out


# ----------------------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers_k3.tiny import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("k3_oracle_ckpt")
    write_tiny_checkpoint(path, seed=0, dtype=torch.float32)
    stress_checkpoint(path)
    return path


def stress_checkpoint(path, seed: int = 0):
    """Rewrite the tiny checkpoint's tensors (same names, shapes, dtypes) so every spec detail shows in the logits.

    The default init leaves the KDA gate saturated (g ~ 0), all norm weights at 1, activations far inside the
    SwiGLU-like regime of SiTU-GLU and near-uniform MLA softmax, so e.g. a wrong gate formula or SiTU betas would
    go unnoticed. Here: random norm weights, an unsaturated gate (with garbage in A_log's padded tail, which must
    be ignored), larger projections so tanh(g/4) and tanh(u/25) bend, a router bias that changes the selection,
    and MXFP4 expert scales raised by 2**4 (scale bytes + 4)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())["text_config"]
    H = cfg["linear_attn_config"]["num_heads"]
    gen = torch.Generator().manual_seed(seed)
    W = load_file(str(path / "model.safetensors"))

    def rnd(t, std=1.0):
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) * std

    scale_by = {
        "conv1d.weight": 10.0, "f_a_proj.weight": 10.0, "f_b_proj.weight": 10.0, "b_proj.weight": 5.0,
        "g_proj.weight": 10.0, "q_b_proj.weight": 20.0, "kv_b_proj.weight": 10.0, "kv_a_proj_with_mqa.weight": 10.0,
        "gate_proj.weight": 20.0, "up_proj.weight": 40.0, "gate.weight": 50.0, "e_score_correction_bias": 10.0,
        "routed_expert_down_proj.weight": 5.0,
    }
    for name, t in W.items():
        if not name.startswith(PREFIX + "model.") and not name.startswith(PREFIX + "lm_head"):
            continue
        if name.endswith("norm.weight"):  # every RMSNorm weight, incl. o_norm, latent norms, AttnRes key norms
            W[name] = (1.0 + rnd(t, 0.3)).to(t.dtype)
        elif name.endswith("A_log"):
            a = torch.full_like(t, 30.0)  # padded tail: garbage that must not be read
            a[:H] = rnd(t[:H], 0.5)
            W[name] = a
        elif name.endswith("dt_bias"):
            W[name] = rnd(t, 0.5)
        elif name.endswith("weight_scale"):
            W[name] = (t.to(torch.int64) + 4).to(torch.uint8)
        elif "routed_expert_up_proj" in name:
            pass
        else:
            for suffix, f in scale_by.items():
                if name.endswith(suffix) and not name.endswith("routed_expert_up_proj.weight"):
                    W[name] = t * f
                    break
    save_file(W, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def oracle(ckpt):
    return Oracle(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    import transformers_k3  # noqa: F401  (registers the model)
    from transformers_k3 import KimiK3ForConditionalGeneration

    m = KimiK3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    m.eval()
    return m


def max_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------


def test_oracle_structure(oracle):
    """The tiny checkpoint exercises every structural feature the oracle claims to cover."""
    assert "kda" in oracle.kinds and "mla" in oracle.kinds and oracle.kinds[-1] == "mla"
    assert oracle.n_layers > oracle.c["attn_res_block_size"] * 2  # several AttnRes blocks
    assert oracle.W["model.layers.0.self_attn.A_log"].numel() > oracle.kda_H  # padded A_log
    assert any(k.endswith("weight_packed") for k in oracle.W)


def test_logits_match_oracle(model, oracle):
    vocab = oracle.c["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab - 4, (2, 19), generator=g)  # avoid the special ids at the top
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    assert got.shape == (2, 19, vocab)
    for b in range(2):
        ref = oracle.logits(ids[b])
        err = max_rel(got[b], ref)
        print(f"row {b}: max rel logits error {err:.3e}")
        assert err < 1e-4, f"row {b}: max|a-b|/max|b| = {err:.3e}"


def test_left_padded_greedy_generate_matches_oracle(model, oracle):
    vocab = oracle.c["vocab_size"]
    pad = oracle.top.get("pad_token_id", oracle.c["pad_token_id"])
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(0, vocab - 4, (n,), generator=g).tolist() for n in (7, 12)]
    L = max(len(p) for p in prompts)
    input_ids = torch.full((2, L), pad, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    n_new = 6
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False)
    assert torch.equal(out[:, :L], input_ids)
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or []))
    for b, p in enumerate(prompts):
        got = out[b, L:].tolist()
        ref = oracle.greedy(p, n_new, eos=eos)
        # After an EOS, generate pads the row; only compare up to (and including) the EOS.
        print(f"row {b}: package {got} oracle {ref}")
        assert got[: len(ref)] == ref, f"row {b} (prompt len {len(p)}): package {got} vs oracle {ref}"
        assert all(t == pad for t in got[len(ref):])


def test_oracle_kda_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.kda.naive")
    g_ = torch.Generator().manual_seed(7)
    T, H, K, V = 21, 3, 8, 6
    q = torch.randn(T, H, K, generator=g_, dtype=DT)
    k = torch.randn(T, H, K, generator=g_, dtype=DT)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(T, H, V, generator=g_, dtype=DT)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, K, generator=g_, dtype=DT))
    beta = torch.sigmoid(torch.randn(T, H, generator=g_, dtype=DT))
    scale = K ** -0.5
    ours = token_loop_kda(q * scale, k, v, g, beta)
    # fla casts to float32 internally; compare in fp32 terms
    ref, _ = naive.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale)
    err = max_rel(ours, ref[0])
    print(f"oracle KDA vs fla naive_recurrent_kda: max rel error {err:.3e}")
    assert err < 1e-5
    assert ref.abs().max() > 0.1  # non-trivial


def test_oracle_mxfp4_dequant_known_bytes():
    # byte 0x2B: low nibble 0xB -> -1.5 (even element), high nibble 0x2 -> 1.0 (odd element)
    packed = torch.tensor([[0x2B] + [0x70] * 15], dtype=torch.uint8)  # 0x70: low 0 -> 0, high 7 -> 6
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** 1
    w = dequant_mxfp4(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, 0] == -3.0 and w[0, 1] == 2.0 and w[0, 2] == 0.0 and w[0, 3] == 12.0
