"""Image inputs: decode a data URL, local file or (opt-in) http(s) URL into an RGB PIL image.

Every bad input raises ImageInputError (a ValueError) whose message can go straight into an
HTTP 400 body. Policy:

- formats: PNG, JPEG (and MPO, the multi-picture JPEG many phone cameras write), WEBP, GIF,
  BMP. Animated GIF/WEBP/PNG give their first frame. Everything else (TIFF, SVG, AVIF, HEIC,
  ICO, PDF, ...) is refused: Pillow only tries the allowed decoders, so no other parser ever
  sees request bytes.
- limits: the encoded size (max_bytes) is checked before decoding, the pixel count
  (max_pixels, against decompression bombs) from the header before the pixels are decoded.
- orientation: the EXIF orientation tag is applied (as transformers' load_image does), so the
  model sees the picture the way a person does.
- colour: to_rgb() follows transformers' convert_to_rgb: anything with alpha (RGBA, LA, PA,
  palette or grey with a transparency key) is composited on white, everything else goes
  through Pillow's convert("RGB") (CMYK, YCbCr, L, 1, P). One deliberate difference:
  16-bit grey (I;16, I) is scaled to 8 bits instead of being clipped to white.
- remote URLs are refused unless allow_remote; then fetched with urllib (timeout, byte cap,
  redirects only to http/https). No address filtering: enable it only where the server may
  reach whatever a client names.

image_digest() hashes decoded RGB pixels + size, so one picture sent as a PNG file and as a
PNG data URL (or re-encoded losslessly) gets one digest: the key of the prefix and encoder
caches.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import urllib.parse
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

# Decoders Pillow may try. JPEG covers MPO, the multi-picture JPEG many phone cameras write.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_BYTES = 20 << 20
DEFAULT_MAX_PIXELS = 64 << 20

# Magic numbers of formats we refuse, so the error can name them instead of saying "corrupt".
_KNOWN_OTHER_FORMATS = (
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"%PDF", "PDF"), (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"), (b"\xff\x0a", "JPEG XL"), (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"qoif", "QOI"), (b"DDS ", "DDS"), (b"P6", "PPM"), (b"P5", "PGM"),
    # allowed formats: a known header on undecodable data means a corrupt file
    (b"\x89PNG", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
)
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")


class ImageInputError(ValueError):
    """An image input the server cannot use; the message is meant for the client."""


# ---------------------------------------------------------------------------------- sources

def load_image(source: str, *, allow_remote: bool = False, allow_local: bool = True,
               max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int = DEFAULT_MAX_PIXELS,
               timeout_s: float = 10.0, local_dir: str | None = None) -> Image.Image:
    """RGB image from a data URL, a file path / file:// URL, or (allow_remote) an http(s) URL.
    allow_local=False refuses every path; local_dir, when set, confines local paths to that
    directory (symlinks resolved; relative paths are taken inside it)."""
    data = read_image_bytes(source, allow_remote=allow_remote, allow_local=allow_local,
                            max_bytes=max_bytes, timeout_s=timeout_s, local_dir=local_dir)
    return decode_image(data, max_pixels=max_pixels)


def parse_image_source(source) -> tuple[str, str]:
    """(kind, value) of an image source, kind one of "data", "remote", "path". The one place
    that tells sources apart: a "path" is anything that is neither a data URL nor http(s)
    (file:// URLs become their path), so no spelling of a path can pass as a URL."""
    if not isinstance(source, str) or not source.strip():
        raise ImageInputError("image source must be a non-empty string (data URL, path or URL)")
    source = source.strip()
    m = _SCHEME.match(source)
    scheme = m.group(1).lower() if m else ""
    if scheme == "data":
        return "data", source
    if scheme in ("http", "https"):
        return "remote", source
    if scheme == "file":
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise ImageInputError("file:// URLs must name a local path (file:///path/to/image.png)")
        return "path", urllib.parse.unquote(parsed.path)
    if scheme and len(scheme) > 1:   # one letter would be a Windows drive, not a scheme
        raise ImageInputError(f"unsupported image URL scheme {scheme!r}; use a data URL")
    return "path", source


def read_image_bytes(source: str, *, allow_remote: bool = False, allow_local: bool = True,
                     max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 10.0,
                     local_dir: str | None = None) -> bytes:
    """The encoded bytes behind an image source (no decoding). A refused source is refused
    before the filesystem or network is touched, with a message that depends only on its kind."""
    kind, value = parse_image_source(source)
    if kind == "data":
        return _data_url_bytes(value, max_bytes)
    if kind == "remote":
        if not allow_remote:
            raise ImageInputError("remote image URLs are disabled on this server; send the image inline "
                                  "as a data URL (data:image/png;base64,...)")
        return _fetch(value, max_bytes, timeout_s)
    if not allow_local:
        raise ImageInputError("local image paths are disabled on this server (start it with --image-dir DIR "
                              "to serve files from DIR); send the image inline as a data: URL")
    return _file_bytes(value, max_bytes, local_dir)


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageInputError("malformed data URL: no ',' before the data")
    params = [p.strip() for p in head[len("data:"):].split(";")]
    mime = params[0].lower()
    is_b64 = any(p.lower() == "base64" for p in params[1:])
    if mime and not mime.startswith("image/") and mime != "application/octet-stream":
        raise ImageInputError(f"data URL media type must be image/*, got {mime!r}")
    if mime in ("image/svg+xml", "image/svg"):
        raise ImageInputError(f"unsupported image format SVG; allowed: {', '.join(_allowed_names())}")
    if not is_b64:   # percent-encoded payload (rare for images, but legal)
        data = urllib.parse.unquote_to_bytes(payload)
        _check_size(len(data), max_bytes)
        return data
    payload = re.sub(r"\s+", "", payload).rstrip("=")
    # Refuse oversized payloads before decoding them (4 base64 chars carry 3 bytes).
    _check_size(len(payload) * 3 // 4, max_bytes)
    payload += "=" * (-len(payload) % 4)
    try:
        alt = b"-_" if ("-" in payload or "_" in payload) else None   # URL-safe alphabet
        data = base64.b64decode(payload, altchars=alt, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("data URL payload is not valid base64") from None
    if not data:
        raise ImageInputError("data URL holds no image data")
    _check_size(len(data), max_bytes)
    return data


def _file_bytes(path: str, max_bytes: int, local_dir: str | None) -> bytes:
    if not path:
        raise ImageInputError("empty image path")
    if "\x00" in path:      # (os functions raise ValueError on it; no file name can hold one)
        raise ImageInputError("image path contains a NUL character")
    if local_dir is not None and not os.path.isabs(path):
        path = os.path.join(local_dir, path)    # relative paths name files in local_dir
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError) as e:       # e.g. a lone surrogate the file system cannot encode
        raise ImageInputError(f"image path is not a valid file name: {e}") from None
    if local_dir is not None:
        root = os.path.realpath(local_dir)
        if os.path.commonpath([root, real]) != root:
            raise ImageInputError("image path is outside the directory this server reads images from")
    if not os.path.exists(real):
        raise ImageInputError(f"image file not found: {path}")
    if not os.path.isfile(real):
        raise ImageInputError(f"image path is not a regular file: {path}")
    try:
        size = os.path.getsize(real)
        _check_size(size, max_bytes)
        with open(real, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ImageInputError(f"cannot read image file {path}: {e.strerror or e}") from None
    _check_size(len(data), max_bytes)
    return data


def _redirect_handler():
    """urllib redirect handler that refuses to leave http/https (urllib alone would follow ftp)."""
    import urllib.request

    class HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if urllib.parse.urlparse(newurl).scheme.lower() not in ("http", "https"):
                raise ImageInputError("the image URL redirected to a non-http(s) location")
            return super().redirect_request(req, fp, code, msg, headers, newurl)
    return HttpOnlyRedirects()


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    import socket
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(_redirect_handler())
    req = urllib.request.Request(url, headers={"User-Agent": "k3jax-image-fetch", "Accept": "image/*"})
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit():
                _check_size(int(length), max_bytes)
            chunks, total = [], 0
            while True:
                chunk = resp.read(min(1 << 16, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    _check_size(total, max_bytes)
    except ImageInputError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageInputError(f"fetching the image URL failed: HTTP {e.code}") from None
    except (urllib.error.URLError, socket.timeout, TimeoutError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ImageInputError(f"could not fetch the image URL: {reason}") from None
    data = b"".join(chunks)
    if not data:
        raise ImageInputError("the image URL returned no data")
    return data


def _check_size(n: int, max_bytes: int) -> None:
    if n > max_bytes:
        raise ImageInputError(f"image is too large: {n} bytes or more (limit {max_bytes} bytes)")


def _allowed_names():
    return list(ALLOWED_FORMATS)


# ---------------------------------------------------------------------------------- decoding

def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Encoded bytes -> RGB image (first frame, EXIF orientation applied)."""
    if not data:
        raise ImageInputError("empty image data")
    try:
        with warnings.catch_warnings():
            # We enforce our own pixel limit below; Pillow's warning would only be noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        raise ImageInputError(_unidentified_message(data)) from None
    except Image.DecompressionBombError:
        raise ImageInputError(f"image has too many pixels (limit {max_pixels})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageInputError(f"image data is corrupt: {e}") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageInputError(f"image has an empty size {w}x{h}")
    if w * h > max_pixels:
        raise ImageInputError(f"image is too large: {w}x{h} = {w * h} pixels (limit {max_pixels})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
    except Image.DecompressionBombError:
        raise ImageInputError(f"image has too many pixels (limit {max_pixels})") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, MemoryError) as e:
        raise ImageInputError(f"image data is corrupt or truncated ({img.format}): {e}") from None
    try:
        img = ImageOps.exif_transpose(img)
    except Exception:   # noqa: BLE001 - a broken EXIF block must not fail a readable image
        pass
    return to_rgb(img)


def _unidentified_message(data: bytes) -> str:
    head = data[:64]
    stripped = head.lstrip()
    if stripped.startswith((b"<svg", b"<?xml", b"<!DOCTYPE svg")):
        name = "SVG"
    elif head[4:8] == b"ftyp":
        brand = head[8:12].decode("ascii", "replace").strip()
        name = "AVIF" if brand.startswith("avi") else "HEIF/HEIC" if brand.startswith(("hei", "mif", "hev")) \
            else f"ISO media ({brand})"
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        name = "WEBP"
    else:
        name = next((n for magic, n in _KNOWN_OTHER_FORMATS if head.startswith(magic)), None)
    allowed = ", ".join(_allowed_names())
    if name in ALLOWED_FORMATS:   # right magic number, wrong body
        return f"image data is corrupt: cannot decode this {name} file"
    if name:
        return f"unsupported image format {name}; allowed: {allowed}"
    return f"image data is corrupt or not an image (allowed formats: {allowed})"


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB version of img: alpha composited on white (as transformers' convert_to_rgb does)."""
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        import numpy as np
        # 16-bit grey: keep the top 8 bits (Pillow's own convert would clip everything >255).
        a = np.asarray(img.convert("I"), dtype=np.int64)
        img = Image.fromarray((np.clip(a, 0, 65535) >> 8).astype(np.uint8), "L")
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


# ---------------------------------------------------------------------------------- digest

def image_digest(image: Image.Image | bytes | bytearray | memoryview) -> str:
    """Stable hex SHA-256 of the decoded RGB pixels and size (encoded bytes are decoded first)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        img = decode_image(bytes(image))
    elif isinstance(image, Image.Image):
        img = to_rgb(image)
    else:
        raise TypeError(f"image_digest takes a PIL image or encoded bytes, not {type(image).__name__}")
    w, h = img.size
    hasher = hashlib.sha256()
    hasher.update(f"k3jax-rgb8:{w}x{h}:".encode())
    hasher.update(img.tobytes())
    return hasher.hexdigest()
