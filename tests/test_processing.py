"""KimiK3ImageProcessor / KimiK3Processor: resize arithmetic, patch layout, placeholders, save/load."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoImageProcessor, AutoProcessor, PreTrainedTokenizerFast

from helpers import rel_err

import transformers_k3  # noqa: F401  (registers the Auto classes)
from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor
from transformers_k3.image_processing_kimi_k3 import fit_to_patch_budget, unpatchify
from transformers_k3.processing_kimi_k3 import DEFAULT_CHAT_TEMPLATE, IMAGE_MARKER, IMAGE_TOKEN

K3_SPECIALS = [
    "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|media_begin|>",
    "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<|kimi_image_placeholder|>", "[PAD]", "[UNK]",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE trained offline, with the K3 special tokens as single tokens."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=K3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, describe this image please", "user assistant system"] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="<|end_of_msg|>", pad_token="[PAD]", unk_token="[UNK]"
    )


@pytest.fixture
def processor(tokenizer):
    return KimiK3Processor(KimiK3ImageProcessor(max_patches=64, max_patches_per_side=16), tokenizer)


def _rand_image(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


# ---- resize / pad arithmetic ----

SIZES = [(1000, 1000), (3000, 400), (400, 3000), (17, 5), (5, 2000), (28, 28), (1, 1), (4000, 4000), (333, 777)]
LIMITS = [(4096, 512), (64, 8), (16, 4), (4, 2), (100, 64), (1000, 20)]


@pytest.mark.parametrize("limits", LIMITS, ids=lambda x: f"budget{x[0]}-side{x[1]}")
@pytest.mark.parametrize("size", SIZES, ids=lambda x: f"{x[0]}x{x[1]}")
def test_fit_to_patch_budget(size, limits):
    h, w = size
    max_patches, per_side = limits
    (nh, nw), (ph, pw) = fit_to_patch_budget(h, w, 14, 2, max_patches, per_side)
    assert ph % 28 == 0 and pw % 28 == 0
    assert 0 <= ph - nh < 28 and 0 <= pw - nw < 28, "pad, never crop, and pad less than one merge block"
    assert (ph // 14) * (pw // 14) <= max_patches
    assert ph // 14 <= per_side and pw // 14 <= per_side
    assert 1 <= nh <= h and 1 <= nw <= w, "never upscale"
    # Aspect kept: some common scale s has nh = floor(h*s), nw = floor(w*s) (a side clamped to 1 px is exempt).
    lo = max(nh / h if nh > 1 else 0.0, nw / w if nw > 1 else 0.0)
    hi = min((nh + 1) / h, (nw + 1) / w)
    assert lo < hi


def test_fit_to_patch_budget_known_values():
    # Fits already: untouched, padded up to 28.
    assert fit_to_patch_budget(60, 90, 14, 2, 4096, 512) == ((60, 90), (84, 112))
    # Square over budget: exactly 64 x 64 patches.
    assert fit_to_patch_budget(1000, 1000, 14, 2, 4096, 512) == ((896, 896), (896, 896))
    # Per-side limit binds for a long thin image (budget would allow more).
    (nh, nw), (ph, pw) = fit_to_patch_budget(100, 10000, 14, 2, 4096, 64)
    assert pw == 64 * 14 and nw == 896 and nh == 8 and ph == 28
    # The padded size, not the resized one, is held to the budget: 41 x 41 patches fit 1681 but pad to 42 x 42.
    (nh, nw), (ph, pw) = fit_to_patch_budget(574, 574, 14, 2, 1681, 512)
    assert (ph // 14) * (pw // 14) <= 1681 and ph == pw == 560


@pytest.mark.parametrize("bad", [dict(max_patches=3), dict(max_patches_per_side=1)])
def test_bad_limits_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        KimiK3ImageProcessor(**bad)


# ---- normalisation and patch layout ----

def _reference_patches(norm, p=14):
    """Independent slicing reference: patch k is rows (k // gw), cols (k % gw) of the normalised image."""
    _, H, W = norm.shape
    gh, gw = H // p, W // p
    rows = []
    for k in range(gh * gw):
        r, c = divmod(k, gw)
        rows.append(norm[:, r * p : (r + 1) * p, c * p : (c + 1) * p].reshape(-1))
    return torch.stack(rows)


def test_patch_layout_exact_no_resize():
    img = _rand_image(56, 84, seed=1)  # multiples of 28 and inside the budget: no resize, no pad
    out = KimiK3ImageProcessor()(img)
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert out["pixel_values"].shape == (24, 588) and out["pixel_values"].dtype == torch.float32
    norm = (torch.from_numpy(img).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5  # [3, H, W]
    assert torch.equal(out["pixel_values"], _reference_patches(norm))
    (rec,) = unpatchify(out["pixel_values"], out["image_grid_thw"])
    assert torch.equal(rec, norm)


def test_padding_region_and_range():
    img = _rand_image(30, 50, seed=2)
    out = KimiK3ImageProcessor()(img)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]  # 30x50 -> 56x56
    (rec,) = unpatchify(out["pixel_values"], out["image_grid_thw"])
    norm = (torch.from_numpy(img).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5
    assert torch.equal(rec[:, :30, :50], norm)
    assert torch.all(rec[:, 30:, :] == -1.0) and torch.all(rec[:, :, 50:] == -1.0)
    white = KimiK3ImageProcessor()(np.full((28, 28, 3), 255, np.uint8))["pixel_values"]
    black = KimiK3ImageProcessor()(np.zeros((28, 28, 3), np.uint8))["pixel_values"]
    assert torch.all(white == 1.0) and torch.all(black == -1.0)


def test_resized_values_in_range_and_budget():
    ip = KimiK3ImageProcessor(max_patches=100, max_patches_per_side=12)
    out = ip([_rand_image(500, 300, seed=3), _rand_image(90, 1200, seed=4)])
    pv, grid = out["pixel_values"], out["image_grid_thw"]
    assert pv.min() >= -1.0 and pv.max() <= 1.0
    assert torch.all(grid[:, 0] == 1) and torch.all(grid[:, 1:] % 2 == 0)
    assert torch.all(grid[:, 1] * grid[:, 2] <= 100) and torch.all(grid[:, 1:] <= 12)
    assert pv.shape[0] == int(grid.prod(-1).sum())


def test_images_concatenated_in_order():
    a, b = _rand_image(28, 56, seed=5), _rand_image(84, 28, seed=6)
    ip = KimiK3ImageProcessor()
    both = ip([a, b])
    sa, sb = ip(a), ip(b)
    assert both["image_grid_thw"].tolist() == [[1, 2, 4], [1, 6, 2]]
    assert torch.equal(both["pixel_values"], torch.cat([sa["pixel_values"], sb["pixel_values"]]))


def test_input_formats_agree():
    img = _rand_image(70, 45, seed=7)
    ip = KimiK3ImageProcessor(max_patches=16)  # forces a resize
    ref = ip(img)["pixel_values"]
    chw = torch.from_numpy(img).permute(2, 0, 1)
    for other in (Image.fromarray(img), chw, chw.float() / 255.0):
        assert torch.allclose(ip(other)["pixel_values"], ref, atol=1e-5, rtol=0)
    gray = _rand_image(28, 28, seed=8)[:, :, 0]
    g = ip(gray)["pixel_values"].view(-1, 3, 14, 14)
    assert torch.equal(g[:, 0], g[:, 1]) and torch.equal(g[:, 0], g[:, 2])


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (torch.rand(3, 20, 20) * 2, ValueError, "images\\[0\\].*\\[0, 1\\]"),
        (np.zeros((20, 20, 4), np.uint8), ValueError, "images\\[0\\].*HWC"),
        (torch.zeros(5, 20, 20), ValueError, "images\\[0\\].*CHW"),
        ("not-a-file-or-url", ValueError, "images\\[0\\].*could not load"),
        (3.0, TypeError, "images\\[0\\]"),
    ],
    ids=["float-range", "rgba-numpy", "channels", "bad-path", "scalar"],
)
def test_bad_images_raise(bad, err, match):
    with pytest.raises(err, match=match):
        KimiK3ImageProcessor()(bad)


def test_video_raises(processor):
    ip = KimiK3ImageProcessor()
    with pytest.raises(NotImplementedError, match="video is not supported"):
        ip(images=None, videos=[np.zeros((4, 28, 28, 3), np.uint8)])
    with pytest.raises(NotImplementedError, match="video is not supported"):
        ip(np.zeros((2, 4, 3, 28, 28), np.uint8))
    with pytest.raises(NotImplementedError, match="video is not supported"):
        processor(text="hi", videos=[np.zeros((4, 28, 28, 3), np.uint8)])


# ---- processor ----

def _count(ids, token_id):
    return int((ids == token_id).sum())


def test_placeholder_expansion(processor, tokenizer):
    imgs = [_rand_image(60, 90, seed=9), _rand_image(200, 50, seed=10)]
    out = processor(images=imgs, text=f"a {IMAGE_TOKEN} b {IMAGE_TOKEN} c")
    grid = out["image_grid_thw"]
    expected = int((grid[:, 1] * grid[:, 2]).sum()) // 4
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert _count(out["input_ids"], pad_id) == expected
    assert out["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    # Each image's pads are contiguous and in image order.
    ids = out["input_ids"][0].tolist()
    runs, prev = [], None
    for i, t in enumerate(ids):
        if t == pad_id and prev != pad_id:
            runs.append(1)
        elif t == pad_id:
            runs[-1] += 1
        prev = t
    assert runs == [int(g[1] * g[2]) // 4 for g in grid]


def test_marker_expands_to_media_block(processor, tokenizer):
    img = _rand_image(56, 56, seed=11)
    out = processor(images=[img], text=f"look {IMAGE_MARKER} here")
    ids = out["input_ids"][0].tolist()
    begin, content, end, pad = tokenizer.convert_tokens_to_ids(
        ["<|media_begin|>", "<|media_content|>", "<|media_end|>", IMAGE_TOKEN]
    )
    i = ids.index(begin)
    assert ids[i + 1] == content and ids[i + 2 : i + 2 + 4] == [pad] * 4 and ids[i + 6] == end
    assert tokenizer.convert_tokens_to_ids(IMAGE_MARKER) not in ids


def test_batched_text_nested_images(processor, tokenizer):
    imgs = [[_rand_image(28, 28, seed=12)], [_rand_image(56, 28, seed=13), _rand_image(28, 84, seed=14)]]
    out = processor(images=imgs, text=[f"x {IMAGE_TOKEN}", f"{IMAGE_TOKEN} y {IMAGE_TOKEN}"], padding=True)
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 2], [1, 2, 6]]
    assert [_count(row, pad_id) for row in out["input_ids"]] == [1, 2 + 3]


@pytest.mark.parametrize(
    "text, n_images",
    [(f"{IMAGE_TOKEN} {IMAGE_TOKEN}", 1), (f"{IMAGE_TOKEN}", 2), ("no image here", 1), (f"{IMAGE_MARKER}", 0)],
    ids=["more-placeholders", "more-images", "no-placeholder", "no-images"],
)
def test_mismatch_raises(processor, text, n_images):
    imgs = [_rand_image(28, 28, seed=i) for i in range(n_images)] or None
    with pytest.raises(ValueError, match="placeholders"):
        processor(images=imgs, text=text)


def test_nested_mismatch_raises(processor):
    imgs = [[_rand_image(28, 28)], []]
    with pytest.raises(ValueError, match=r"text\[1\] has 1 image placeholders"):
        processor(images=imgs, text=[f"{IMAGE_TOKEN}", f"{IMAGE_TOKEN}"])


def test_tokenizer_without_k3_tokens_raises():
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["plain"], trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]"]))
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(ValueError, match="media_pad"):
        KimiK3Processor(KimiK3ImageProcessor(), plain)


def test_image_kwargs_per_call(processor):
    img = _rand_image(500, 500, seed=15)
    small = processor(images=[img], text=IMAGE_TOKEN, max_patches=16)
    assert int(small["image_grid_thw"][0, 1:].prod()) <= 16
    assert processor.image_processor.max_patches == 64


def test_save_load_round_trip(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiK3Processor)
    assert isinstance(loaded.image_processor, KimiK3ImageProcessor)
    assert loaded.image_processor.max_patches == 64 and loaded.image_processor.max_patches_per_side == 16
    assert loaded.chat_template == DEFAULT_CHAT_TEMPLATE
    img = _rand_image(123, 77, seed=16)
    a = processor(images=[img], text=f"q {IMAGE_TOKEN}")
    b = loaded(images=[img], text=f"q {IMAGE_TOKEN}")
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        assert torch.equal(a[key], b[key]), key

    from transformers.utils.import_utils import DummyObject

    if isinstance(AutoImageProcessor, DummyObject):
        pytest.skip("this transformers has no AutoImageProcessor without torchvision (5.17); AutoProcessor works")
    ip = AutoImageProcessor.from_pretrained(tmp_path)
    assert isinstance(ip, KimiK3ImageProcessor) and ip.max_patches == 64
    ip_dir = tmp_path / "ip_only"
    processor.image_processor.save_pretrained(ip_dir)
    assert AutoImageProcessor.from_pretrained(ip_dir).to_dict() == processor.image_processor.to_dict()


def test_apply_chat_template_with_image(processor, tokenizer):
    img = _rand_image(100, 60, seed=17)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "describe"}]},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<|open|>user<|sep|><|media_begin|><|media_content|><|media_pad|><|media_end|>describe<|end_of_msg|>"
        "<|open|>assistant<|sep|>"
    )
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    grid = out["image_grid_thw"]
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert grid.shape == (1, 3)
    assert _count(out["input_ids"], pad_id) == int(grid[0, 1] * grid[0, 2]) // 4
    direct = processor(images=[img], text=text)
    assert torch.equal(direct["input_ids"], out["input_ids"])
    assert torch.equal(direct["pixel_values"], out["pixel_values"])


def test_number_of_patches_helper_matches():
    ip = KimiK3ImageProcessor(max_patches=200, max_patches_per_side=20)
    for h, w in [(300, 300), (50, 999), (13, 13)]:
        grid = ip(_rand_image(h, w))["image_grid_thw"][0]
        assert ip.get_number_of_image_patches(h, w) == int(grid.prod())
    assert math.isclose(KimiK3ImageProcessor().image_mean[0], 0.5)


def test_from_vision_config_and_token_counts(processor):
    from transformers_k3 import KimiK3VisionConfig

    ip = KimiK3ImageProcessor.from_vision_config(KimiK3VisionConfig(), max_patches=256)
    assert (ip.patch_size, ip.merge_size, ip.max_patches) == (14, 2, 256)
    sizes = [(60, 90), (500, 120)]
    counts = processor._get_num_multimodal_tokens(image_sizes=sizes)
    for (h, w), n_tokens in zip(sizes, counts.num_image_tokens):
        out = processor(images=[_rand_image(h, w)], text=IMAGE_TOKEN)
        assert _count(out["input_ids"], processor.image_token_id) == n_tokens


def test_chat_template_multi_turn_and_image_path(processor, tmp_path):
    path = tmp_path / "img.png"
    img = _rand_image(40, 40, seed=18)
    Image.fromarray(img).save(path)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image", "path": str(path)}]},
        {"role": "assistant", "content": "noise"},
    ]
    text = processor.apply_chat_template(messages)
    assert text == (
        "<|open|>system<|sep|>be brief<|end_of_msg|>"
        "<|open|>user<|sep|>what is <|media_begin|><|media_content|><|media_pad|><|media_end|><|end_of_msg|>"
        "<|open|>assistant<|sep|>noise<|end_of_msg|>"
    )
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]  # 40x40 -> padded 56x56
    assert _count(out["input_ids"], processor.image_token_id) == 4
    # PNG round trip is lossless: the loaded file gives the same pixels as the array.
    assert torch.equal(out["pixel_values"], processor.image_processor(img)["pixel_values"])


def test_processor_output_runs_through_the_model(processor, tokenizer):
    """The processor's layout is the model's input contract: counts match, and an image changes only later logits."""
    from transformers_k3 import KimiK3ForConditionalGeneration
    from transformers_k3.tiny import tiny_config

    cfg = tiny_config(num_hidden_layers=4, vocab_size=512)
    cfg.media_placeholder_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(cfg).float().eval()
    img = _rand_image(50, 70, seed=19)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image", "image": img},
                                             {"type": "text", "text": "describe"}]}]
    a = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
    b = processor.apply_chat_template(
        [{"role": "user", "content": [dict(part, image=255 - img) if part["type"] == "image" else part
                                      for part in messages[0]["content"]]}],
        tokenize=True, return_dict=True,
    )
    assert torch.equal(a["input_ids"], b["input_ids"])
    with torch.no_grad():
        la = model(input_ids=a["input_ids"], pixel_values=a["pixel_values"], image_grid_thw=a["image_grid_thw"]).logits
        lb = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"]).logits
    first = a["input_ids"][0].tolist().index(cfg.media_placeholder_token_id)
    assert la.shape[:2] == a["input_ids"].shape
    # fp32 rounding only (chunked KDA computes a whole chunk at once): causality holds to 1e-5 by max-norm,
    # while the image's effect on later logits is of order one.
    assert rel_err(la[:, :first], lb[:, :first]) < 1e-5, "positions before the image cannot see it"
    assert rel_err(la[:, first:], lb[:, first:]) > 1e-2, "the image features reach the logits"


def test_unsupported_image_kwargs_raise():
    with pytest.raises(TypeError, match="do_resize"):
        KimiK3ImageProcessor()(_rand_image(28, 28), do_resize=False)
    with pytest.raises(ValueError, match="return_tensors"):
        KimiK3ImageProcessor()(_rand_image(28, 28), return_tensors="np")
