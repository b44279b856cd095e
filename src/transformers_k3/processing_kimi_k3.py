"""Processor for Kimi K3: `KimiK3ImageProcessor` + the K3 tokenizer.

An image is marked in the text in one of two ways, each standing for exactly one image, images taken in order:

- `<|media_pad|>` (the release's `media_placeholder_token_id`, 163605): replaced in place by `h * w / 4` copies of
  itself, one per 2x2-merged patch, the count the vision tower produces (`image_grid_thw` = `(1, h, w)`).
- `<|kimi_image_placeholder|>` (the release config's `image_placeholder` string): replaced by the whole image
  block `<|media_begin|><|media_content|>` + `h * w / 4` x `<|media_pad|>` + `<|media_end|>`, the same text the
  chat template writes for an image part.

Placeholders and images must match in number (per sample when `images` is given as one list per text); a
mismatch raises. Already expanded text is not recognised: each `<|media_pad|>` counts as one image.

Chat template: `DEFAULT_CHAT_TEMPLATE` below is this package's reconstruction from the special tokens listed in
SPEC section 8 (`<|open|>`role`<|sep|>`content`<|end_of_msg|>`, images as
`<|media_begin|><|media_content|><|media_pad|><|media_end|>`). The exact released template is NOT in the
reference files; a checkpoint's own `chat_template.jinja` (passed as `chat_template` or saved beside the
processor) takes precedence.
"""

from __future__ import annotations

import json
import os
import re

from transformers.image_processing_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

from .image_processing_kimi_k3 import CALL_KWARGS, VIDEO_ERROR, KimiK3ImageProcessor, _flatten_images

IMAGE_TOKEN = "<|media_pad|>"
IMAGE_MARKER = "<|kimi_image_placeholder|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"

# The one place the chat format lives (see the module docstring: reconstructed, not the released file).
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|open|>{{ message['role'] }}<|sep|>"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] == 'image' -%}<|media_begin|><|media_content|><|media_pad|><|media_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|end_of_msg|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>assistant<|sep|>{%- endif -%}"
)

_PLACEHOLDER_RE = re.compile(re.escape(IMAGE_TOKEN) + "|" + re.escape(IMAGE_MARKER))


class KimiK3Processor(ProcessorMixin):
    r"""Wraps a `KimiK3ImageProcessor` and a tokenizer; see the module docstring for the placeholder rules.

    `__call__(images=None, text=None, **kwargs)` returns `input_ids`, `attention_mask` (and whatever else the
    tokenizer returns) plus `pixel_values [total_patches, 3*14*14]` and `image_grid_thw [num_images, 3]` when
    images are given. `max_patches` / `max_patches_per_side` go to the image processor, the rest to the
    tokenizer.
    """

    image_token = IMAGE_TOKEN
    image_marker = IMAGE_MARKER

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        if chat_template is None:
            chat_template = DEFAULT_CHAT_TEMPLATE
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
        needed = [IMAGE_TOKEN, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END]
        ids = tokenizer.convert_tokens_to_ids(needed)
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [t for t, i in zip(needed, ids) if i is None or i == unk]
        if missing:
            raise ValueError(f"tokenizer has no single-token ids for {missing}; add the K3 special tokens first")
        self.image_token_id = ids[0]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """ProcessorMixin's loader, except where transformers has no usable `AutoImageProcessor` (5.17 without
        torchvision makes it a placeholder that raises for every model): then the image processor is built from
        the saved `processor_config.json`, the tokenizer through `AutoTokenizer`, the chat template from its file."""
        from transformers import AutoImageProcessor, AutoTokenizer
        from transformers.utils.import_utils import DummyObject

        if not isinstance(AutoImageProcessor, DummyObject):
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        path = str(pretrained_model_name_or_path)
        config_file = os.path.join(path, "processor_config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"{path}: no processor_config.json to build KimiK3Processor from (AutoImageProcessor "
                             "is unavailable in this transformers install: it needs torchvision)")
        with open(config_file) as f:
            ip_cfg = dict(json.load(f).get("image_processor", {}))
        ip_cfg.pop("image_processor_type", None)
        template_file = os.path.join(path, "chat_template.jinja")
        template = None
        if os.path.isfile(template_file):
            with open(template_file) as f:
                template = f.read()
        return cls(KimiK3ImageProcessor(**ip_cfg), AutoTokenizer.from_pretrained(path, **kwargs),
                   chat_template=template)

    def _expand(self, sample: str, grids: list, sample_index: int) -> str:
        merge = self.image_processor.merge_size
        found = _PLACEHOLDER_RE.findall(sample)
        if len(found) != len(grids):
            raise ValueError(
                f"text[{sample_index}] has {len(found)} image placeholders ({IMAGE_TOKEN} or {IMAGE_MARKER}) "
                f"but {len(grids)} images were given for it"
            )
        it = iter(grids)

        def repl(match):
            t, h, w = next(it)
            pads = IMAGE_TOKEN * (t * h * w // merge**2)
            return pads if match.group(0) == IMAGE_TOKEN else MEDIA_BEGIN + MEDIA_CONTENT + pads + MEDIA_END

        return _PLACEHOLDER_RE.sub(repl, sample)

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs) -> BatchFeature:
        if videos is not None:
            raise NotImplementedError(VIDEO_ERROR)
        if audio is not None:
            raise NotImplementedError("audio is not supported by KimiK3Processor")
        image_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in CALL_KWARGS}
        # Chat-template plumbing keys that mean nothing to the tokenizer call.
        for key in ("sanitize_control_tokens",):
            kwargs.pop(key, None)
        return_tensors = kwargs.pop("return_tensors", "pt")
        if text is None and images is None:
            raise ValueError("KimiK3Processor needs text, images, or both")

        if text is None:
            return self.image_processor(images, **image_kwargs)
        is_batched = not isinstance(text, str)
        texts = list(text) if is_batched else [text]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a string or a list of strings")

        data = {}
        per_sample = [[] for _ in texts]
        if images is not None:
            # One list of images per text sample (as apply_chat_template passes them), or one flat list in order.
            nested = (
                isinstance(images, (list, tuple)) and len(images) == len(texts)
                and all(isinstance(x, (list, tuple)) for x in images)
            )
            image_out = self.image_processor(images, **image_kwargs)
            grids = image_out["image_grid_thw"].tolist()
            if nested:
                counts = [len(_flatten_images(list(x))) if len(x) else 0 for x in images]
            else:
                found = [len(_PLACEHOLDER_RE.findall(t)) for t in texts]
                if sum(found) != len(grids):
                    raise ValueError(
                        f"the text has {sum(found)} image placeholders ({IMAGE_TOKEN} or {IMAGE_MARKER}) "
                        f"but {len(grids)} images were given"
                    )
                counts = found
            start = 0
            for i, n in enumerate(counts):
                per_sample[i] = grids[start : start + n]
                start += n
            data.update(image_out)
        texts = [self._expand(t, g, i) for i, (t, g) in enumerate(zip(texts, per_sample))]
        text_out = self.tokenizer(texts if is_batched else texts[0], return_tensors=return_tensors, **kwargs)
        data.update(text_out)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def _get_num_multimodal_tokens(self, image_sizes=None, **kwargs):
        """Placeholder tokens per image of the given `(height, width)` sizes, without the images (serving engines)."""
        from transformers.processing_utils import MultiModalData

        data = {}
        if image_sizes is not None:
            images_kwargs = {k: v for k, v in kwargs.items() if k in CALL_KWARGS}
            patches = [self.image_processor.get_number_of_image_patches(h, w, images_kwargs) for h, w in image_sizes]
            merge = self.image_processor.merge_size
            data = {"num_image_tokens": [n // merge**2 for n in patches], "num_image_patches": patches}
        return MultiModalData(**data)

    @property
    def model_input_names(self) -> list[str]:
        names = list(self.tokenizer.model_input_names)
        return names + [n for n in self.image_processor.model_input_names if n not in names]


__all__ = ["KimiK3Processor", "DEFAULT_CHAT_TEMPLATE", "IMAGE_TOKEN", "IMAGE_MARKER"]
