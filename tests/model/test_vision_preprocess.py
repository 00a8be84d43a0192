"""Image loading (k3jax.vision.media) and preprocessing (k3jax.vision.preprocess).

Golden reference: transformers' real Kimi_K25ImageProcessor, run in a subprocess. It is a
TorchvisionBackend processor; when torchvision is not importable (the CPU test environment
has no working CPU wheel), the subprocess gets a stand-in `torchvision` package whose few
tensor ops are the calls torchvision 0.28 makes on CPU (resize of a uint8 tensor =
torch.nn.functional.interpolate(uint8, antialias=True); pad; normalize = sub/div in float32).
Everything else (navit_resize, grouping, padding, fused normalization, patchify, grids,
convert_to_rgb) is transformers' own code. The resize kernel itself is also checked directly
against torch.
"""
from __future__ import annotations

import base64
import http.server
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from PIL import Image

from k3jax.vision.media import (ImageInputError, decode_image, image_digest, load_image,
                                read_image_bytes, to_rgb)
from k3jax.vision.preprocess import (ImageProcessorConfig, grid_for_size, image_placeholder_ids,
                                     image_placeholder_text, num_image_tokens, preprocess,
                                     resize_plan, resize_uint8)

HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="torch/transformers not installed")


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _noise(h, w, seed, channels=3):
    rng = np.random.default_rng(seed)
    shape = (h, w, channels) if channels > 1 else (h, w)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def _smooth(h, w):
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    return np.stack([127 + 127 * np.sin(x / 13.0 + y / 7.0), x * 255 / max(w - 1, 1),
                     y * 255 / max(h - 1, 1)], -1).round().astype(np.uint8)


# ------------------------------------------------------------------------------ golden cases

def _golden_images():
    """(name, PIL image) fixtures: sizes across every resize branch, plus non-RGB modes."""
    cases = [
        ("tiny_1x1", Image.fromarray(_noise(1, 1, 1))),
        ("tiny_5x3", Image.fromarray(_noise(5, 3, 2))),
        ("one_patch", Image.fromarray(_noise(14, 14, 3))),
        ("odd_37x53", Image.fromarray(_noise(37, 53, 4))),
        ("odd_333x517", Image.fromarray(_smooth(333, 517))),
        ("wide_200x1000", Image.fromarray(_noise(200, 1000, 5))),
        ("tall_1000x200", Image.fromarray(_smooth(1000, 200))),
        ("budget_edge_1792", Image.fromarray(_noise(1792, 1792, 6))),       # 128x128 patches: no resize
        ("over_budget_2000x1800", Image.fromarray(_smooth(2000, 1800))),    # patch budget scales it
        ("over_side_300x7300", Image.fromarray(_noise(300, 7300, 7))),      # > 512 patches on one side
        ("same_shape_again", Image.fromarray(_noise(37, 53, 8))),           # regroups with odd_37x53
        ("rgba", Image.fromarray(_noise(45, 61, 9, channels=4), "RGBA")),
        ("la", Image.fromarray(_noise(30, 20, 10, channels=2), "LA")),
        ("grey_l", Image.fromarray(_noise(29, 31, 11, channels=1), "L")),
    ]
    p = Image.fromarray(_noise(33, 47, 12, channels=1) % 16, "P")
    p.putpalette(list(_noise(16, 3, 13).ravel()))
    p.info["transparency"] = 3
    cases.append(("palette_transparent", p))
    cases.append(("cmyk", Image.fromarray(_noise(26, 40, 14, channels=4), "CMYK")))
    return cases


# Processor settings checked: transformers' defaults, and a custom one that makes small
# images hit both limits, with CLIP mean/std (exercises float32 rounding of the fused
# normalization) and bilinear resampling.
HF_CONFIGS = {
    "default": {},
    "custom": {"max_patches": 300, "size": {"max_height": 20, "max_width": 20}, "resample": 2,
               "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]},
}

# torchvision stand-in (see the module docstring): only what transformers imports and calls.
_TV_STUB = {
    "torchvision/__init__.py": '__version__ = "0.28.0"\nfrom torchvision import io\n',
    "torchvision/io.py": "",
    "torchvision/transforms/__init__.py": "from torchvision.transforms.v2.functional import InterpolationMode\n",
    "torchvision/transforms/functional.py": textwrap.dedent('''\
        import numpy as np, torch
        from torchvision.transforms.v2.functional import InterpolationMode
        def pil_to_tensor(pic):
            return torch.from_numpy(np.array(pic)).permute(2, 0, 1).contiguous()
        '''),
    "torchvision/transforms/v2/__init__.py": "",
    "torchvision/transforms/v2/functional.py": textwrap.dedent('''\
        import enum, torch
        import torch.nn.functional as F

        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            NEAREST_EXACT = "nearest-exact"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"
            BOX = "box"
            HAMMING = "hamming"
            LANCZOS = "lanczos"

        def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
            # torchvision 0.28 resize_image on CPU: same size -> the input itself; uint8 goes
            # straight to interpolate for bilinear/bicubic (native uint8 kernels)
            assert interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)
            assert image.dtype == torch.uint8
            shape, (h, w) = image.shape, size
            if (h, w) == tuple(shape[-2:]):
                return image
            out = F.interpolate(image.reshape(-1, *shape[-3:]), size=[h, w], mode=interpolation.value,
                                align_corners=False, antialias=antialias)
            return out.reshape(*shape[:-2], h, w)

        def pad(image, padding, fill=0, padding_mode="constant"):
            left, top, right, bottom = padding
            assert padding_mode == "constant"
            return F.pad(image, [left, right, top, bottom], mode="constant", value=fill)

        def normalize(image, mean, std, inplace=False):
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return (image if inplace else image.clone()).sub_(mean).div_(std)

        def grayscale_to_rgb(image):
            return image if image.shape[-3] == 3 else image.expand(*image.shape[:-3], 3, *image.shape[-2:])
        '''),
}

_HF_DRIVER = textwrap.dedent('''\
    import json, sys, types
    import numpy as np
    from PIL import Image
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor, navit_resize
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor

    work = sys.argv[1]
    spec = json.load(open(f"{work}/spec.json"))
    images = [Image.open(f"{work}/{name}.{ext}") for name, ext in spec["images"]]
    for im in images:
        im.load()
    result, arrays = {"configs": {}}, {}
    for cname, kwargs in spec["configs"].items():
        proc = Kimi_K25ImageProcessor(**kwargs)
        out = proc(images, return_tensors="np")
        arrays[f"{cname}_pixels"] = out["pixel_values"]
        arrays[f"{cname}_grid"] = out["image_grid_thw"]
        # processing_kimi_k25's own expansion of one <|media_pad|> per image
        fake = types.SimpleNamespace(image_processor=proc, image_token="<|media_pad|>")
        pads = [Kimi_K25Processor.replace_image_token(fake, {"image_grid_thw": out["image_grid_thw"]}, i)
                .count("<|media_pad|>") for i in range(len(images))]
        counted = [proc.get_number_of_image_patches(im.height, im.width) // proc.merge_size ** 2 for im in images]
        result["configs"][cname] = {"to_dict": proc.to_dict(), "pads": pads, "counted": counted}
    result["navit"] = [list(navit_resize(h, w, 14, 2, 16384, 512)) for h, w in spec["sizes"]]
    np.savez(f"{work}/out.npz", **arrays)
    json.dump(result, open(f"{work}/out.json", "w"), default=str)
''')


def _plan_sizes():
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (1, 20000), (20000, 1), (13, 13), (14, 14), (27, 29), (28, 28), (1792, 1792),
             (1793, 1792), (7168, 7168), (7169, 3), (100000, 50), (3000, 4000), (4032, 3024)]
    sizes += [tuple(int(v) for v in rng.integers(1, 12000, 2)) for _ in range(400)]
    sizes += [tuple(int(v) for v in rng.integers(1, 200, 2)) for _ in range(200)]
    return sizes


@pytest.fixture(scope="module")
def hf_golden(tmp_path_factory):
    if not HAVE_HF:
        pytest.skip("torch/transformers not installed")
    work = tmp_path_factory.mktemp("kimi_k25_golden")
    names = []
    for name, img in _golden_images():
        ext = "jpg" if img.mode == "CMYK" else "png"
        img.save(work / f"{name}.{ext}")
        names.append((name, ext))
    (work / "spec.json").write_text(json.dumps({"images": names, "configs": HF_CONFIGS,
                                                "sizes": _plan_sizes()}))
    env = dict(os.environ)
    real_tv = importlib.util.find_spec("torchvision") is not None and subprocess.run(
        [sys.executable, "-c", "import torchvision.transforms.v2.functional"], capture_output=True).returncode == 0
    if not real_tv:
        stub = work / "tv_stub"
        for rel, text in _TV_STUB.items():
            (stub / rel).parent.mkdir(parents=True, exist_ok=True)
            (stub / rel).write_text(text)
        env["PYTHONPATH"] = os.pathsep.join([str(stub)] + [p for p in [env.get("PYTHONPATH")] if p])
    (work / "driver.py").write_text(_HF_DRIVER)
    run = subprocess.run([sys.executable, str(work / "driver.py"), str(work)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    arrays = dict(np.load(work / "out.npz"))
    meta = json.loads((work / "out.json").read_text())
    images = [Image.open(work / f"{n}.{e}") for n, e in names]
    return {"images": images, "names": [n for n, _ in names], "arrays": arrays, "meta": meta,
            "real_torchvision": real_tv}


@needs_hf
@pytest.mark.parametrize("cname", sorted(HF_CONFIGS))
def test_pixels_and_grids_match_transformers(hf_golden, cname):
    meta = hf_golden["meta"]["configs"][cname]
    cfg = ImageProcessorConfig.from_dict(meta["to_dict"])    # transformers' own saved settings
    pixels, grid = preprocess(hf_golden["images"], cfg)
    ref_pixels = hf_golden["arrays"][f"{cname}_pixels"]
    ref_grid = hf_golden["arrays"][f"{cname}_grid"]
    assert grid.dtype == np.int64 and pixels.dtype == np.float32
    assert grid.tolist() == ref_grid.tolist()
    assert pixels.shape == ref_pixels.shape
    # per image, so a failure names the case
    start = 0
    for name, g in zip(hf_golden["names"], grid):
        n = int(np.prod(g))
        err = np.abs(pixels[start:start + n] - ref_pixels[start:start + n]).max()
        assert err == 0.0, f"{cname}/{name}: max abs err {err}"
        start += n
    # resizing really happened in both settings (not just padding)
    resized = [resize_plan(im.height, im.width, cfg)[0] != (im.height, im.width) for im in hf_golden["images"]]
    assert sum(resized) == (2 if cname == "default" else 6)


@needs_hf
@pytest.mark.parametrize("cname", sorted(HF_CONFIGS))
def test_placeholder_counts_match_transformers(hf_golden, cname):
    meta = hf_golden["meta"]["configs"][cname]
    cfg = ImageProcessorConfig.from_dict(meta["to_dict"])
    grids = hf_golden["arrays"][f"{cname}_grid"]
    mine = [num_image_tokens(g, cfg.merge_size) for g in grids]
    assert mine == meta["pads"] == meta["counted"]
    assert [num_image_tokens(grid_for_size(im.height, im.width, cfg)) for im in hf_golden["images"]] == mine


@needs_hf
def test_resize_plan_matches_transformers_navit_resize(hf_golden):
    ref = hf_golden["meta"]["navit"]
    mine = [[list(x) for x in resize_plan(h, w)] for h, w in _plan_sizes()]
    assert mine == ref


def test_config_from_transformers_dict_and_defaults():
    c = ImageProcessorConfig()
    assert (c.patch_size, c.merge_size, c.max_patches, c.max_patches_per_side) == (14, 2, 16384, 512)
    assert c.image_mean == (0.5, 0.5, 0.5) and c.image_std == (0.5, 0.5, 0.5) and c.resample == "bicubic"
    hf = {"patch_size": 16, "merge_size": 2, "max_patches": 4096, "size": {"max_height": 64, "max_width": 64},
          "resample": 2, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6],
          "rescale_factor": 0.5, "image_processor_type": "Kimi_K25ImageProcessor"}
    c = ImageProcessorConfig.from_dict(hf)
    assert (c.patch_size, c.max_patches, c.max_patches_per_side, c.resample) == (16, 4096, 64, "bilinear")
    assert c.image_mean == (0.1, 0.2, 0.3) and c.image_std == (0.4, 0.5, 0.6) and c.rescale_factor == 0.5
    with pytest.raises(ValueError, match="max_height"):
        ImageProcessorConfig.from_dict({"size": {"max_height": 64, "max_width": 32}})
    with pytest.raises(ValueError, match="resample"):
        ImageProcessorConfig.from_dict({"resample": 1})
    with pytest.raises(ValueError, match="image_std"):
        ImageProcessorConfig(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="patch_size"):
        ImageProcessorConfig(patch_size=0)


def test_config_from_moonshot_media_proc_cfg(tmp_path):
    assert ImageProcessorConfig.from_checkpoint_dir(tmp_path) == ImageProcessorConfig()   # no file: defaults
    cfg = {"media_proc_cfg": {"in_patch_limit": 65536, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                              "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": [2, 2],
                              "patch_limit_on_one_side": 256, "fixed_output_tokens": None,
                              "in_patch_limit_each_frame": 4096, "config_type": "video_chunk"}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    c = ImageProcessorConfig.from_checkpoint_dir(tmp_path)
    assert (c.max_patches, c.merge_size, c.max_patches_per_side, c.patch_size) == (65536, 2, 256, 14)


# ------------------------------------------------------------------------------ resize kernel

@needs_hf
def test_resize_uint8_is_bit_exact_with_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    from k3jax.vision.preprocess import _resize_axis0
    rng = np.random.default_rng(7)
    pairs = [((300, 500), (150, 250)), ((1000, 200), (333, 67)), ((57, 91), (40, 60)), ((64, 64), (100, 100)),
             ((100, 37), (41, 23)), ((800, 1200), (799, 1199)), ((83, 244), (201, 1)), ((5, 300), (1, 2))]
    pairs += [((int(a), int(b)), (int(c), int(d))) for a, b, c, d in rng.integers(1, 260, (30, 4))]
    for mode in ("bicubic", "bilinear"):
        for (h, w), (nh, nw) in pairs:
            if (nh, nw) == (1, 1):
                continue   # torch's AVX uint8 kernel asserts on a 1x1 output
            img = _noise(h, w, h * 1000 + w) if (h + w) % 2 else _smooth(h, w)
            ref = F.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None].contiguous(), size=[nh, nw],
                                mode=mode, align_corners=False, antialias=True)[0].permute(1, 2, 0).numpy()
            got = resize_uint8(img, nh, nw, mode)
            assert got.dtype == np.uint8 and got.shape == (nh, nw, 3)
            assert np.array_equal(got, ref), f"{mode} {(h, w)}->{(nh, nw)}: {np.abs(got.astype(int) - ref).max()}"
    # the scipy-free fallback gives the same bytes
    img = _noise(123, 77, 3)
    assert np.array_equal(_resize_axis0(img, 50, "bicubic", use_scipy=False), _resize_axis0(img, 50, "bicubic"))


def test_pil_resize_backend_and_normalization():
    img = Image.fromarray(_smooth(700, 900))
    cfg = ImageProcessorConfig(max_patches=400, resize_backend="pil")
    pixels, grid = preprocess([img], cfg)
    (nh, nw), (ph, pw) = resize_plan(700, 900, cfg)
    assert (nh, nw) != (700, 900) and grid.tolist() == [[1, ph // 14, pw // 14]]
    ref = np.zeros((ph, pw, 3), np.uint8)
    ref[:nh, :nw] = np.asarray(img.resize((nw, nh), Image.Resampling.BICUBIC))
    ref = (ref.astype(np.float32) / 255 - 0.5) / 0.5
    patches = ref.reshape(ph // 14, 14, pw // 14, 14, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, 14, 14)
    assert np.abs(pixels - patches).max() <= 1e-6
    # padding is normalized zero bytes: -1 with mean = std = 0.5
    assert pixels.reshape(ph // 14, pw // 14, 3, 14, 14)[-1, -1, :, -1, -1].tolist() == [-1.0, -1.0, -1.0]


def test_preprocess_layout_and_inputs():
    # a 28x56 image needs no resize or padding: patch (i, j) is the (i, j) 14x14 block
    arr = _noise(28, 56, 21)
    pixels, grid = preprocess([arr, Image.fromarray(arr)])
    assert grid.tolist() == [[1, 2, 4], [1, 2, 4]]
    expect = (arr.astype(np.float32) - 127.5) / 127.5
    for i in range(2):
        for j in range(4):
            block = expect[i * 14:(i + 1) * 14, j * 14:(j + 1) * 14].transpose(2, 0, 1)
            assert np.array_equal(pixels[i * 4 + j], block) and np.array_equal(pixels[8 + i * 4 + j], block)
    empty_pixels, empty_grid = preprocess([])
    assert empty_pixels.shape == (0, 3, 14, 14) and empty_grid.shape == (0, 3)
    with pytest.raises(ValueError, match="uint8"):
        preprocess([arr.astype(np.float32)])


def test_placeholder_text_and_ids():
    from k3jax.tokenizer import KimiTokenizer
    assert image_placeholder_text(3) == ("<|media_begin|>image<|media_content|>"
                                         "<|media_pad|><|media_pad|><|media_pad|><|media_end|>")
    assert image_placeholder_text(1, original_size=(640, 480)) == (
        "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>")
    tok = KimiTokenizer.tiny()
    for n, size in ((5, None), (2, (31, 7))):
        ids = image_placeholder_ids(n, tok, original_size=size)
        assert ids == tok.encode(image_placeholder_text(n, original_size=size), allow_special=True)
        assert ids.count(tok.id_of("<|media_pad|>")) == n
    with pytest.raises(ValueError):
        image_placeholder_text(0)
    assert num_image_tokens((1, 16, 72)) == 288 and num_image_tokens((1, 4, 4)) == 4


# ------------------------------------------------------------------------------ media: sources

def test_data_url_file_and_file_url_load_same_pixels(tmp_path):
    arr = _noise(17, 23, 31)
    data = _png(Image.fromarray(arr))
    path = tmp_path / "a.png"
    path.write_bytes(data)
    for src in (_data_url(data), str(path), f"file://{path}", "  " + _data_url(data) + "\n"):
        img = load_image(src)
        assert img.mode == "RGB" and np.array_equal(np.asarray(img), arr), src[:30]
    # base64 split over lines, URL-safe alphabet and missing padding are tolerated
    b64 = base64.b64encode(data).decode()
    assert np.array_equal(np.asarray(load_image("data:image/png;base64," + "\n".join(
        b64[i:i + 60] for i in range(0, len(b64), 60)))), arr)
    assert np.array_equal(np.asarray(load_image("data:image/png;base64," +
                                                base64.urlsafe_b64encode(data).decode().rstrip("="))), arr)


def test_local_dir_confines_paths(tmp_path):
    inside = tmp_path / "imgs"
    inside.mkdir()
    (inside / "ok.png").write_bytes(_png(Image.fromarray(_noise(4, 4, 1))))
    (tmp_path / "secret.png").write_bytes(_png(Image.fromarray(_noise(4, 4, 2))))
    os.symlink(tmp_path / "secret.png", inside / "link.png")
    assert load_image(str(inside / "ok.png"), local_dir=str(inside)).size == (4, 4)
    assert load_image("ok.png", local_dir=str(inside)).size == (4, 4)      # relative: inside local_dir
    for bad in (str(tmp_path / "secret.png"), str(inside / ".." / "secret.png"), str(inside / "link.png"),
                "../secret.png", f"file://{tmp_path / 'secret.png'}", str(tmp_path / "nonexistent.png")):
        with pytest.raises(ImageInputError, match="outside the directory"):
            load_image(bad, local_dir=str(inside))


def test_paths_refused_when_local_reads_are_off(tmp_path, monkeypatch):
    """allow_local=False: no spelling of a path reaches the filesystem (a path traversal)."""
    from k3jax.vision.media import parse_image_source
    (tmp_path / "https").mkdir()
    (tmp_path / "secret.png").write_bytes(_png(Image.fromarray(_noise(4, 4, 2))))
    monkeypatch.chdir(tmp_path / "https")
    for src in ("https/../secret.png", "../secret.png", "data/../secret.png", "httpsfoo/../../secret.png",
                str(tmp_path / "secret.png"), f"file://{tmp_path / 'secret.png'}", "C:/secret.png", "missing.png"):
        assert parse_image_source(src)[0] == "path", src
        with pytest.raises(ImageInputError, match="local image paths are disabled"):
            load_image(src, allow_local=False)
    assert parse_image_source("HTTPS://x/y.png") == ("remote", "HTTPS://x/y.png")
    assert parse_image_source(" data:image/png;base64,AA ")[0] == "data"
    assert load_image("../secret.png").size == (4, 4)      # the offline API's default reads paths


@pytest.mark.parametrize("source, match", [
    ("", "non-empty"),
    ("/nonexistent/dir/x.png", "not found"),
    ("ftp://example.com/x.png", "unsupported image URL scheme"),
    ("http://127.0.0.1:9/x.png", "remote image URLs are disabled"),
    ("https://example.com/x.png", "remote image URLs are disabled"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo$", "not valid base64"),
    ("data:image/png;base64", "no ','"),
    ("data:text/plain;base64,aGVsbG8=", "must be image/"),
    ("data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=", "SVG"),
    ("data:image/png;base64,", "no image data"),
])
def test_bad_sources(source, match):
    with pytest.raises(ImageInputError, match=match) as e:
        load_image(source)
    assert isinstance(e.value, ValueError)


def test_directory_is_not_an_image(tmp_path):
    with pytest.raises(ImageInputError, match="not a regular file"):
        load_image(str(tmp_path))


def test_byte_limit_is_exact_for_data_urls():
    for extra in range(3):     # payload lengths with 0, 1 and 2 padding characters
        data = _png(Image.fromarray(_noise(8, 8, 60))) + b"\0" * extra   # PNG ignores trailing bytes
        assert load_image(_data_url(data), max_bytes=len(data)).size == (8, 8)
        with pytest.raises(ImageInputError, match="too large"):
            load_image(_data_url(data), max_bytes=len(data) - 1)


def test_byte_limits(tmp_path):
    data = _png(Image.fromarray(_noise(64, 64, 5)))
    assert len(data) > 10000
    path = tmp_path / "big.png"
    path.write_bytes(data)
    for src in (_data_url(data), str(path)):
        with pytest.raises(ImageInputError, match="too large.*limit 10000 bytes"):
            load_image(src, max_bytes=10000)
        assert load_image(src, max_bytes=len(data)).size == (64, 64)


# ------------------------------------------------------------------------------ media: decoding

def test_corrupt_and_unsupported_data():
    good = _png(Image.fromarray(_noise(50, 50, 6)))
    tiff = _encode(Image.fromarray(_noise(8, 8, 7)), "TIFF")
    cases = [
        (os.urandom(2000), "corrupt or not an image"),
        (good[:len(good) // 2], "corrupt"),                      # truncated PNG
        (good[:40], "corrupt"),                                  # header only
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 50, "corrupt"),
        (tiff, "unsupported image format TIFF"),
        (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "unsupported image format SVG"),
        (b"%PDF-1.4\n", "unsupported image format PDF"),
        (b"", "empty"),
    ]
    for data, match in cases:
        with pytest.raises(ImageInputError, match=match):
            decode_image(data)
        if data:
            with pytest.raises(ImageInputError, match=match):
                load_image(_data_url(data))


def test_pixel_limit_stops_decompression_bombs():
    # 10000 x 10000 one-bit image: a few kB of PNG, 100 Mpx (300 MB as RGB) once decoded
    bomb = _png(Image.new("1", (10000, 10000)), optimize=True)
    assert len(bomb) < 200_000
    with pytest.raises(ImageInputError, match="too large: 10000x10000"):
        load_image(_data_url(bomb))
    small = _png(Image.fromarray(_noise(100, 80, 8)))
    with pytest.raises(ImageInputError, match="8000 pixels .limit 7999"):
        decode_image(small, max_pixels=7999)
    assert decode_image(small, max_pixels=8000).size == (80, 100)


def test_formats_and_first_frame():
    arr = _noise(20, 30, 9)
    img = Image.fromarray(arr)
    for fmt in ("PNG", "BMP", "WEBP"):
        kw = {"lossless": True} if fmt == "WEBP" else {}
        assert np.array_equal(np.asarray(decode_image(_encode(img, fmt, **kw))), arr), fmt
    smooth = _smooth(20, 30)
    jpeg = decode_image(_encode(Image.fromarray(smooth), "JPEG", quality=95))
    assert jpeg.size == (30, 20) and np.abs(np.asarray(jpeg).astype(int) - smooth).mean() < 4
    # animated GIF: the first frame
    frames = [Image.fromarray(np.full((10, 12, 3), v, np.uint8)) for v in (10, 200)]
    gif = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    assert np.asarray(decode_image(gif))[0, 0].tolist() == [10, 10, 10]
    # MPO (multi-picture JPEG from phone cameras) is read as its first picture
    mpo = _encode(frames[0], "MPO", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    assert np.abs(np.asarray(decode_image(mpo)).astype(int) - 10).max() <= 2


def test_exif_orientation_is_applied():
    img = Image.fromarray(_smooth(20, 40))
    exif = Image.Exif()
    exif[0x0112] = 6   # rotate 90 degrees clockwise to display
    out = decode_image(_encode(img, "JPEG", exif=exif, quality=95))
    assert out.size == (20, 40)
    ref = np.asarray(img.transpose(Image.Transpose.ROTATE_270)).astype(int)
    assert np.abs(np.asarray(out).astype(int) - ref).mean() < 3


def test_colour_conversions():
    # RGBA: alpha composited on white
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (200, 100, 50, 255)      # opaque
    rgba[0, 1] = (200, 100, 50, 0)        # transparent -> white
    rgba[0, 2] = (0, 0, 0, 128)           # half black over white
    out = np.asarray(decode_image(_png(Image.fromarray(rgba, "RGBA"))))
    assert out[0, 0].tolist() == [200, 100, 50] and out[0, 1].tolist() == [255, 255, 255]
    assert all(abs(v - 127) <= 1 for v in out[0, 2])
    # LA
    la = np.array([[[10, 255], [10, 0]]], np.uint8)
    assert np.asarray(decode_image(_png(Image.fromarray(la, "LA")))).tolist() == [[[10] * 3, [255] * 3]]
    # palette with a transparent index (GIF)
    p = Image.fromarray(np.array([[0, 1]], np.uint8), "P")
    p.putpalette([1, 2, 3, 4, 5, 6] + [0] * 762)
    gif = _encode(p, "GIF", transparency=1)
    assert np.asarray(decode_image(gif)).tolist() == [[[1, 2, 3], [255, 255, 255]]]
    # L and 1-bit
    grey = np.array([[0, 77, 255]], np.uint8)
    assert np.asarray(decode_image(_png(Image.fromarray(grey, "L")))).tolist() == [[[0] * 3, [77] * 3, [255] * 3]]
    # 16-bit grey keeps its top byte (Pillow's convert would clip it to white)
    g16 = np.array([[0, 0x1234, 0xFFFF]], np.uint16)
    img16 = Image.open(io.BytesIO(_png(Image.fromarray(g16))))
    assert img16.mode.startswith("I")
    assert np.asarray(to_rgb(img16)).tolist() == [[[0] * 3, [0x12] * 3, [0xFF] * 3]]
    # CMYK JPEG
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))   # pure red
    red = np.asarray(decode_image(_encode(cmyk, "JPEG", quality=100)))
    assert red.shape == (4, 4, 3) and red[..., 0].min() > 240 and red[..., 1:].max() < 15


# ------------------------------------------------------------------------------ digest

def test_digest_is_about_pixels(tmp_path):
    arr = _noise(21, 19, 40)
    img = Image.fromarray(arr)
    png, bmp = _png(img), _encode(img, "BMP")
    webp = _encode(img, "WEBP", lossless=True)
    path = tmp_path / "x.png"
    path.write_bytes(png)
    d = image_digest(img)
    assert len(d) == 64 and int(d, 16) >= 0
    assert d == image_digest(png) == image_digest(bmp) == image_digest(webp) \
        == image_digest(load_image(_data_url(png))) == image_digest(load_image(str(path))) \
        == image_digest(bytearray(png))
    assert image_digest(Image.fromarray(arr).convert("RGBA")) == d          # opaque alpha: same picture
    changed = arr.copy()
    changed[5, 5, 1] ^= 1
    assert image_digest(Image.fromarray(changed)) != d
    assert image_digest(Image.fromarray(arr.reshape(19, 21, 3))) != d       # same bytes, other shape
    assert image_digest(Image.fromarray(_noise(21, 19, 41))) != d
    with pytest.raises(TypeError):
        image_digest("not an image")
    with pytest.raises(ImageInputError):
        image_digest(b"garbage")


# ------------------------------------------------------------------------------ remote (loopback only)

@pytest.fixture
def image_server():
    png = _png(Image.fromarray(_noise(9, 11, 50)))
    big = _png(Image.fromarray(_noise(300, 300, 51)))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            routes = {"/a.png": png, "/big.png": big}
            if self.path.startswith("/redirect"):
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/x.png" if self.path == "/redirect-ftp"
                                 else "file:///etc/passwd")
                self.end_headers()
                return
            body = routes.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            if self.path != "/big.png":          # big.png: no length, the byte cap must stop it
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", png
    finally:
        server.shutdown()
        server.server_close()


def test_remote_fetch_when_allowed(image_server):
    base, png = image_server
    with pytest.raises(ImageInputError, match="disabled"):
        load_image(f"{base}/a.png")
    img = load_image(f"{base}/a.png", allow_remote=True, timeout_s=5)
    assert image_digest(img) == image_digest(png)
    with pytest.raises(ImageInputError, match="HTTP 404"):
        load_image(f"{base}/missing.png", allow_remote=True, timeout_s=5)
    with pytest.raises(ImageInputError, match="too large"):
        read_image_bytes(f"{base}/big.png", allow_remote=True, max_bytes=5000, timeout_s=5)
    with pytest.raises(ImageInputError, match="too large"):
        read_image_bytes(f"{base}/a.png", allow_remote=True, max_bytes=len(png) - 1, timeout_s=5)
    # redirects stay on http(s): urllib refuses file:// itself, our handler refuses ftp://
    with pytest.raises(ImageInputError, match="HTTP 302"):
        load_image(f"{base}/redirect-file", allow_remote=True, timeout_s=5)
    with pytest.raises(ImageInputError, match="non-http"):
        load_image(f"{base}/redirect-ftp", allow_remote=True, timeout_s=5)
