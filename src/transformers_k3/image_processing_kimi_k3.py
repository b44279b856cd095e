"""Image processor for Kimi K3 (MoonViT-V2 input, SPEC section 6).

Each image is resized (aspect ratio kept, never upscaled) to fit a patch budget and a per-side limit,
padded at the bottom/right to multiples of `patch_size * merge_size` (28 px), normalised to [-1, 1]
and cut into 14x14 patches:

- `pixel_values`: `[total_patches, 3 * 14 * 14]`, float32. Each row is one patch flattened channels-first
  `(C, 14, 14)`; the patches of an image come in raster order over its `(h, w)` patch grid; images are
  concatenated in input order.
- `image_grid_thw`: `[num_images, 3]`, int64, `(1, h, w)` in patches. `h` and `w` are even, so an image
  becomes `h * w / 4` features after the vision tower's 2x2 merge.

Padding uses pixel value 0 (black, -1 after normalisation), as transformers' Kimi-K2.5 processor does;
the padded area is part of the patch grid the model sees.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ImagesKwargs

try:
    from PIL import Image as _PILImage
except ImportError:  # PIL is optional: numpy and torch inputs still work
    _PILImage = None


VIDEO_ERROR = (
    "video is not supported by KimiK3ImageProcessor: the released K3 vision tower takes still images only "
    "(image_grid_thw has t = 1); pass the frames as separate images if that is what you want"
)


class KimiK3ImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    max_patches (`int`, defaults to 4096): most 14x14 patches per image, after padding.
    max_patches_per_side (`int`, defaults to 512): most patches along either side, after padding.
    patch_size (`int`, defaults to 14): the vision tower's patch size.
    merge_size (`int`, defaults to 2): side of the patch merge; each side is padded to `patch_size * merge_size`.
    """

    max_patches: int
    max_patches_per_side: int
    patch_size: int
    merge_size: int


# The per-call options `preprocess` takes; the other ImagesKwargs keys (do_resize, size, ...) have no meaning here
# and raise instead of being ignored.
CALL_KWARGS = ("max_patches", "max_patches_per_side")


def fit_to_patch_budget(
    height: int, width: int, patch_size: int = 14, merge_size: int = 2, max_patches: int = 4096,
    max_patches_per_side: int = 512,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Returns `((resized_h, resized_w), (padded_h, padded_w))` in pixels.

    The resize keeps the aspect ratio (each side is `floor(side * scale)` for one common `scale <= 1`) and the
    padded size respects both limits: `(padded_h / p) * (padded_w / p) <= max_patches` and each side
    `<= max_patches_per_side * p`. The limits are checked on the padded size because padding adds patches.
    """
    for name, value in (("height", height), ("width", width)):
        if int(value) < 1:
            raise ValueError(f"image {name} must be >= 1 pixel, got {value}")
    if max_patches < merge_size**2:
        raise ValueError(f"max_patches={max_patches} must be >= merge_size**2={merge_size**2} (one merged patch)")
    if max_patches_per_side < merge_size:
        raise ValueError(f"max_patches_per_side={max_patches_per_side} must be >= merge_size={merge_size}")
    factor = patch_size * merge_size
    # Largest padded side allowed, in pixels: a whole number of merge blocks within the per-side limit.
    side_cap = (max_patches_per_side // merge_size) * factor
    scale = min(1.0, math.sqrt(max_patches * patch_size**2 / (height * width)), side_cap / height, side_cap / width)

    def sizes(s):
        new_h, new_w = max(1, math.floor(height * s)), max(1, math.floor(width * s))
        return (new_h, new_w), (math.ceil(new_h / factor) * factor, math.ceil(new_w / factor) * factor)

    (new_h, new_w), (pad_h, pad_w) = sizes(scale)
    # Padding up to the merge block can push the count over the budget: shrink until the padded size fits.
    # Terminates: at worst both sides reach one block, merge_size**2 <= max_patches patches.
    while (pad_h // patch_size) * (pad_w // patch_size) > max_patches or max(pad_h, pad_w) > side_cap:
        count = (pad_h // patch_size) * (pad_w // patch_size)
        scale *= min(0.99, math.sqrt(max_patches / count))
        (new_h, new_w), (pad_h, pad_w) = sizes(scale)
    return (new_h, new_w), (pad_h, pad_w)


def _to_chw_float(image, index: int) -> torch.Tensor:
    """One image -> float32 `[3, H, W]` in [0, 255]."""
    where = f"images[{index}]"
    if isinstance(image, str):
        # A local path or base64 string, as chat messages may carry (`{"type": "image", "path": ...}`).
        from transformers.image_utils import load_image

        try:
            image = load_image(image)
        except Exception as err:  # load_image raises several types; name the argument instead
            raise ValueError(f"{where}: could not load an image from the string {image[:80]!r}: {err}") from err
    if _PILImage is not None and isinstance(image, _PILImage.Image):
        image = np.asarray(image.convert("RGB"))  # [H, W, 3] uint8
    if isinstance(image, np.ndarray):
        if image.ndim == 2:
            image = image[:, :, None]
        if image.ndim != 3 or image.shape[-1] not in (1, 3):
            raise ValueError(f"{where}: a numpy image must be HWC with 1 or 3 channels, got shape {image.shape}")
        tensor = torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1)  # [C, H, W]
    elif isinstance(image, torch.Tensor):
        tensor = image.detach().cpu()
        if tensor.ndim == 2:
            tensor = tensor[None]
        if tensor.ndim != 3 or tensor.shape[0] not in (1, 3):
            raise ValueError(
                f"{where}: a torch image must be CHW with 1 or 3 channels, got shape {tuple(tensor.shape)}"
            )
    else:
        raise TypeError(
            f"{where}: expected a PIL image, path, numpy HWC array or torch CHW tensor, got {type(image).__name__}"
        )
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"{where}: unsupported dtype {tensor.dtype}")
    if tensor.is_floating_point():
        # Float images are taken as already in [0, 1] (the transformers convention after rescaling).
        tensor = tensor.float()
        lo, hi = float(tensor.min()), float(tensor.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(
                f"{where}: float images must be in [0, 1], got values in [{lo}, {hi}]; pass uint8 for 0..255"
            )
        tensor = tensor * 255.0
    else:
        tensor = tensor.float()
    if tensor.shape[0] == 1:
        tensor = tensor.expand(3, -1, -1)
    return tensor.contiguous()


def _flatten_images(images) -> list:
    """A single image, a 4-D batch, a list, or a list of lists (one per text sample) -> flat list."""
    if isinstance(images, (np.ndarray, torch.Tensor)):
        if images.ndim >= 5:
            raise NotImplementedError(VIDEO_ERROR + f" (got a {images.ndim}-D array)")
        if images.ndim == 4:
            return list(images)
        return [images]
    if isinstance(images, (list, tuple)):
        flat = []
        for item in images:
            if isinstance(item, (list, tuple)):
                if any(isinstance(x, (list, tuple)) for x in item):
                    raise NotImplementedError(VIDEO_ERROR + " (got images nested three lists deep)")
                flat.extend(_flatten_images(list(item)))
            elif isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim == 4:
                raise NotImplementedError(VIDEO_ERROR + " (got a 4-D array inside a list of images)")
            else:
                flat.append(item)
        return flat
    return [images]


class KimiK3ImageProcessor(BaseImageProcessor):
    r"""Slow (torch/numpy) image processor for Kimi K3; see the module docstring for the output layout.

    Args:
        max_patches (`int`, defaults to 4096): patch budget per image (after padding).
        max_patches_per_side (`int`, defaults to 512): per-side patch limit (after padding).
        patch_size (`int`, defaults to 14), merge_size (`int`, defaults to 2): from the release's vision_config.
        image_mean, image_std (defaults to 0.5 each): normalisation after `/ 255`, giving [-1, 1].
        resample (`str`, defaults to `"bicubic"`): `torch.nn.functional.interpolate` mode, antialiased.
    """

    model_input_names = ["pixel_values", "image_grid_thw"]
    valid_kwargs = KimiK3ImageProcessorKwargs

    def __init__(
        self,
        max_patches: int = 4096,
        max_patches_per_side: int = 512,
        patch_size: int = 14,
        merge_size: int = 2,
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
        resample: str = "bicubic",
        **kwargs,
    ):
        kwargs.pop("image_processor_type", None)
        super().__init__(**kwargs)
        if resample not in ("bicubic", "bilinear", "nearest-exact", "area"):
            raise ValueError(f"resample must be one of bicubic, bilinear, nearest-exact, area; got {resample!r}")
        self.max_patches = int(max_patches)
        self.max_patches_per_side = int(max_patches_per_side)
        self.patch_size = int(patch_size)
        self.merge_size = int(merge_size)
        self.image_mean = list(image_mean) if image_mean is not None else [0.5, 0.5, 0.5]
        self.image_std = list(image_std) if image_std is not None else [0.5, 0.5, 0.5]
        self.resample = resample
        # Validate the limits once, at construction, with a dummy size.
        fit_to_patch_budget(1, 1, self.patch_size, self.merge_size, self.max_patches, self.max_patches_per_side)

    @classmethod
    def from_vision_config(cls, vision_config, **kwargs) -> "KimiK3ImageProcessor":
        """Takes `patch_size` and the (square) `merge_kernel_size` from a `KimiK3VisionConfig`."""
        merge = list(vision_config.merge_kernel_size)
        if len(merge) != 2 or merge[0] != merge[1]:
            raise ValueError(f"vision_config.merge_kernel_size must be square [m, m], got {merge}")
        return cls(patch_size=vision_config.patch_size, merge_size=merge[0], **kwargs)

    def _limits(self, max_patches=None, max_patches_per_side=None):
        return (
            self.max_patches if max_patches is None else int(max_patches),
            self.max_patches_per_side if max_patches_per_side is None else int(max_patches_per_side),
        )

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Patches an image of this size becomes (features in the prompt: this divided by merge_size**2)."""
        images_kwargs = images_kwargs or {}
        max_patches, per_side = self._limits(
            images_kwargs.get("max_patches"), images_kwargs.get("max_patches_per_side")
        )
        _, (pad_h, pad_w) = fit_to_patch_budget(height, width, self.patch_size, self.merge_size, max_patches, per_side)
        return (pad_h // self.patch_size) * (pad_w // self.patch_size)

    def preprocess(
        self, images=None, videos=None, max_patches: int | None = None, max_patches_per_side: int | None = None,
        return_tensors: str | None = "pt", **kwargs,
    ) -> BatchFeature:
        if videos is not None:
            raise NotImplementedError(VIDEO_ERROR)
        if images is None:
            raise ValueError("images must be given (a PIL image, numpy HWC array, torch CHW tensor, or a list)")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; the processor returns torch")
        unknown = set(kwargs)
        if unknown:
            raise TypeError(
                f"KimiK3ImageProcessor got unexpected keyword arguments {sorted(unknown)}; "
                f"per call it takes {CALL_KWARGS}"
            )
        max_patches, per_side = self._limits(max_patches, max_patches_per_side)
        flat = _flatten_images(images)
        if not flat:
            raise ValueError("images is an empty list")
        p = self.patch_size
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).view(3, 1, 1)
        patches, grids = [], []
        for i, image in enumerate(flat):
            pixels = _to_chw_float(image, i)  # [3, H, W] in [0, 255]
            _, height, width = pixels.shape
            (new_h, new_w), (pad_h, pad_w) = fit_to_patch_budget(
                height, width, p, self.merge_size, max_patches, per_side
            )
            if (new_h, new_w) != (height, width):
                pixels = F.interpolate(
                    pixels[None], size=(new_h, new_w), mode=self.resample,
                    antialias=self.resample in ("bicubic", "bilinear"),
                )[0].clamp_(0.0, 255.0)  # [3, new_h, new_w]; bicubic overshoots, so clamp back
            pixels = F.pad(pixels, (0, pad_w - new_w, 0, pad_h - new_h), value=0.0)  # [3, pad_h, pad_w]
            pixels = (pixels / 255.0 - mean) / std
            gh, gw = pad_h // p, pad_w // p
            # [3, gh, p, gw, p] -> [gh, gw, 3, p, p] -> [gh * gw, 3 * p * p]: raster order, channels-first patches
            flat_patches = pixels.view(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
            patches.append(flat_patches)
            grids.append([1, gh, gw])
        data = {
            "pixel_values": torch.cat(patches, dim=0),  # [total_patches, 3 * p * p]
            "image_grid_thw": torch.tensor(grids, dtype=torch.long),  # [num_images, 3]
        }
        return BatchFeature(data=data)

    def __call__(self, images=None, *args, **kwargs) -> BatchFeature:
        return self.preprocess(images, *args, **kwargs)


def unpatchify(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, patch_size: int = 14) -> list[torch.Tensor]:
    """Inverse of the patch layout: `pixel_values [total, 3*p*p]` -> list of `[3, h*p, w*p]` images."""
    images, start = [], 0
    for t, gh, gw in image_grid_thw.tolist():
        n = t * gh * gw
        block = pixel_values[start : start + n].view(gh, gw, 3, patch_size, patch_size)  # [gh, gw, 3, p, p]
        images.append(block.permute(2, 0, 3, 1, 4).reshape(3, gh * patch_size, gw * patch_size))
        start += n
    if start != pixel_values.shape[0]:
        raise ValueError(f"image_grid_thw covers {start} patches but pixel_values has {pixel_values.shape[0]}")
    return images


__all__ = ["KimiK3ImageProcessor", "fit_to_patch_budget", "unpatchify"]
