"""Images in a dataset's rows, in TRL's conventions.

A row brings its pictures in an ``image`` column (one picture, or None) or an ``images`` column (a list),
each a PIL image, a path to an image file, or what ``datasets`` holds for an undecoded ``Image`` feature
({"bytes": ..., "path": ...}). Its prompt is a chat whose content may be a list of parts,
``{"type": "image"}`` and ``{"type": "text", "text": ...}``: the column's pictures fill the image parts in
order; a chat without image parts gets them before the text of its first user message (as TRL does). A
part may hold its own picture (``{"type": "image", "image": <PIL image or path>}``), and then needs no
column. The prompt that results holds the opened pictures in its image parts, which is what the model's
processor reads.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from covey.errors import DataError

IMAGE_COLUMNS = ("image", "images")
IMAGE_KEYS = ("image", "path", "url")  # where an image part may hold its picture (a path for the last two)


def is_image(value: Any) -> bool:
    """Whether ``value`` is an opened picture (a PIL image)."""
    try:
        from PIL import Image
    except ImportError:  # no PIL: nothing is an opened picture
        return False
    return isinstance(value, Image.Image)


def image_label(picture: Any) -> str:
    """A short name of a picture that stays the same whatever the run: 'image:' and the first 12 hex digits
    of the SHA-1 of its mode, size and pixels (kept on the picture once computed)."""
    known = picture.info.get("covey_image_id")
    if known is None:
        digest = hashlib.sha1(f"{picture.mode}{picture.size}".encode())
        digest.update(picture.tobytes())
        known = picture.info["covey_image_id"] = f"image:{digest.hexdigest()[:12]}"
    return known


def jsonable(value: Any) -> Any:
    """``json.dumps``' ``default`` for records that hold pictures: a picture is written as its label."""
    if is_image(value):
        return image_label(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def image_parts(prompt: Any) -> list[dict]:
    """The image parts of a chat prompt, in order (none for a plain-string prompt)."""
    if not isinstance(prompt, list):
        return []
    return [part for message in prompt if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]


def prompt_images(prompt: Any) -> list[Any]:
    """The pictures a prepared prompt shows, in order."""
    return [part["image"] for part in image_parts(prompt) if is_image(part.get("image"))]


def has_images(rows: list[dict]) -> bool:
    """Whether the rows bring pictures: an image column, or image parts in a prompt."""
    return bool(rows) and (any(column in rows[0] for column in IMAGE_COLUMNS)
                           or any(image_parts(row.get("prompt")) for row in rows))


def open_image(value: Any, where: str, folder: Path | None = None):
    """A picture from what a dataset holds: a PIL image (as it is), a file path (relative ones also from
    ``folder``, the data file's own), or datasets' {"bytes": ..., "path": ...}; converted to RGB."""
    from PIL import Image

    if is_image(value):
        return value if value.mode == "RGB" else _keep_label(value, value.convert("RGB"))
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        return open_image(Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else value["path"], where,
                          folder)
    if isinstance(value, (str, Path)):
        text = str(value)
        if text.startswith(("http://", "https://")):
            raise DataError(f"{where}: image {text!r} is a URL, and covey opens only files: download it first (or load "
                            "the dataset with datasets, whose Image feature fetches it)")
        path = Path(text).expanduser()
        candidates = [path] if path.is_absolute() or folder is None else [folder / path, path]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise DataError(f"{where}: image file {text!r} does not exist (looked in "
                            f"{', '.join(str(p.parent.resolve()) for p in candidates)})")
        try:
            with Image.open(found) as opened:
                return opened.convert("RGB")
        except OSError as e:
            raise DataError(f"{where}: {found} is not an image file PIL can open ({e})") from None
    raise DataError(f"{where}: an image must be a PIL image, a path to an image file, or datasets' "
                    f"{{'bytes', 'path'}}; got {type(value).__name__} {value!r:.80}")


def _keep_label(before: Any, after: Any) -> Any:
    if "covey_image_id" in before.info:
        after.info["covey_image_id"] = before.info["covey_image_id"]
    return after


def column_images(row: dict, where: str) -> list[Any]:
    """The raw values of a row's image column: [] where it has none (an ``image`` of None)."""
    if "images" in row:
        images = row["images"]
        if images is None:
            return []
        if not isinstance(images, (list, tuple)):
            raise DataError(f"{where}: 'images' must be a list of pictures (one picture goes in an 'image' "
                            f"column), got {type(images).__name__}")
        return list(images)
    return [] if row.get("image") is None else [row["image"]]


def with_images_in_prompts(rows: list[dict], source: str, folder: Path | None = None) -> list[dict]:
    """Rows whose prompts hold their pictures (see the module's description); rows without any picture
    are returned as they are. Plain-string prompts cannot show a picture: such a row is an error."""
    if not has_images(rows):
        return rows
    if all(column in rows[0] for column in IMAGE_COLUMNS):
        raise DataError(f"{source}: the rows have both an 'image' and an 'images' column; keep one (TRL reads "
                        "'images' first)")
    return [_prepared(row, f"{source}, row {i}", folder) for i, row in enumerate(rows)]


def _prepared(row: dict, where: str, folder: Path | None) -> dict:
    pictures = [open_image(value, where, folder) for value in column_images(row, where)]
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if pictures:
            raise DataError(f"{where}: the prompt is plain text, and a picture is shown to a vision-language model "
                            "through its chat template: write the prompt as a chat, such as [{'role': 'user', "
                            "'content': '...'}] (the pictures go before the first user message's text)")
        return row
    if not isinstance(prompt, list):
        return row  # check_rows says what is wrong with it
    messages = [_structured(m) for m in prompt]
    empty = [part for part in image_parts(messages) if not any(part.get(key) is not None for key in IMAGE_KEYS)]
    if not empty and not image_parts(messages) and pictures:  # no placeholder: before the first user text
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first is None:
            raise DataError(f"{where}: the row has pictures and its prompt no user message to show them in")
        message = messages[first]
        messages[first] = {**message, "content": [{"type": "image"} for _ in pictures] + message["content"]}
        empty = image_parts([messages[first]])[:len(pictures)]
    if len(empty) != len(pictures):
        raise DataError(f"{where}: the prompt has {len(empty)} empty image part(s) ({{'type': 'image'}}) and the "
                        f"row's {'images' if 'images' in row else 'image'} column {len(pictures)} picture(s); give "
                        "one picture per image part")
    fill = iter(pictures)
    out = []
    for message in messages:
        if isinstance(message.get("content"), list):
            parts = []
            for part in message["content"]:
                if isinstance(part, dict) and part.get("type") == "image":
                    given = next((part[key] for key in IMAGE_KEYS if part.get(key) is not None), None)
                    picture = next(fill) if given is None else open_image(given, where, folder)
                    part = {"type": "image", "image": picture}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return {**row, "prompt": out}


def _structured(message: Any) -> Any:
    """A message whose content is a string, as a list with one text part (the form image parts need)."""
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return {**message, "content": [{"type": "text", "text": message["content"]}]}
    return message


def content_text(content: Any) -> str:
    """What a message's content says as text: a string as it is; parts as their text, a picture as its label
    in brackets (as the completions tables and the report show which picture a completion answered)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        shown = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                picture = part.get("image")  # a picture, or (read back from completions.jsonl) its label
                shown.append(f"[{image_label(picture) if is_image(picture) else picture or 'image'}]")
            elif isinstance(part, dict) and part.get("type") == "text":
                shown.append(str(part.get("text", "")))
        return " ".join(shown)
    return str(content)


def valid_content(content: Any) -> bool:
    """A message's content as covey takes it: a string, or a list of text and image parts."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and (part.get("type") == "image" or
                                    (part.get("type") == "text" and isinstance(part.get("text"), str)))
        for part in content)
