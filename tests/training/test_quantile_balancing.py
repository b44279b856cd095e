"""Quantile Balancing (SPEC 5) and the sign step: estimator, accumulation, ranks, convergence, the K3 model."""

import copy
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformers_k3 import KimiK3Config, KimiK3ConfigError, KimiK3ForConditionalGeneration
from transformers_k3.balancing import (
    MoEBalancingCallback,
    RouterBalancer,
    exact_quantile,
    histogram_counts,
    histogram_quantile,
    quantile_from_histogram,
    update_moe_balancing,
)
from transformers_k3.modeling_kimi_k3 import KimiK3TopkRouter
from transformers_k3.tiny import released_config_dict, tiny_config


def skewed_values(N, E, seed):
    """Skewed, per-expert different data: exponentials with expert-dependent scale and offset. [N, E]"""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(E, generator=g) * 0.4 + 0.05
    off = torch.rand(E, generator=g) - 0.5
    return -torch.log(torch.rand(N, E, generator=g)) * scale + off


# ----------------------------------------------------------------------------------------------------------
# Estimator
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N,E,bins,q", [(1, 3, 16, 0.5), (17, 5, 7, 0.25), (1000, 12, 256, 4 / 32),
                                        (4099, 9, 64, 0.9), (333, 4, 256, 1.0)])
def test_histogram_quantile_within_one_bin(N, E, bins, q):
    v = skewed_values(N, E, seed=N)
    lo, hi = float(v.min()) - 0.3, float(v.max()) + 0.2
    est = histogram_quantile(v, q, lo, hi, bins)
    exact = exact_quantile(v, q)
    width = (hi - lo) / bins
    err = (est - exact).abs().max().item()
    assert est.dtype == torch.float32 and est.shape == (E,)
    assert err <= width * (1 + 1e-4), f"max error {err:.4g} > bin width {width:.4g}"


def test_exact_quantile_is_inverted_cdf():
    v = skewed_values(101, 6, seed=3)
    for q in (0.01, 0.125, 0.5, 0.99, 1.0):
        ref = np.quantile(v.numpy(), q, axis=0, method="inverted_cdf")
        assert torch.equal(exact_quantile(v, q), torch.from_numpy(np.asarray(ref, dtype=np.float32))), q


def test_out_of_range_values_clamp_into_end_bins():
    v = torch.tensor([[-5.0], [0.05], [0.95], [7.0]])  # [4, 1]
    counts = histogram_counts(v, 0.0, 1.0, 10)
    assert counts.tolist() == [[2, 0, 0, 0, 0, 0, 0, 0, 0, 2]]
    assert counts.dtype == torch.int64


@pytest.mark.parametrize("bad", [dict(bins=0), dict(lo=1.0, hi=1.0)])
def test_histogram_bad_arguments_raise(bad):
    args = dict(lo=0.0, hi=1.0, bins=4) | bad
    name = "bins" if "bins" in bad else "hi"
    with pytest.raises(ValueError, match=f"`{name}`"):
        histogram_counts(torch.zeros(3, 2), **args)


def test_counts_of_three_micro_batches_equal_one_batch():
    v = skewed_values(3001, 10, seed=7)
    lo, hi = float(v.min()) - 1, float(v.max()) + 1
    parts = v.split([1000, 1, 2000])
    summed = sum(histogram_counts(p, lo, hi, 256) for p in parts)
    whole = histogram_counts(v, lo, hi, 256)
    assert torch.equal(summed, whole)
    assert torch.equal(quantile_from_histogram(summed, 0.125, lo, hi), quantile_from_histogram(whole, 0.125, lo, hi))


def _twin_routers(method):
    """Two training-mode routers with the same random weights (16 experts, top-4)."""
    cfg = tiny_config(num_experts=16, num_experts_per_token=4, moe_balancing=method).text_config
    torch.manual_seed(0)
    a, b = KimiK3TopkRouter(cfg).train(), KimiK3TopkRouter(cfg).train()
    with torch.no_grad():
        a.weight.normal_()
        b.weight.copy_(a.weight)
    return a, b


def test_balancer_accumulates_micro_batches_exactly():
    """Through the router: three micro-batch forwards give the same bias as one forward of all tokens."""
    a, b = _twin_routers("quantile")
    x = torch.randn(300, a.config.hidden_size)
    for part in x.split([100, 37, 163]):
        a(part)
    b(x)
    assert torch.equal(a.moe_balancer().stats, b.moe_balancer().stats)
    update_moe_balancing(a), update_moe_balancing(b)
    assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)


# ----------------------------------------------------------------------------------------------------------
# Two ranks on gloo == one whole batch
# ----------------------------------------------------------------------------------------------------------


def _router_for_ranks(method):
    cfg = tiny_config(num_experts=16, num_experts_per_token=4, moe_balancing=method).text_config
    torch.manual_seed(1)
    r = KimiK3TopkRouter(cfg).train()
    with torch.no_grad():
        r.weight.normal_()
        r.e_score_correction_bias.normal_(0, 0.05)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(501, cfg.hidden_size, generator=g)  # odd count: the ranks hold unequal halves
    return r, x


def _rank_worker(rank, world, port, method, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        r, x = _router_for_ranks(method)
        r(x.tensor_split(world)[rank])
        update_moe_balancing(r)
        if rank == 0:
            # Plain floats: a tensor would travel by shared memory that dies with this process. fp32 -> float
            # -> fp32 is exact.
            queue.put(r.e_score_correction_bias.tolist())
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("method", ["quantile", "sign"])
def test_two_gloo_ranks_equal_whole_batch(method):
    r, x = _router_for_ranks(method)
    before = r.e_score_correction_bias.clone()
    r(x)
    update_moe_balancing(r)
    whole = r.e_score_correction_bias.clone()
    assert not torch.equal(whole, before)

    # fork, not spawn: a spawned child re-imports torch and transformers, which alone takes longer than the
    # whole test on a loaded CPU. Nothing here touches CUDA, so forking is safe.
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_worker, args=(rank, 2, port, method, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    sharded = torch.tensor(queue.get(), dtype=torch.float32)
    assert torch.equal(sharded, whole), (sharded - whole).abs().max()


# ----------------------------------------------------------------------------------------------------------
# Convergence on a skewed synthetic router
# ----------------------------------------------------------------------------------------------------------


def _simulate(method, steps, E=32, k=4, d=16, N=2048, seed=0):
    cfg = tiny_config(hidden_size=d, num_experts=E, num_experts_per_token=k, moe_balancing=method).text_config
    g = torch.Generator().manual_seed(seed)
    r = KimiK3TopkRouter(cfg).train()
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, d, generator=g) * 0.5)
        r.weight[:, -1] = torch.randn(E, generator=g) * 1.5  # per-expert logit skew on a constant feature
    ratios = []
    for _ in range(steps):
        x = torch.randn(N, d, generator=g)
        x[:, -1] = 1.0
        _, _, idx = r(x)
        load = torch.bincount(idx.reshape(-1), minlength=E).float()
        ratios.append((load.max() / load.mean()).item())
        update_moe_balancing(r)
    return ratios, r.e_score_correction_bias


def test_quantile_balances_faster_than_sign_step():
    T = 30
    q, q_bias = _simulate("quantile", T)
    s, _ = _simulate("sign", T)
    assert q[0] == s[0] and q[0] > 3, f"the router must start skewed: max/mean {q[0]:.3f}"
    q_tail, s_tail = sum(q[-10:]) / 10, sum(s[-10:]) / 10
    assert q_tail < 1.4 and q_tail < s_tail, (
        f"max/mean load over the last 10 of {T} steps: quantile {q_tail:.3f}, sign {s_tail:.3f} (start {q[0]:.3f})"
    )
    assert q_bias.dtype == torch.float32 and abs(q_bias.mean().item()) < 1e-6


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("moe_balancing", "aux_loss"), ("moe_balancing_bins", 0),
                                         ("moe_balancing_bins", 2.5), ("moe_bias_update_speed", -1e-3),
                                         ("moe_bias_update_speed", float("nan"))])
def test_bad_balancing_config_names_the_field(field, value):
    with pytest.raises(KimiK3ConfigError, match=f"`{field}`"):
        tiny_config(**{field: value})


def test_balancing_config_round_trip_and_released_default(tmp_path):
    released = KimiK3Config(**released_config_dict())  # same content as /work/shared/reference/kimi_k3_config.json
    assert released.text_config.moe_balancing == "none"
    assert (released.text_config.moe_balancing_bins, released.text_config.moe_bias_update_speed) == (256, 1e-3)
    cfg = tiny_config(moe_balancing="sign", moe_balancing_bins=64, moe_bias_update_speed=2e-3)
    cfg.save_pretrained(tmp_path)
    back = KimiK3Config.from_pretrained(tmp_path).text_config
    assert (back.moe_balancing, back.moe_balancing_bins, back.moe_bias_update_speed) == ("sign", 64, 2e-3)


# ----------------------------------------------------------------------------------------------------------
# The tiny K3 model
# ----------------------------------------------------------------------------------------------------------


def _routers(model):
    return [m for m in model.modules() if isinstance(m, KimiK3TopkRouter)]


def _batch(vocab=500, B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


@pytest.fixture()
def qb_lm(tiny_model):
    lm = copy.deepcopy(tiny_model.language_model)
    lm.config.moe_balancing = "quantile"
    return lm


def test_tiny_model_training_moves_bias(qb_lm):
    routers = _routers(qb_lm)
    assert routers
    before = [r.e_score_correction_bias.clone() for r in routers]
    opt = torch.optim.SGD(qb_lm.parameters(), lr=1e-2)
    qb_lm.train()
    callback = MoEBalancingCallback()
    for step in range(3):
        ids = _batch(seed=step)
        qb_lm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        callback.on_step_end(None, None, None, model=qb_lm)
        for r in routers:
            assert r.moe_balancer().stats is None  # consumed by the update
    for r, b0 in zip(routers, before):
        b = r.e_score_correction_bias
        assert b.dtype == torch.float32 and not b.requires_grad
        assert not torch.equal(b, b0)
        assert abs(b.mean().item()) < 1e-6
    names = [n for n, _ in qb_lm.named_buffers()]
    assert any(n.endswith("gate.e_score_correction_bias") for n in names)
    assert not any("e_score_correction_bias" in n for n, _ in qb_lm.named_parameters())


def test_bias_stays_fp32_in_a_bf16_model(qb_lm):
    lm = qb_lm.to(torch.bfloat16).train()
    ids = _batch(seed=11)
    lm(input_ids=ids, labels=ids).loss.backward()
    assert update_moe_balancing(lm) == len(_routers(lm))
    for r in _routers(lm):
        b = r.e_score_correction_bias
        assert b.dtype == torch.float32 and torch.isfinite(b).all() and abs(b.mean().item()) < 1e-6


def test_trainer_callback_counts_every_micro_batch_once(qb_lm, tmp_path):
    """Trainer with gradient accumulation and checkpointing: each update sees all micro-batches, once."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    routers = _routers(qb_lm)
    seen = []

    class Spy(TrainerCallback):  # runs before MoEBalancingCallback (callbacks run in order)
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(int(routers[0].moe_balancer().stats.sum()))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = _batch(B=1, T=24, seed=100 + i)[0]
            return {"input_ids": ids, "labels": ids.clone()}

    before = [r.e_score_correction_bias.clone() for r in routers]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, save_strategy="no", report_to=[], max_steps=2,
        learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        gradient_checkpointing=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    qb_lm.train()
    Trainer(model=qb_lm, args=args, train_dataset=Data(), callbacks=[Spy(), MoEBalancingCallback()]).train()
    tokens_per_step = 2 * 2 * 24  # micro-batches x batch x length
    assert seen == [tokens_per_step * qb_lm.config.num_experts] * 2
    assert all(not torch.equal(r.e_score_correction_bias, b) for r, b in zip(routers, before))
    assert all(r.moe_balancer().stats is None for r in routers)


def test_eval_and_none_routing_unchanged(tiny_model, qb_lm):
    ids = _batch(seed=5)
    ref_lm = tiny_model.language_model
    with torch.no_grad():
        ref = ref_lm(input_ids=ids).logits
        qb_lm.eval()
        assert torch.equal(qb_lm(input_ids=ids).logits, ref)
    assert all(r.moe_balancer().stats is None for r in _routers(qb_lm))  # eval forwards are not counted
    # Training mode mixes with the same top-k as "none" would.
    r_none = copy.deepcopy(_routers(ref_lm)[0]).train()
    r_qb = _routers(qb_lm)[0].train()
    x = torch.randn(40, r_none.weight.shape[1])
    for a, b in zip(r_none(x), r_qb(x)):
        assert torch.equal(a, b)


def test_gradient_checkpointing_counts_once(qb_lm):
    """The model's checkpointed layers (transformers' default, non-reentrant) re-run forward in backward."""
    ids = _batch(seed=9)
    qb_lm.train()
    stats = {}
    for gc in (False, True):
        model = copy.deepcopy(qb_lm)
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=ids, labels=ids).loss.backward()
        stats[gc] = [r.moe_balancer().stats.clone() for r in _routers(model)]
        assert all(s.sum() > 0 for s in stats[gc])
    for off, on in zip(stats[False], stats[True]):
        assert torch.equal(off, on), (off.sum().item(), on.sum().item())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_router_counts_once(reentrant):
    """Both torch checkpoint flavours: the first forward runs with grad on (non-reentrant) or off (reentrant),
    the recompute runs inside backward; either way each token is counted exactly once."""
    cfg = tiny_config(num_experts=16, num_experts_per_token=4, moe_balancing="quantile").text_config
    torch.manual_seed(4)
    plain = KimiK3TopkRouter(cfg).train()
    with torch.no_grad():
        plain.weight.normal_()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(64, cfg.hidden_size, requires_grad=True)
    _, w, _ = plain(x)
    w.sum().backward()
    _, w, _ = torch.utils.checkpoint.checkpoint(ckpt, x, use_reentrant=reentrant)
    assert ckpt.moe_balancer().stats.sum() == 64 * 16  # counted in the forward, before any backward
    w.sum().backward()
    assert ckpt.weight.grad is not None and torch.equal(ckpt.weight.grad, plain.weight.grad)
    assert torch.equal(ckpt.moe_balancer().stats, plain.moe_balancer().stats)


def test_sign_balancer_step_direction():
    bal = RouterBalancer("sign", num_experts=4, top_k=1, speed=0.5)
    bias = torch.zeros(4)
    top_idx = torch.tensor([[0], [0], [0], [1]])  # loads 3, 1, 0, 0; mean 1
    bal.observe(torch.zeros(4, 4), None, top_idx, bias)
    bal.step(bias)
    assert bias.tolist() == [-0.5, 0.0, 0.5, 0.5]


# ----------------------------------------------------------------------------------------------------------
# Padding is routed but not counted
# ----------------------------------------------------------------------------------------------------------


def test_histogram_counts_valid_rows_only():
    v = skewed_values(500, 6, seed=3)
    valid = torch.rand(500, generator=torch.Generator().manual_seed(4)) < 0.6
    lo, hi = float(v.min()) - 1, float(v.max()) + 1
    assert torch.equal(histogram_counts(v, lo, hi, 64, valid), histogram_counts(v[valid], lo, hi, 64))
    assert torch.equal(histogram_counts(v, lo, hi, 64, torch.ones(500, dtype=torch.bool)),
                       histogram_counts(v, lo, hi, 64))
    with pytest.raises(ValueError, match="valid"):
        histogram_counts(v, lo, hi, 64, valid[:10])


@pytest.mark.parametrize("method", ["quantile", "sign"])
def test_router_counts_only_valid_tokens(method):
    a, b = _twin_routers(method)
    x = torch.randn(50, a.config.hidden_size)
    valid = torch.arange(50) % 3 != 0
    out_a = a(x, valid)
    b(x[valid])
    assert torch.equal(a.moe_balancer().stats, b.moe_balancer().stats)
    for p, q in zip(out_a, a(x)):  # the mask changes what is counted, not the routing
        assert torch.equal(p, q)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_counts_real_tokens_only(qb_lm, side):
    """A padded training batch counts exactly its real tokens: each contributes E values to every quantile
    histogram, and the histograms are those of the two sequences run alone (to a bin or two: batched and
    single runs round differently)."""
    qb_lm.train()
    long, short = _batch(B=1, T=12, seed=21), _batch(B=1, T=7, seed=22)
    pad = torch.zeros(1, 5, dtype=torch.long)
    ones, zeros = torch.ones(1, 7, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)
    if side == "right":
        ids, mask_short = torch.cat([short, pad], 1), torch.cat([ones, zeros], 1)
    else:
        ids, mask_short = torch.cat([pad, short], 1), torch.cat([zeros, ones], 1)
    batch = torch.cat([long, ids])
    mask = torch.cat([torch.ones(1, 12, dtype=torch.long), mask_short])
    E = qb_lm.config.num_experts
    padded = copy.deepcopy(qb_lm)
    padded(input_ids=batch, attention_mask=mask)
    alone = copy.deepcopy(qb_lm)
    alone(input_ids=long)
    alone(input_ids=short)
    for rp, ra in zip(_routers(padded), _routers(alone)):
        sp, sa = rp.moe_balancer().stats, ra.moe_balancer().stats
        assert int(sp.sum()) == (12 + 7) * E  # 24 rows routed, 19 counted
        assert int((sp - sa).abs().sum()) <= 4
