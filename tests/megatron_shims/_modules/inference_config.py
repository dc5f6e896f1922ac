"""SHIM (tests only) for ``megatron/core/inference/config.py`` (imports torch and the model
config): ``ImageProcessingConfig`` with main d98e8a64's fields and defaults."""

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class ImageProcessingConfig:
    """Configuration for converting raw images into model input tensors."""

    patch_dim: int
    dynamic_resolution: bool = False
    use_tiling: bool = False
    pixel_shuffle: bool = False
    spatial_merge_size: int = 1
    dynamic_resolution_min_patches: int = 1
    dynamic_resolution_max_patches: int = 128
    vision_model_type: str = "radio"
    pixel_mean: Optional[List[float]] = None  # noqa: UP045 - as Megatron declares it
    pixel_std: Optional[List[float]] = None  # noqa: UP045
    img_h: Optional[int] = None  # noqa: UP045
    img_w: Optional[int] = None  # noqa: UP045
    max_num_tiles: int = 1
    use_thumbnail: bool = False
    num_img_embeddings_per_tile: int = 0
