"""MoonViT-V2 vision tower, projector and image merging in KimiK3ForConditionalGeneration (SPEC 6).

Tolerance rule: fp32 paths that should compute the same thing agree to rel_err (max-norm) <= 1e-5; the
placeholder scatter, text-only paths and the checkpoint round trip are exact.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers import rel_err
from transformers_k3 import KimiK3Config, KimiK3ForCausalLM, KimiK3ForConditionalGeneration
from transformers_k3 import modeling_kimi_k3 as mk
from transformers_k3.tiny import released_config_dict, tiny_config

TOL = 1e-5
TENSORS = Path("/work/shared/reference/kimi_k3_tensors.tsv")
GRIDS = [(1, 4, 6), (1, 2, 2), (1, 6, 4), (1, 10, 8)]  # different sizes, non-square, one merged token


def _images(grids, seed=0, patch=14):
    g = torch.Generator().manual_seed(seed)
    total = sum(t * h * w for t, h, w in grids)
    return torch.rand(total, 3 * patch * patch, generator=g) * 2 - 1, torch.tensor(grids)


def _oracle_tower(tower, pixel_values, grid):
    """One image, written independently: complex-number rotary, explicit softmax, loop-built 2x2 merge."""
    vc = tower.config
    _, h, w = grid
    p, D, H = vc.patch_size, vc.vt_head_dim, vc.vt_num_attention_heads
    x = pixel_values.view(-1, 3, p, p).double()
    x = torch.einsum("ncij,dcij->nd", x, tower.patch_embed.proj.weight.double())
    table = tower.patch_embed.pos_emb.weight.double()  # [H0, W0, d]
    pos = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    x = x + pos.permute(1, 2, 0).reshape(h * w, -1)
    # MoonViT rotary as complex numbers: pair 2j <- column, pair 2j+1 <- row, frequency theta^(-4j/D).
    j = torch.arange(D // 4, dtype=torch.float64)
    f = vc.vt_rope_theta ** (-4 * j / D)
    rr, cc = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    rr, cc = rr.reshape(-1, 1).double(), cc.reshape(-1, 1).double()
    phase = torch.stack([torch.polar(torch.ones_like(cc * f), cc * f), torch.polar(torch.ones_like(rr * f), rr * f)],
                        dim=-1).reshape(h * w, 1, D // 2)

    def rms(v, weight, eps):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def rope(v):  # v [N, H, D]
        return torch.view_as_real(torch.view_as_complex(v.reshape(*v.shape[:-1], D // 2, 2).contiguous()) * phase).flatten(-2)

    for blk in tower.encoder.blocks:
        y = rms(x, blk.norm0.weight, vc.vt_norm_eps)
        qkv = (y @ blk.wqkv.weight.double().T).view(h * w, 3, H, D)
        q, k, v = rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]
        att = torch.softmax(torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(D), dim=-1)
        x = x + torch.einsum("hnm,mhd->nhd", att, v).reshape(h * w, H * D) @ blk.wo.weight.double().T
        y = rms(x, blk.norm1.weight, vc.vt_norm_eps)
        x = x + F.gelu(y @ blk.mlp.fc0.weight.double().T, approximate="tanh") @ blk.mlp.fc1.weight.double().T
    x = rms(x, tower.encoder.final_layernorm.weight, vc.vt_norm_eps).view(h, w, -1)
    merged = [torch.cat([x[2 * a, 2 * b], x[2 * a, 2 * b + 1], x[2 * a + 1, 2 * b], x[2 * a + 1, 2 * b + 1]])
              for a in range(h // 2) for b in range(w // 2)]
    return torch.stack(merged)


def test_tower_matches_an_independent_oracle(tiny_model):
    tower = tiny_model.vision_tower
    assert tower.patch_embed.pos_emb.weight.shape == (64, 64, 32)
    assert tower.patch_embed.pos_emb.weight.abs().max() > 0  # a real table, else the position test is vacuous
    pv, grid = _images(GRIDS, seed=1)
    with torch.no_grad():
        out = tower(pv, grid)
        for (t, h, w), px, got in zip(GRIDS, pv.split([t * h * w for t, h, w in GRIDS]),
                                      out.split([h * w // 4 for _, h, w in GRIDS])):
            assert rel_err(got, _oracle_tower(tower, px, (t, h, w))) <= TOL


def test_batch_of_images_equals_each_image_alone(tiny_model):
    pv, grid = _images(GRIDS, seed=2)
    with torch.no_grad():
        batch = tiny_model.get_image_features(pv, grid)
        alone = [tiny_model.get_image_features(px, grid[i : i + 1])[0]
                 for i, px in enumerate(pv.split(grid.prod(-1).tolist()))]
    assert [f.shape for f in batch] == [(h * w // 4, 64) for _, h, w in GRIDS]
    for b, a in zip(batch, alone):
        assert rel_err(b, a) <= TOL


def test_eager_equals_sdpa(tiny_model, monkeypatch):
    calls = []
    original = mk.vision_eager_attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(mk, "vision_eager_attention_forward", counting)
    vc = tiny_model.config.vision_config
    assert vc._attn_implementation == "sdpa"  # the default; the release's flash_attention_2 is not forced
    pv, grid = _images(GRIDS, seed=3)
    try:
        with torch.no_grad():
            sdpa = tiny_model.vision_tower(pv, grid)
            assert not calls
            tiny_model.set_attn_implementation({"vision_config": "eager"})
            assert tiny_model.config.text_config._attn_implementation == "sdpa"  # the tower's choice is its own
            eager = tiny_model.vision_tower(pv, grid)
            lengths = {t * h * w for t, h, w in GRIDS}  # (4, 6) and (6, 4) share one batched call
            assert len(lengths) < len(GRIDS)
            assert len(calls) == len(lengths) * vc.vt_num_hidden_layers  # one call per image length per block
    finally:
        tiny_model.set_attn_implementation({"vision_config": "sdpa"})
    assert rel_err(eager, sdpa) <= TOL


def _prompt(grids, ph, seed=0):
    """Text, each image's placeholder repeated h*w/4 times, more text; returns ids [1, T]."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _, h, w in grids:
        ids += torch.randint(0, 400, (3,), generator=g).tolist() + [ph] * (h * w // 4)
    ids += torch.randint(0, 400, (2,), generator=g).tolist()
    return torch.tensor([ids])


def test_features_land_exactly_at_their_placeholders(tiny_model):
    ph = tiny_model.config.media_placeholder_token_id
    grids = [(1, 4, 6), (1, 2, 2), (1, 2, 4)]
    pv, grid = _images(grids, seed=4)
    ids = _prompt(grids, ph)
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    handle = tiny_model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            tiny_model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, use_cache=False)
            feats = tiny_model.get_image_features(pv, grid)
    finally:
        handle.remove()
    emb = seen["embeds"][0]
    at = (ids[0] == ph).nonzero().flatten()
    assert torch.equal(emb[at], torch.cat(feats))  # in image order, image i's features at its own run
    text = (ids[0] != ph).nonzero().flatten()
    assert torch.equal(emb[text], tiny_model.get_input_embeddings().weight[ids[0, text]])
    starts = [int(at[0])] + [int(at[i]) for i in range(1, len(at)) if at[i] != at[i - 1] + 1]
    assert [int(s) for s in starts] == [3, 3 + 6 + 3, 3 + 6 + 3 + 1 + 3]


def test_text_only_matches_the_causal_lm_and_prefix_before_an_image_is_unchanged(tiny_model):
    lm = KimiK3ForCausalLM(tiny_model.config.text_config).eval()
    lm.load_state_dict(tiny_model.language_model.state_dict())
    ids = torch.randint(0, 400, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(tiny_model(input_ids=ids, use_cache=False).logits, lm(input_ids=ids, use_cache=False).logits)
        ph = tiny_model.config.media_placeholder_token_id
        grids = [(1, 4, 4)]
        pv, grid = _images(grids, seed=6)
        mm = _prompt(grids, ph)
        with_image = tiny_model(input_ids=mm, pixel_values=pv, image_grid_thw=grid, use_cache=False).logits
        prefix = lm(input_ids=mm[:, :3], use_cache=False).logits
        after = lm(input_ids=torch.where(mm == ph, 0, mm), use_cache=False).logits
    assert rel_err(with_image[:, :3], prefix) <= TOL  # causal: the image cannot reach earlier tokens
    assert rel_err(with_image[:, 3:], after[:, 3:]) > 1e-3  # and it does change what follows


def test_bad_image_inputs_raise_naming_the_counts(tiny_model):
    ph = tiny_model.config.media_placeholder_token_id
    grids = [(1, 4, 6), (1, 2, 2)]
    pv, grid = _images(grids, seed=7)
    ids = _prompt(grids, ph)  # 6 + 1 placeholders
    short = ids[:, ids[0] != ph][:, :-1]
    short = torch.cat([short, torch.full((1, 6), ph)], dim=1)
    with pytest.raises(ValueError, match="holds 6 image placeholder tokens .* give 7 features"):
        tiny_model(input_ids=short, pixel_values=pv, image_grid_thw=grid, use_cache=False)
    with pytest.raises(ValueError, match="holds 8 image placeholder tokens"):
        tiny_model(input_ids=torch.cat([ids, torch.tensor([[ph]])], 1), pixel_values=pv, image_grid_thw=grid)
    with pytest.raises(ValueError, match="no pixel_values"):
        tiny_model(input_ids=ids, use_cache=False)
    with pytest.raises(ValueError, match="image_grid_thw"):
        tiny_model(input_ids=ids, pixel_values=pv)
    with pytest.raises(ValueError, match="t = 1"):
        tiny_model.vision_tower(pv, torch.tensor([[2, 2, 6], [1, 2, 2]]))
    with pytest.raises(ValueError, match="multiples of merge_kernel_size"):
        tiny_model.vision_tower(pv[:27], torch.tensor([[1, 3, 9]]))
    with pytest.raises(ValueError, match="describes"):
        tiny_model.vision_tower(pv[:-1], grid)
    with pytest.raises(ValueError, match="flattened patches"):
        tiny_model.vision_tower(pv.view(-1, 3, 14, 14), grid)


def test_generate_with_images_equals_a_cache_free_argmax_loop(tiny_model):
    ph = tiny_model.config.media_placeholder_token_id
    grids = [(1, 4, 6), (1, 2, 2)]
    pv, grid = _images(grids, seed=8)
    ids = _prompt(grids, ph, seed=8)
    n = 5
    with torch.no_grad():
        out = tiny_model.generate(input_ids=ids, pixel_values=pv, image_grid_thw=grid, max_new_tokens=n,
                                  do_sample=False, suppress_tokens=[ph], eos_token_id=None, pad_token_id=0)
        new = out[0, ids.shape[1]:]
        assert len(new) == n
        seq = ids
        for _ in range(n):
            logits = tiny_model(input_ids=seq, pixel_values=pv, image_grid_thw=grid, use_cache=False).logits[:, -1]
            logits[:, ph] = float("-inf")
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_prepare_inputs_drops_images_after_prefill(tiny_model):
    from transformers_k3 import KimiK3Cache

    ph = tiny_model.config.media_placeholder_token_id
    pv, grid = _images([(1, 2, 2)], seed=9)
    ids = torch.tensor([[1, ph, 2]])
    cache = KimiK3Cache(tiny_model.config.text_config)
    first = tiny_model.prepare_inputs_for_generation(ids, **{mk.CACHE_KWARG: cache}, pixel_values=pv,
                                                     image_grid_thw=grid, use_cache=True, is_first_iteration=True)
    assert first["pixel_values"] is pv
    with torch.no_grad():
        tiny_model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, **{mk.CACHE_KWARG: cache}, use_cache=True)
    later = tiny_model.prepare_inputs_for_generation(torch.tensor([[1, ph, 2, 3]]), **{mk.CACHE_KWARG: cache},
                                                     pixel_values=pv, image_grid_thw=grid, use_cache=True,
                                                     is_first_iteration=False, next_sequence_length=1)
    assert "pixel_values" not in later and "image_grid_thw" not in later


def _vision_rows(num_blocks):
    rows = {}
    for line in TENSORS.read_text().splitlines():
        if line.startswith("#") or line.startswith("name\t"):
            continue
        name, layers, shape, _ = line.split("\t")
        if not name.startswith(("vision_tower.", "mm_projector.")):
            continue
        dims = tuple(int(s) for s in shape.split(","))
        for b in range(num_blocks) if layers == "vit" else [None]:
            rows[name.replace("{B}", str(b)) if b is not None else name] = dims
    return rows


def test_tiny_checkpoint_vision_loads_with_no_missing_or_unexpected_keys_and_round_trips(tiny_dir, tmp_path):
    model, info = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    raw = load_file(tiny_dir / "model.safetensors")
    vision = {k for k in raw if k.startswith(("vision_tower.", "mm_projector."))}
    assert vision == set(_vision_rows(2))  # exactly the released names, nothing more
    model.save_pretrained(tmp_path)
    again = load_file(tmp_path / "model.safetensors")
    for k in vision:
        assert again[k].dtype == raw[k].dtype and torch.equal(again[k].view(torch.uint8), raw[k].view(torch.uint8)), k
    pv, grid = _images([(1, 2, 4)], seed=10)
    with torch.no_grad():
        reloaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
        assert torch.equal(model.get_image_features(pv, grid)[0], reloaded.get_image_features(pv, grid)[0])


def test_released_config_builds_on_meta_with_the_tensor_table_vision_shapes():
    config = KimiK3Config(**released_config_dict())
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(("vision_tower.", "mm_projector."))}
    table = _vision_rows(config.vision_config.vt_num_hidden_layers)
    assert ours == table
    assert sum(math.prod(s) for s in ours.values()) == sum(math.prod(s) for s in table.values())
    assert model.vision_tower.encoder.blocks[0].head_dim == 128


@pytest.mark.parametrize(
    "field, value",
    [("norm_type", "layernorm"), ("attn_bias", True), ("pos_emb_interpolation_mode", "nearest"),
     ("qkv_hidden_size", 30), ("merge_type", "sd2")],
)
def test_unsupported_vision_fields_raise_naming_the_field(field, value):
    from transformers_k3 import KimiK3ConfigError, KimiK3VisionConfig

    d = tiny_config().to_dict()["vision_config"]
    d[field] = value
    with pytest.raises(KimiK3ConfigError, match=f"vision_config.{field}"):
        KimiK3VisionConfig(**d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash_attention_2 varlen needs a CUDA GPU")
def test_flash_attention_varlen_matches_sdpa_on_gpu(tiny_dir):
    pytest.importorskip("flash_attn")
    model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.bfloat16).to("cuda").eval()
    vc = model.config.vision_config
    pv, grid = _images(GRIDS, seed=11)
    before = vc._attn_implementation
    try:
        with torch.no_grad():
            vc._attn_implementation = "sdpa"
            ref = model.vision_tower(pv.cuda(), grid)
            vc._attn_implementation = "flash_attention_2"
            got = model.vision_tower(pv.cuda(), grid)
    finally:
        vc._attn_implementation = before
    assert rel_err(got, ref) <= 2e-2  # bf16: a few ulps of the sdpa bf16 result


def test_auto_image_text_to_text_gives_the_container(tiny_dir):
    from transformers import AutoModelForImageTextToText

    assert isinstance(AutoModelForImageTextToText.from_pretrained(tiny_dir), KimiK3ForConditionalGeneration)


def test_gradients_reach_the_tower_and_checkpointing_changes_nothing(tiny_dir):
    ph = tiny_config().media_placeholder_token_id
    grids = [(1, 4, 6), (1, 2, 2)]
    pv, grid = _images(grids, seed=12)
    ids = _prompt(grids, ph, seed=12)
    grads = []
    for checkpointing in (False, True):
        model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir).train()
        if checkpointing:
            # 5.23 renamed it; older releases (down to 5.17) only have the old name.
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
            assert model.vision_tower.encoder.blocks[0].gradient_checkpointing
        out = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, labels=ids)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if n.startswith(("vision_tower.", "mm_projector.")) and p.grad is not None})
    assert set(grads[0]) == {n for n in _vision_rows(2)}  # every vision tensor is trained
    assert all(grads[0][n].abs().max() > 0 for n in grads[0])
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) <= TOL, n


def test_bf16_tower_takes_fp32_pixels_and_stays_near_fp32(tiny_dir, tiny_model):
    model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    pv, grid = _images(GRIDS[:2], seed=13)
    with torch.no_grad():
        got = torch.cat(model.get_image_features(pv, grid))
        ref = torch.cat(tiny_model.get_image_features(pv, grid))
    assert got.dtype == torch.bfloat16
    # bf16 weights and activations through 2 blocks and the projector: within 8 bf16 ulps (2**-8) of the output
    assert rel_err(got, ref) <= 8 * 2**-8


def test_processor_output_runs_through_the_model(tiny_dir):
    """The contract with KimiK3Processor: its pixel_values / image_grid_thw / expanded placeholders fit the model."""
    np = pytest.importorskip("numpy")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor
    from transformers_k3.processing_kimi_k3 import IMAGE_TOKEN

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["[BOS]", "<|end_of_msg|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", IMAGE_TOKEN,
                "<|kimi_image_placeholder|>", "[PAD]", "[UNK]"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["describe this image please"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="<|end_of_msg|>",
                                        pad_token="[PAD]", unk_token="[UNK]")
    processor = KimiK3Processor(KimiK3ImageProcessor(max_patches=64, max_patches_per_side=16), tokenizer)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(60, 90, 3), dtype=np.uint8),
              rng.integers(0, 256, size=(30, 30, 3), dtype=np.uint8)]
    batch = processor(images=images, text=f"describe {IMAGE_TOKEN} this {IMAGE_TOKEN} please")
    model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir).eval()
    model.config.media_placeholder_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                    image_grid_thw=batch["image_grid_thw"], use_cache=False)
    counts = (batch["image_grid_thw"].prod(-1) // 4).tolist()
    assert len(counts) == 2 and int((batch["input_ids"] == model.config.media_placeholder_token_id).sum()) == sum(counts)
    assert out.logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(out.logits).all()


def test_left_padded_batch_generate_with_images_equals_each_prompt_alone(tiny_model):
    ph, pad = tiny_model.config.media_placeholder_token_id, tiny_model.config.pad_token_id
    rows = [[(1, 4, 6)], [(1, 2, 2), (1, 2, 4)]]  # row 0's image first, then row 1's: the order of pixel_values
    prompts = [_prompt(g, ph, seed=20 + i)[0] for i, g in enumerate(rows)]
    images = [_images(g, seed=30 + i) for i, g in enumerate(rows)]
    T = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.full((T - len(p),), pad), p]) for p in prompts])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in prompts])[:, None]).long()
    kw = dict(max_new_tokens=4, do_sample=False, suppress_tokens=[ph], eos_token_id=None, pad_token_id=pad)
    with torch.no_grad():
        batch = tiny_model.generate(input_ids=ids, attention_mask=mask, pixel_values=torch.cat([pv for pv, _ in images]),
                                    image_grid_thw=torch.cat([g for _, g in images]), **kw)
        for i, (p, (pv, g)) in enumerate(zip(prompts, images)):
            alone = tiny_model.generate(input_ids=p[None], pixel_values=pv, image_grid_thw=g, **kw)
            assert torch.equal(batch[i, T:], alone[0, len(p):]), i


def test_inputs_embeds_find_placeholders_by_their_embedding(tiny_model):
    ph = tiny_model.config.media_placeholder_token_id
    grids = [(1, 2, 4), (1, 4, 2)]
    pv, grid = _images(grids, seed=40)
    ids = _prompt(grids, ph, seed=40)
    with torch.no_grad():
        by_ids = tiny_model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, use_cache=False).logits
        embeds = tiny_model.get_input_embeddings()(ids)
        by_embeds = tiny_model(inputs_embeds=embeds, pixel_values=pv, image_grid_thw=grid, use_cache=False).logits
    assert torch.equal(by_ids, by_embeds)
