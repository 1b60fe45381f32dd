"""Examples with images, for image-text models (`toolkit.model.vision`).

The forms users have, each read into one conversation whose messages hold content parts
(`{"type": "image", "image": REF}`, `{"type": "text", "text": ...}`), REF a resolved path or a data URL:
- chat messages whose content lists image parts: `{"type": "image", "image": "a.png"}` (also `path` or `url` for the
  key) or OpenAI's `{"type": "image_url", "image_url": {"url": "a.png" or "data:image/png;base64,..."}}`;
- LLaMA-Factory/ShareGPT: `<image>` placeholders in the turns, with an `images` column of paths, in order;
- alpaca-like rows with an `image` (or `images`) column (`--columns image=photo`): the images go first in the prompt.
Paths resolve relative to the data file's folder. Images are opened when a batch is collated, never held.

Their rows, labels and batches: `toolkit.data.image_rows`; a run's image data prepared: `toolkit.data.image_prepare`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

PLACEHOLDER = "<image>"
IMAGE_COLUMNS = ("images", "image")
# a batch key the model is called with under the rest of its name (`toolkit.data.image_rows.MediaCollate`)
MEDIA = "media:"


def reference(part: dict) -> Any:
    """The image a content part names (a path, a URL string), or None where it is not an image part."""
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if kind == "image":
        return next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), "")
    return None


def content_parts(value: Any, where: str) -> str | list[dict]:
    """A turn's content: a string as it is; a list of parts as our parts when it holds an image (else its text parts
    joined: a text model's data written as parts)."""
    if not isinstance(value, list):
        return str(value or "")
    parts: list[dict] = []
    for p in value:
        if isinstance(p, str):
            parts.append({"type": "text", "text": p})
        elif isinstance(p, dict) and reference(p) is not None:
            parts.append({"type": "image", "image": reference(p)})
        elif isinstance(p, dict) and p.get("type", "text") == "text":
            parts.append({"type": "text", "text": str(p.get("text") or "")})
        else:
            raise UserError(f"{where}a content part must be {{type: text, text}} or {{type: image, image}} "
                            f"(or OpenAI's image_url); got {str(p)[:80]}")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def has_images(conv: list[dict] | str) -> bool:
    """A conversation with an image part."""
    return not isinstance(conv, str) and any(isinstance(m["content"], list) for m in conv)


def image_refs(conv: list[dict]) -> list[str]:
    """The image references of a conversation's parts, in order."""
    return [p["image"] for m in conv if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def with_images(conv: list[dict], row: dict, data_file: str, where: str) -> list[dict]:
    """`conv` with the record's image column placed: in its image parts that name no image (Hugging Face's
    `{"type": "image"}` beside an `images` column), else at its `<image>` placeholders, else before the first user
    turn's text; every image reference resolved against `data_file`'s folder and checked to exist."""
    column = next((c for c in IMAGE_COLUMNS if row.get(c) not in (None, [], "")), None)
    given = [] if column is None else row[column] if isinstance(row[column], list) else [row[column]]
    refs = [image_value(g, where) for g in given]
    bare = sum(p["image"] == "" for m in conv if isinstance(m["content"], list) for p in m["content"]
               if p["type"] == "image")
    if bare:
        if bare != len(refs):
            raise UserError(f"{where}has {bare} image part{'s' * (bare != 1)} that name no image but {len(refs)} "
                            f"image{'s' * (len(refs) != 1)} in {repr(column) if column else 'no image column'}; give "
                            "one image per part")
        queue = iter(refs)
        conv = [{**m, "content": [{"type": "image", "image": next(queue)} if p["type"] == "image" and p["image"] == ""
                                  else p for p in m["content"]]} if isinstance(m["content"], list) else m for m in conv]
    elif column is not None:
        conv = _placed(conv, refs, column, where)
    elif any(isinstance(m["content"], str) and PLACEHOLDER in m["content"] for m in conv) and \
            any(c in row for c in IMAGE_COLUMNS):
        raise UserError(f"{where}has {PLACEHOLDER} placeholders but no images in its image column")
    data = Path(data_file).expanduser()
    # a folder of data files: paths are relative to it
    folder = data if data.is_dir() else data.parent if data.exists() else Path(".")
    for m in conv:
        if isinstance(m["content"], list):
            m["content"] = [{"type": "image", "image": _resolved(p["image"], folder, where)} if p["type"] == "image"
                            else p for p in m["content"]]
    return conv


def image_value(value: Any, where: str) -> str:
    """An image column's entry as a reference: a path or URL as it is; a decoded image (datasets' Image feature gives
    PIL images) or its {"bytes", "path"} dict as a data URL, or its path."""
    import base64
    import io

    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        if value.get("bytes"):
            return "data:image;base64," + base64.b64encode(value["bytes"]).decode()
        return str(value["path"])
    if hasattr(value, "save") and hasattr(value, "size"):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    raise UserError(f"{where}an entry of its image column is {type(value).__name__} {str(value)[:40]!r}: give a "
                    "path, a data URL, or an image (PIL, or datasets' {bytes, path})")


def without_images(conv: list[dict]) -> list[dict]:
    """`conv` as text alone (--images off): each turn's text parts joined, its images left out."""
    return [{**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}
            if isinstance(m["content"], list) else m for m in conv]


def _placed(conv: list[dict], images: list[str], column: str, where: str) -> list[dict]:
    """The images at the `<image>` placeholders, in order; as many placeholders as images, or none at all (then
    they go first in the first user turn)."""
    marks = sum(m["content"].count(PLACEHOLDER) for m in conv if isinstance(m["content"], str))
    if marks == 0:
        first = next(i for i, m in enumerate(conv) if m["role"] == "user") if any(
            m["role"] == "user" for m in conv) else 0
        text = conv[first]["content"]
        conv = [*conv[:first], {**conv[first], "content": [{"type": "image", "image": r} for r in images]
                                + ([{"type": "text", "text": text}] if isinstance(text, str) else text)},
                *conv[first + 1:]]
        return conv
    if marks != len(images):
        raise UserError(f"{where}has {marks} {PLACEHOLDER} placeholder{'s' * (marks != 1)} but {len(images)} "
                        f"image{'s' * (len(images) != 1)} in '{column}'; give one image per placeholder")
    queue = iter(images)
    out = []
    for m in conv:
        if not isinstance(m["content"], str) or PLACEHOLDER not in m["content"]:
            out.append(m)
            continue
        pieces = m["content"].split(PLACEHOLDER)
        parts: list[dict] = []
        for k, piece in enumerate(pieces):
            if k:
                parts.append({"type": "image", "image": next(queue)})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out


def _resolved(ref: str, folder: Path, where: str) -> str:
    """A data URL or http(s) URL as it is; a path made absolute against the data file's folder, which must hold it."""
    if not isinstance(ref, str) or not ref:
        raise UserError(f"{where}an image part names no image (give its path, or a data URL)")
    if ref.startswith(("data:", "http://", "https://")):
        if ref.startswith("http"):
            raise UserError(f"{where}image {ref[:80]}: URLs are not fetched (nothing downloads at run time); save "
                            "the image and give its path")
        return ref
    path = Path(ref).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise UserError(f"{where}image {ref} not found (looked for {path}; paths are relative to the data file's "
                        "folder)")
    return str(path.resolve())


def open_image(ref: str):
    """The image `ref` names, decoded as RGB (a data URL's base64 bytes, or the file)."""
    import base64
    import io

    from PIL import Image

    if ref.startswith("data:"):
        data = io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))
        return Image.open(data).convert("RGB")
    with Image.open(ref) as img:
        return img.convert("RGB")


def open_images(refs: list[str], where: str) -> list:
    """Every image `refs` names (`open_image`); one that cannot be decoded is one line (`where`: the record)."""
    try:
        return [open_image(r) for r in refs]
    except Exception as e:  # noqa: BLE001 - PIL raises several kinds on a damaged file
        raise UserError(f"{where}an image could not be read ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
                        "replace the file") from None


def within_bounds(processor, images: list, refs: list[str], where: str = "") -> list:
    """`images`, unless the image processor's resizing is off (`do_resize` false in its preprocessor_config.json) and
    one is beyond the bounds it resizes to: it would make more pixel values as given than once resized (asked of the
    image processor itself, whose bounds each model names its own way). One line names the image and the fix: a
    silent long row would be cut or dropped."""
    ip = getattr(processor, "image_processor", None)
    if ip is None or getattr(ip, "do_resize", True) is not False:
        return images
    fix = "resize the image, or set do_resize true in the model's preprocessor_config.json"
    for image, ref in zip(images, refs):
        ref = ref if not ref.startswith("data:") else ref[:40] + "..."
        # Qwen2-VL's takes only sides that are multiples of its merged patch
        sizes = []
        for resize in (False, True):
            try:
                made = ip(images=[image], do_resize=resize, return_tensors="pt")
                sizes.append(sum(v.numel() for k, v in made.items() if k.startswith("pixel_values")))
            except Exception as e:  # noqa: BLE001 - each image processor fails its own way
                how = "resized" if resize else "as given (its do_resize is false)"
                raise UserError(f"{where}image {ref} ({image.width}x{image.height}): {type(ip).__name__} cannot "
                                f"take it {how} ({type(e).__name__}: {' '.join(str(e).split())[:120]}); "
                                f"{fix}") from None
        given, bound = sizes
        if given > bound:
            raise UserError(f"{where}image {ref} ({image.width}x{image.height}) is beyond the bounds "
                            f"{type(ip).__name__} resizes to, and its do_resize is false: as given it makes {given} "
                            f"pixel values, {bound} once resized; {fix}")
    return images


def template_messages(conv: list[dict]) -> list[dict]:
    """The conversation as processor chat templates take it: every content a list of parts, images as bare
    `{"type": "image"}` (the pixels go to the processor apart)."""
    return [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]
             if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]} for m in conv]


def answer_texts(message: dict) -> list[str]:
    """A message's text parts (its content, where that is a string)."""
    content = message["content"]
    return [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]


def refuse_prefix_types(processor, enc, objective: str) -> None:
    """One line where the processor's `token_type_ids` (of `enc`, its output) are not each token's modality (its
    `create_mm_token_type_ids`: Gemma 3's are) but mark a prefix the model attends to both ways (PaliGemma's): GRPO's
    sampled rows and KTO's KL rows make them of their own ids."""
    types = enc.get("token_type_ids")
    if types is None:
        return
    ids = [[int(t) for t in row] for row in enc["input_ids"]]
    if [[int(t) for t in row] for row in types] != processor.create_mm_token_type_ids(ids):
        raise UserError(f"--objective {objective}: {type(processor).__name__}'s token_type_ids are not each token's "
                        "modality (they mark a prefix the model attends to both ways, as PaliGemma's do), which "
                        f"{'its sampled rows' if objective == 'grpo' else 'its KL sequences'} do not lay out; it "
                        "reads images on LLaVA, Idefics3/SmolVLM, the Qwen-VL family and Gemma 3")


def modality_types(processor, ids):
    """Each token's modality (1: an image's) of `ids` (B, T) as the processor makes its types
    (`create_mm_token_type_ids`, where it has one; else where the ids are its image token), on `ids`' device."""
    import torch

    make = getattr(processor, "create_mm_token_type_ids", None)
    if make is not None:
        return torch.tensor(make(ids.tolist()), dtype=torch.long, device=ids.device)
    return (ids == image_token_id(processor)).long()


# the per-token inputs of rows the processor did not pad itself (GRPO's sampled rows, KTO's KL rows), made of their
# own ids as the processor makes them: each token's modality (Gemma 3's token_type_ids, Qwen2-VL's
# mm_token_type_ids), the images each token attends to (Mllama's cross_attention_mask)
OF_IDS = ("mm_token_type_ids", "token_type_ids", "cross_attention_mask")


def of_ids(processor, enc, keys=OF_IDS) -> dict:
    """{name: a function of ids (B, T) giving that input} for each of `keys` the processor's output `enc` holds (of
    the same rows' images): rows laid out otherwise than the processor pads take theirs from their own ids."""
    out = {}
    for key in (k for k in keys if k in enc):
        if key == "cross_attention_mask":
            mask = enc[key]
            # each row's images' tiles, as the processor's own mask attends them (any of its tokens)
            tiles = [[int(n) for n in row.amax(0).sum(-1)] for row in mask]
            out[key] = partial(cross_attention_mask, processor, tiles, mask.shape[-1])
        else:
            out[key] = partial(modality_types, processor)
    return out


def cross_attention_mask(processor, tiles: list[list[int]], max_tiles: int, ids):
    """The images and tiles each token of `ids` (B, T) attends to, (B, T, images, max_tiles), as Mllama's processor
    makes its cross_attention_mask of the ids it padded (`get_cross_attention_token_mask`: an image from
    its token to the next image's, the last and consecutive ones to the row's end); `tiles`: each row's images' tile
    counts. A token before every image attends to none (the model zeroes its cross-attention)."""
    import numpy as np
    import torch

    from transformers.models.mllama import processing_mllama as module

    spans = [module.get_cross_attention_token_mask(row, processor.image_token_id) for row in ids.tolist()]
    for row, (have, n) in enumerate(zip(spans, tiles)):
        if len(have) > len(n):
            raise RuntimeError(f"row {row} holds {len(have)} image tokens for {len(n)} images")
    dense = module.convert_sparse_cross_attention_mask_to_dense(spans, tiles, max_tiles, ids.shape[1]) \
        if any(spans) else np.zeros((ids.shape[0], ids.shape[1], 1, max_tiles), dtype=np.int64)
    return torch.from_numpy(dense).to(ids.device)


def image_token_id(processor) -> int | None:
    """The id the processor repeats for an image's features (`image_token_id`, else its `image_token`'s)."""
    token = getattr(processor, "image_token_id", None)
    if token is None and getattr(processor, "image_token", None):
        token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return token
