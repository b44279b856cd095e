"""Training-path tests: Trainer, gradient accumulation, padding-free packing, PEFT LoRA on every layer kind."""

import copy

import pytest
import torch

import transformers_k3  # noqa: F401  (registers the Auto classes)
from transformers_k3 import KimiK3ForConditionalGeneration
from transformers_k3.tiny import write_tiny_checkpoint


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_k3_train")
    write_tiny_checkpoint(path, seed=0, dtype=torch.float32)
    return path


def load_lm(path):
    return KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).language_model


@pytest.fixture(scope="module")
def base_lm(ckpt):
    return load_lm(ckpt).eval()


@pytest.fixture()
def lm(base_lm):
    return copy.deepcopy(base_lm)


# ----------------------------------------------------------------------------------------------------------
# 1. Trainer
# ----------------------------------------------------------------------------------------------------------


class MotifDataset(torch.utils.data.Dataset):
    """Sequences of length 24 made of a repeated 4-token motif (a few motifs, random phase)."""

    def __init__(self, n=64, length=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        motifs = torch.randint(0, 500, (4, 4), generator=g)
        self.items = []
        for i in range(n):
            m = motifs[i % len(motifs)]
            shift = int(torch.randint(0, 4, (1,), generator=g))
            ids = m.roll(shift).repeat(length // 4 + 1)[:length].clone()
            self.items.append(ids)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids = self.items[i]
        return {"input_ids": ids, "labels": ids.clone()}


def test_trainer_lowers_loss(lm, tmp_path):
    from transformers import Trainer, TrainingArguments

    ds = MotifDataset()
    batch = torch.stack([ds[i]["input_ids"] for i in range(8)])
    lm.eval()
    with torch.no_grad():
        before = lm(input_ids=batch, labels=batch).loss.item()
    lm.train()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, save_strategy="no", report_to=[], max_steps=12,
        learning_rate=3e-3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        gradient_checkpointing=True, logging_steps=1, warmup_steps=0, lr_scheduler_type="constant",
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=lm, args=args, train_dataset=ds)
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 2
    assert all(torch.isfinite(torch.tensor(losses)))
    assert lm.is_gradient_checkpointing
    lm.eval()
    with torch.no_grad():
        after = lm(input_ids=batch, labels=batch).loss.item()
    assert result.global_step == 12
    assert losses[-1] < losses[0], losses
    assert after < 0.8 * before, (before, after)


# ----------------------------------------------------------------------------------------------------------
# 2. Gradient accumulation with num_items_in_batch
# ----------------------------------------------------------------------------------------------------------


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_accumulation_num_items_in_batch(lm):
    lm.train()  # no dropout in the model; train() only matters for the loss path
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (4, 16), generator=g)
    labels = ids.clone()
    labels[0, :10] = -100  # micro-batch 1 has far fewer valid tokens than micro-batch 2
    labels[1, 3:7] = -100
    labels[3, -2:] = -100
    n_items = int((labels[:, 1:] != -100).sum())
    n1 = int((labels[:2, 1:] != -100).sum())
    assert n1 != n_items - n1

    lm.zero_grad()
    lm(input_ids=ids, labels=labels).loss.backward()
    big = _grads(lm)

    lm.zero_grad()
    total = 0.0
    for sl in (slice(0, 2), slice(2, 4)):
        loss = lm(input_ids=ids[sl], labels=labels[sl], num_items_in_batch=torch.tensor(n_items)).loss
        loss.backward()
        total += loss.item()
    acc = _grads(lm)

    with torch.no_grad():
        ref = lm(input_ids=ids, labels=labels).loss.item()
    assert abs(total - ref) <= 1e-5 * abs(ref)
    assert set(big) == set(acc) and len(big) > 0
    # every trainable tensor gets a gradient, including the 3-D experts and the router
    assert any(n.endswith("experts.gate_up_proj") for n in big)
    assert any(n.endswith("gate.weight") for n in big)
    # fp32 gradients through the chunked KDA solve at other batch sizes: rounding well under 1e-4 of max |grad|
    for n in big:
        assert rel_err(acc[n], big[n]) <= 1e-4, (n, rel_err(acc[n], big[n]))


# ----------------------------------------------------------------------------------------------------------
# 3. Padding-free packed batches
# ----------------------------------------------------------------------------------------------------------


def test_packed_batch_loss_matches_separate(lm):
    from transformers import DataCollatorWithFlattening

    lm.eval()
    g = torch.Generator().manual_seed(2)
    lengths = [7, 12, 5]
    seqs = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]
    features = [{"input_ids": s, "labels": list(s)} for s in seqs]
    batch = DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")(features)
    assert "attention_mask" not in batch or batch["attention_mask"] is None
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert batch["position_ids"][0].tolist() == sum((list(range(n)) for n in lengths), [])

    with torch.no_grad():
        packed = lm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                    use_cache=False)
        separate = [lm(input_ids=torch.tensor([s]), labels=torch.tensor([s]), use_cache=False) for s in seqs]
    weights = torch.tensor([n - 1 for n in lengths], dtype=torch.float64)
    expected = sum(w * o.loss.double() for w, o in zip(weights, separate)) / weights.sum()
    assert abs(packed.loss.double() - expected).item() <= 1e-5 * expected.item()
    # and the logits of each segment match the unpacked forward
    start = 0
    for n, o in zip(lengths, separate):
        assert rel_err(packed.logits[0, start:start + n], o.logits[0]) <= 1e-5
        start += n


def test_packed_batch_default_use_cache_in_train_mode(lm):
    from transformers import DataCollatorWithFlattening

    lm.train()
    feats = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11], "labels": [9, 10, 11]}]
    batch = DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")(feats)
    out = lm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    assert torch.isfinite(out.loss)


# ----------------------------------------------------------------------------------------------------------
# 4. PEFT LoRA on every layer kind
# ----------------------------------------------------------------------------------------------------------

KDA_TARGETS = ["q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"]
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj", "routed_expert_down_proj", "routed_expert_up_proj"]


def _lora_config(**kw):
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
        target_modules=KDA_TARGETS + MLA_TARGETS + MLP_TARGETS,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"], **kw,
    )


def _has_lora(model, prefix):
    """True if a LoRA A matrix lives under `prefix` (module or parametrization wrapper)."""
    return any(prefix + "." in n and "lora_A" in n for n, _ in model.named_parameters()) or any(
        n.startswith(prefix) and "lora_A" in n for n, _ in model.named_modules()
    )


def test_peft_lora_all_layer_kinds(ckpt, base_lm, tmp_path):
    from peft import PeftModel, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(load_lm(ckpt).eval(), _lora_config()).eval()
    layers = "base_model.model.model.layers"
    cfg = base_lm.config
    kda = cfg.layer_types.index(next(t for t in cfg.layer_types if t != cfg.layer_types[3]))
    assert type(base_lm.model.layers[kda].self_attn).__name__ == "KimiK3DeltaAttention"
    assert type(base_lm.model.layers[3].self_attn).__name__ == "KimiK3Attention"
    must = [
        f"{layers}.{kda}.self_attn.q_proj",
        f"{layers}.{kda}.self_attn.f_b_proj",
        f"{layers}.1.self_attn.b_proj",
        f"{layers}.3.self_attn.kv_b_proj",
        f"{layers}.7.self_attn.q_a_proj",
        f"{layers}.0.mlp.down_proj",
        f"{layers}.2.block_sparse_moe.shared_experts.up_proj",
        f"{layers}.2.block_sparse_moe.routed_expert_up_proj",
        f"{layers}.2.block_sparse_moe.routed_expert_down_proj",
        f"{layers}.2.block_sparse_moe.experts",
    ]
    missing = [p for p in must if not _has_lora(model, p)]
    assert not missing, missing
    names = [n for n, _ in model.named_parameters() if "lora_A" in n]
    # both 3-D expert parameters got their own adapter, in every MoE layer
    for i in range(1, cfg.num_hidden_layers):
        exp = [n for n in names if f"layers.{i}.block_sparse_moe.experts" in n]
        assert len(exp) >= 2, (i, exp)
    # router and depthwise convs stay untouched
    for n, _ in model.named_modules():
        assert not (n.endswith("block_sparse_moe.gate") and hasattr(_, "lora_A")), n
    assert not any(".gate.lora" in n or "gate.base_layer" in n for n in names)
    assert not any("conv1d" in n for n in names)
    assert not any("block_sparse_moe.gate." in n and "lora" in n for n, _ in model.named_parameters())
    # only adapters are trainable
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = base_lm(input_ids=ids, use_cache=False).logits
        lora_logits = model(input_ids=ids, use_cache=False).logits
    assert rel_err(lora_logits, base_logits) > 1e-3

    # adapters get gradients through every kind (incl. the 3-D experts)
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for prefix in must:
        grads = [p.grad for n, p in model.named_parameters() if n.startswith(prefix) and "lora_" in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), prefix
    model.zero_grad()
    model.eval()

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_lm(ckpt).eval(), tmp_path / "adapter").eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=ids, use_cache=False).logits
    assert rel_err(reloaded_logits, lora_logits) <= 1e-6

    merged = model.merge_and_unload().eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        merged_logits = merged(input_ids=ids, use_cache=False).logits
    # Merging changes only the order of fp32 roundings (W + BA vs W x + B A x), through every layer: 1e-4.
    assert rel_err(merged_logits, lora_logits) <= 1e-4


def test_peft_lora_kv_b_proj_used_with_cache(ckpt):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(load_lm(ckpt).eval(), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["kv_b_proj"])).eval()
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        no_cache = model(input_ids=ids, use_cache=False).logits
        with_cache = model(input_ids=ids, use_cache=True).logits
    assert rel_err(with_cache, no_cache) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# 5. Targeting the depthwise short convs
# ----------------------------------------------------------------------------------------------------------


def test_peft_lora_on_short_convs_raises(ckpt):
    """peft refuses a rank-4 LoRA on the depthwise (groups=64) short convs with a ValueError naming the groups."""
    from peft import LoraConfig, get_peft_model

    with pytest.raises(ValueError, match="groups"):
        get_peft_model(load_lm(ckpt), LoraConfig(r=4, target_modules=["q_conv1d"], init_lora_weights=False))


def test_peft_lora_on_short_convs_rank_divisible_by_groups_raises(ckpt):
    """With r a multiple of groups (64) peft accepts the conv; the model refuses to run it rather than bypass it."""
    from peft import LoraConfig, get_peft_model

    with pytest.raises(TypeError, match="short convs"):
        model = get_peft_model(load_lm(ckpt), LoraConfig(r=64, target_modules=["q_conv1d"], init_lora_weights=False))
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)


# ----------------------------------------------------------------------------------------------------------
# 6. Data-parallel Trainer (DDP over two gloo ranks on the CPU, launched by torchrun)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["released", "language_model"])
def test_trainer_ddp_two_ranks(ckpt, which, tmp_path):
    """`torchrun --nproc_per_node 2` of a Trainer script with gradient checkpointing (so Trainer builds DDP with
    find_unused_parameters=False, which fails on any trainable parameter the loss does not reach): every trainable
    parameter gets a gradient (layer 0's single-candidate AttnRes mix included), `labels` reach the released
    container's forward, and both ranks end with the same weights."""
    import json
    import os
    import subprocess
    import sys

    from helpers import free_port

    port = free_port()
    script = os.path.join(os.path.dirname(__file__), "ddp_trainer_script.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), script,
         str(ckpt), which, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sums = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(sums[0]) > 0 and sums[0] == sums[1]
