"""Images in: image files and ``data:`` URLs read safely, and a prompt's images
turned into its token ids and `mlx_mtp.media.Media` by the model's family (its image
processor and vision tower, mlx-vlm's).

Reading is bounded before anything is decoded: the encoded bytes (`MAX_BYTES`) and
the pixel count the file's header declares (`MAX_PIXELS`, checked before the
pixels are decoded, so a decompression bomb costs nothing). A file that is not an
image, or is truncated or corrupt, is an `ImageError` in one line naming it. The
processor then resizes each image within the model's own pixel budget (its
``preprocessor_config.json``), which bounds the placeholders it takes.
"""

import base64
import binascii
import io
from pathlib import Path
from typing import List, Sequence, Tuple, Union

from .errors import MTPError

MAX_BYTES = 50 * 1024 * 1024  # an encoded image file
MAX_PIXELS = 50_000_000  # width x height, as its header declares it

ImageSource = Union[str, Path, bytes]


class ImageError(MTPError):
    """An image that cannot be read: not an image, truncated, or too large."""


def read_image(source: ImageSource, name: str = ""):
    """The RGB ``PIL.Image`` of a file path or of encoded bytes (``name``: how an
    error names it).

    Raises:
        ImageError: unreadable, not an image, truncated, or over `MAX_BYTES` or
            `MAX_PIXELS`.
        MTPError: Pillow is not installed (the extra ``mlx-mtp[vlm]`` brings it).
    """
    try:
        from PIL import Image
    except ImportError:
        raise MTPError(
            "reading images needs Pillow, which the extra for models that read "
            "images installs: pip install 'mlx-mtp[vlm]'"
        ) from None

    name = name or (str(source) if not isinstance(source, bytes) else "the image")
    data = source if isinstance(source, bytes) else _read_file(Path(source), name)
    if len(data) > MAX_BYTES:
        raise ImageError(f"{name} is over {MAX_BYTES // 2**20} MiB")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size  # read from the header: nothing decoded yet
        if width * height > MAX_PIXELS:
            raise ImageError(
                f"{name} is {width}x{height} pixels, over the {MAX_PIXELS:,} "
                "an image may have"
            )
        image.load()
        return image.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(f"{name} has too many pixels") from None
    except Image.UnidentifiedImageError:
        raise ImageError(
            f"{name} is not an image that can be read: not a format Pillow knows"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{name} is not an image that can be read: {e}") from None


def _read_file(path: Path, name: str) -> bytes:
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ImageError(f"{name} is over {MAX_BYTES // 2**20} MiB")
        return path.read_bytes()
    except ImageError:
        raise
    except OSError as e:
        raise ImageError(f"cannot read the image {name}: {e.strerror or e}") from None


def data_url(url: str, name: str = "an image") -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL.

    Raises:
        ImageError: any other URL (remote ones are never fetched), or one whose
            data is not base64.
    """
    if not url.startswith("data:"):
        raise ImageError(
            f"{name}: only data: URLs are read (the server fetches nothing)"
        )
    head, _, body = url.partition(",")
    if not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise ImageError(f"{name}: a data: URL must be data:image/...;base64,...")
    return base64_image(body, name)


def base64_image(body: str, name: str = "an image") -> bytes:
    """Decoded base64 image data, bounded before it is decoded."""
    if len(body) > MAX_BYTES * 4 // 3 + 4:
        raise ImageError(f"{name} is over {MAX_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name}: its data is not valid base64") from None


def image_messages(text: str, images: int, system: str = "") -> list:
    """A one-turn chat asking ``text`` about ``images`` images (placed first, as
    mlx-vlm places them for GLM-OCR), for the model's chat template."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    system_turn = [{"role": "system", "content": system}] if system else []
    return system_turn + [{"role": "user", "content": content}]


def reads_images(model) -> bool:
    """Whether ``model`` reads images: its family does, and its checkpoint's vision
    tower is loaded (a Qwen3.5 text-only conversion has none)."""
    return (
        model.family.media is not None
        and getattr(model.trunk, "vision_tower", None) is not None
    )


def no_images(model) -> str:
    """Why ``model`` reads no images, in one line."""
    refusal = getattr(model.trunk, "vision_refusal", None)
    if refusal:
        return refusal
    if model.family.media is not None:
        return (
            f"this {model.family.name} checkpoint has no vision tower (a text-only "
            "conversion: `mlx-mtp convert` of the Hugging Face release keeps it)"
        )
    return f"{model.family.name} reads no images (a text model)"


def prompt_media(model, ids: List[int], images: Sequence) -> Tuple[List[int], object]:
    """A prompt's token ids with one image placeholder per image (as the model's
    chat template writes them), as the model reads them: each placeholder repeated
    for its image's features, and the prompt's `mlx_mtp.media.Media`.

    Args:
        images: ``PIL.Image``s, paths or encoded bytes (read by `read_image`).

    Raises:
        MTPError: the model reads no images, or the placeholders are not one per
            image (one line).
    """
    processor, pictures = _processor(model), _pictures(model, images)
    inputs = _processed(processor, pictures)
    grid = [list(map(int, g)) for g in inputs["image_grid_thw"]]
    return model.family.media(model.trunk, list(ids), inputs["pixel_values"], grid)


class PendingMedia:
    """A prompt's images, read and sized, whose `mlx_mtp.media.Media` is made when
    called (the processor again, then the vision tower): a batch makes a row's at
    its admission (`mlx_mtp.batch.run_batch`), so that a run of many prompts with
    images holds the image features of the rows decoding, not of every prompt."""

    def __init__(self, model, ids: List[int], images: Sequence, expanded: List[int]):
        self.model, self.ids, self.images = model, ids, list(images)
        self.expanded = expanded

    def __call__(self):
        """The `mlx_mtp.media.Media`.

        Raises:
            MTPError: an image cannot be read now, or reads otherwise than when
                it was sized (a file changed on disk).
        """
        ids, media = prompt_media(self.model, self.ids, self.images)
        if ids != self.expanded:
            raise ImageError("an image changed since it was read")
        return media


def pending_media(
    model, ids: List[int], images: Sequence
) -> Tuple[List[int], PendingMedia]:
    """`prompt_media`'s ids now, its media later (a `PendingMedia`): each image read
    (bounded, as `read_image` reads it) and sized by the image processor, and the
    placeholders repeated for it; nothing goes through the vision tower yet.

    Raises:
        MTPError: as `prompt_media`.
    """
    from .media import expand

    processor, pictures = _processor(model), _pictures(model, images)
    grid = [
        list(map(int, g)) for g in _processed(processor, pictures)["image_grid_thw"]
    ]
    expanded, _ = expand(ids, model.family.image_placeholder(model.trunk), grid)
    return expanded, PendingMedia(model, list(ids), images, expanded)


def _pictures(model, images: Sequence) -> list:
    """``images`` read (`read_image`; ``PIL.Image``s as they are), for a model
    that reads them (on several ranks, rank 0 reads them and shares the media:
    `mlx_mtp.media.share`)."""
    if not reads_images(model):
        raise MTPError(no_images(model))
    return [
        im if hasattr(im, "convert") else read_image(im, _name(im, i))
        for i, im in enumerate(images)
    ]


def _processor(model):
    """The model's image processor, made once."""
    processor = model.__dict__.get("_image_processor")
    if processor is None and reads_images(model):
        processor = model.family.image_processor(model.source)
        model.__dict__["_image_processor"] = processor
    return processor


def _processed(processor, pictures: list) -> dict:
    try:
        return processor(images=pictures)
    except ValueError as e:  # an aspect ratio its resize refuses, say
        raise ImageError(f"the image processor refused an image: {e}") from None


def _name(source, i: int) -> str:
    return f"image {i + 1}" if isinstance(source, bytes) else str(source)
