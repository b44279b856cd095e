"""examples/train_vlm_from_scratch.py: the scene generator against its pixels, the label masking against the
processor, and the smoke run end to end (evidence, finite losses, reload in the released layout, generate)."""

import importlib.util
import json
import math
import random
import re
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from helpers import load_example


@pytest.fixture(scope="module")
def vlm():
    return load_example("train_vlm_from_scratch")


@pytest.fixture(scope="module")
def processor(vlm):
    return vlm.load_processor()


# ---- scene generator: decode the drawn image independently and compare with the spec and the text ----

def _components(arr: np.ndarray, background: int):
    """4-connected components of non-background pixels: list of (colour rgb, pixel coords [n, 2] as (y, x))."""
    h, w, _ = arr.shape
    fg = ~(arr == background).all(-1)
    seen = np.zeros((h, w), bool)
    comps = []
    for y0, x0 in zip(*np.nonzero(fg)):
        if seen[y0, x0]:
            continue
        stack, pix = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            pix.append((y, x))
            for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                yy, xx = y + dy, x + dx
                if 0 <= yy < h and 0 <= xx < w and fg[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        pix = np.array(pix)
        colours = {tuple(arr[y, x]) for y, x in pix}
        assert len(colours) == 1, f"a component has several colours {colours} (antialiasing or overlap)"
        comps.append((colours.pop(), pix))
    return comps


def _decode(vlm, img, background):
    """Objects read from pixels alone: colour by RGB, shape by fill ratio of the bounding box, slot by the
    nearest nominal slot centre."""
    arr = np.asarray(img)
    h, w, _ = arr.shape
    by_rgb = {rgb: name for name, rgb in vlm.COLOURS.items()}
    objs = []
    for rgb, pix in _components(arr, background):
        bh, bw = np.ptp(pix[:, 0]) + 1, np.ptp(pix[:, 1]) + 1
        fill = len(pix) / (bh * bw)
        # square 1, circle ~pi/4, triangle ~1/2
        shape = "square" if fill > 0.95 else "circle" if fill > 0.64 else "triangle"
        cy, cx = pix.mean(0)
        centres = {s: (fx * w, fy * h) for s, (fx, fy) in vlm.SLOT_CENTRES.items()}
        slot = min(vlm.SLOTS, key=lambda s: (centres[s][0] - cx) ** 2 + (centres[s][1] - cy) ** 2)
        objs.append((shape, by_rgb[rgb], slot))
    return objs


def _parse_caption(text: str) -> Counter:
    words = {"a": 1, "two": 2, "three": 3, "four": 4}
    out = Counter()
    for n, colour, shape in re.findall(r"(a|two|three|four) (\w+) (circle|square|triangle)s?", text):
        out[(colour, shape)] += words[n]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_scene_text_matches_drawn_pixels(vlm, seed):
    rng = random.Random(seed)
    kinds = Counter()
    for _ in range(25):
        scene = vlm.make_scene(rng)
        img = vlm.render(scene)
        assert img.shape == (scene.height, scene.width, 3) and img.dtype == np.uint8
        drawn = _decode(vlm, img, scene.background)
        assert sorted(drawn) == sorted((o.shape, o.colour, o.slot) for o in scene.objects), "pixels differ from spec"
        assert 1 <= len(drawn) <= 4 and len({s for _, _, s in drawn}) == len(drawn)
        # The caption, parsed back, lists exactly the drawn (colour, shape) counts.
        assert _parse_caption(vlm.caption(scene)) == Counter((c, s) for s, c, _ in drawn)
        shape_counts = Counter(s for s, _, _ in drawn)
        for kind, question, answer in vlm.questions(scene):
            kinds[kind] += 1
            shape = re.search(r"(circle|square|triangle)", question).group(1)
            if kind == "count":
                assert answer == str(shape_counts[shape])
            else:
                assert shape_counts[shape] == 1, "colour/position questions only about a unique shape"
                (obj,) = [d for d in drawn if d[0] == shape]
                assert answer == (obj[1] if kind == "colour" else obj[2])
    assert kinds["count"] == 25 and kinds["colour"] > 0 and kinds["position"] == kinds["colour"]


def test_count_answers_are_balanced(vlm):
    rng = random.Random(7)
    answers = Counter(q[2] for _ in range(2000) for q in vlm.questions(vlm.make_scene(rng)) if q[0] == "count")
    assert set(answers) == {"0", "1", "2", "3", "4"}
    assert max(answers.values()) / sum(answers.values()) < 0.3, answers


def test_render_rejects_unknown_shape(vlm):
    scene = vlm.Scene(56, 56, 255, "circle", [vlm.Shape("hexagon", "red", "left", 11, 28, 6)])
    with pytest.raises(ValueError, match="hexagon"):
        vlm.render(scene)


# ---- token layout and label masking ----

def test_examples_match_processor_and_mask_all_but_the_answer(vlm, processor):
    layout = vlm.Layout(processor)
    corpus = vlm.Corpus(processor, layout, n_images=12, seed=3)
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids("<|end_of_msg|>")
    assert len(corpus.items) >= 12 * 2
    for i, kind, question, answer, ids, labels in corpus.items:
        img = corpus.images[i]
        # The cached-piece construction equals the processor on the whole text (same ids, same image tokens).
        full = processor(images=[img], text=layout.prompt_text(question) + answer + "<|end_of_msg|>")
        assert ids.tolist() == full["input_ids"][0].tolist()
        assert torch.equal(corpus.pixels(i), full["pixel_values"])
        assert torch.equal(corpus.grids[i:i + 1], full["image_grid_thw"])
        keep = labels != -100
        # Only the answer (and its stop token) carries labels: one contiguous run at the end.
        n = int(keep.sum())
        assert keep[-n:].all() and not keep[:-n].any()
        assert torch.equal(labels[keep], ids[keep])
        assert labels[-1] == end and tok.decode(labels[keep][:-1]) == answer
        assert not bool((ids[keep] == processor.image_token_id).any())
        assert int((ids == processor.image_token_id).sum()) == int(corpus.grids[i].prod()) // 4
        prompt = tok.decode(ids[~keep])
        assert question in prompt and answer not in prompt.split(question)[-1]


def test_collator_batches_images_of_different_sizes(vlm, processor):
    layout = vlm.Layout(processor)
    corpus = vlm.Corpus(processor, layout, n_images=20, seed=4)
    ds = vlm.TaskDataset(corpus)
    picks = [0, 5, 9, 14, 30]
    batch = vlm.VLMCollator(layout.pad_id)([ds[j] for j in picks])
    grids = batch["image_grid_thw"]
    assert grids.shape == (len(picks), 3) and len({tuple(g) for g in grids.tolist()}) > 1, "sizes should vary"
    imgs = [corpus.images[corpus.items[j][0]] for j in picks]
    ref = processor.image_processor(imgs)
    assert torch.equal(batch["pixel_values"], ref["pixel_values"]) and torch.equal(grids, ref["image_grid_thw"])
    for b, j in enumerate(picks):
        n = len(corpus.items[j][4])
        assert batch["input_ids"][b, :n].tolist() == corpus.items[j][4].tolist()
        assert (batch["input_ids"][b, n:] == layout.pad_id).all() and (batch["labels"][b, n:] == -100).all()
    ph = int((batch["input_ids"] == processor.image_token_id).sum())
    assert ph == int(grids.prod(-1).sum()) // 4


# ---- the smoke run ----

@pytest.fixture(scope="module")
def smoke(vlm, tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_smoke")
    metrics = vlm.main(["--smoke", "--compare", "--out", str(root / "model"), "--evidence", str(root / "evidence")])
    return root, metrics


def test_smoke_writes_evidence_with_finite_losses(smoke):
    root, metrics = smoke
    ev = root / "evidence"
    wanted = ["metrics.json", "README.md"]
    if importlib.util.find_spec("matplotlib") is not None:  # the script warns and skips plots without it
        wanted.append("curves.png")
    for name in wanted:
        assert (ev / name).is_file() and (ev / name).stat().st_size > 0, name
    saved = json.loads((ev / "metrics.json").read_text())
    assert set(saved["runs"]) == {"scratch", "contrastive"}
    for init, run in saved["runs"].items():
        assert "error" not in run and "eval_error" not in run, run.get("error") or run.get("eval_error")
        nt = run["next_token"]
        assert nt["steps"] > 0 and math.isfinite(nt["final_loss"]) and math.isfinite(run["heldout_loss"])
        assert any(h["grad_norm"] is not None and math.isfinite(h["grad_norm"]) for h in nt["history"])
        for kind in ("count", "colour", "position"):
            assert 0.0 <= run["eval"][kind]["accuracy"] <= 1.0 and run["eval"][kind]["n"] > 0
    assert saved["runs"]["contrastive"]["contrastive"]["steps"] > 0
    assert all(math.isfinite(h["loss"]) for h in saved["runs"]["contrastive"]["contrastive"]["history"])
    for kind in ("count", "colour", "position"):
        assert 0.0 < saved["chance"][kind]["uniform"] < 1.0
    assert saved["checkpoint"]["n_weight_packed"] > 0


def test_smoke_checkpoint_reloads_and_answers(smoke):
    from transformers_k3 import KimiK3ForConditionalGeneration, KimiK3Processor

    root, _ = smoke
    out = root / "model"
    files = {f.name for f in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= files
    model, info = KimiK3ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    vlm = load_example("train_vlm_from_scratch")
    processor = AutoProcessor.from_pretrained(out)  # KimiK3Processor, also on 5.17 without torchvision
    assert isinstance(processor, KimiK3Processor)
    assert (processor.image_processor.max_patches, processor.image_processor.max_patches_per_side) == (256, 16)
    assert processor.image_token_id == model.config.media_placeholder_token_id
    model = model.float().eval()
    layout = vlm.Layout(processor)
    img = vlm.render(vlm.make_scene(random.Random(99)))
    answers = vlm.generate_answers(model, processor, layout, [img, img], ["How many circles?", "Describe the image."],
                                   max_new_tokens=4, batch=2, device=torch.device("cpu"))
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
