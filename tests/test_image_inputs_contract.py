"""Uploaded images at the edge: every bad input is a 400 naming its field, before queueing;
good ones are decoded, converted and resized in the Ingress (no Ray, no model)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from pipeline.contract.edits import validate_edit_request
from pipeline.contract.limits import ServingLimits
from pipeline.contract.uploads import to_rgb
from pipeline.contract.videos import validate_video_request
from pipeline.errors import InvalidRequestError
from pipeline.modes import InputMode
from pipeline.sampling import resolve_edit, resolve_video
from pipeline.signature import BatchSignature

FLUX = ServingLimits("tiny-flux", 16, 64, 64, 8, 3.5, max_pixels=128 * 128, max_input_pixels=128 * 128,
                     input_modes=(InputMode.IMAGE_TO_IMAGE, InputMode.INPAINT))
KONTEXT = ServingLimits("tiny-flux-kontext", 16, 64, 64, 8, 3.5, max_pixels=128 * 128, max_input_pixels=128 * 128,
                        input_modes=(InputMode.REFERENCE,))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def picture(size=(64, 64), mode="RGB", color=(200, 40, 40)) -> bytes:
    return encoded(Image.new(mode, size, color))


NOISE_PNG = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))


def mask_png(size=(64, 64), transparent_right=True) -> bytes:
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    if transparent_right:
        mask.paste((0, 0, 0, 0), (size[0] // 2, 0, size[0], size[1]))
    return encoded(mask)


def edit(body: dict, limits: ServingLimits = FLUX):
    return resolve_edit(validate_edit_request({"prompt": "a blue square", **body}, limits), limits)


def refused(body: dict, limits: ServingLimits = FLUX) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        edit(body, limits)
    return info.value


def test_an_edit_resolves_to_image_to_image_or_inpainting_with_decoded_arrays():
    p = edit({"image": picture(), "strength": 0.5, "seed": 1})
    assert p.input_mode == InputMode.IMAGE_TO_IMAGE and p.strength == 0.5 and p.effective_steps == 4
    assert p.images[0].array().shape == (64, 64, 3) and p.mask is None
    assert tuple(p.images[0].array()[0, 0]) == (200, 40, 40)
    q = edit({"image": picture(), "mask": mask_png()})
    assert q.input_mode == InputMode.INPAINT and q.strength == 1.0  # inpainting repaints by default
    alpha = q.mask.array()[..., 0]
    assert alpha[:, :32].min() == 255 and alpha[:, 32:].max() == 0
    assert edit({"image": picture()}).strength == FLUX.default_strength
    # the mode and strength are in the signature; the images are not
    a, b = edit({"image": picture(color=(0, 0, 0))}), edit({"image": picture(color=(255, 255, 255))})
    assert BatchSignature.of(a) == BatchSignature.of(b) != BatchSignature.of(q)
    assert "image_to_image strength=5/8 " in str(BatchSignature.of(a))  # 0.6 of 8 steps runs 5


def test_strengths_that_run_the_same_steps_share_a_signature():
    """An edit's ``strength`` is keyed by the steps it runs (diffusers skips int(N − N·strength))."""
    def sig(strength, steps=8):
        return BatchSignature.of(edit({"image": picture(), "strength": strength, "num_inference_steps": steps}))

    assert sig(0.6) == sig(0.55) != sig(0.5)  # int(8 − 4.8) = int(8 − 4.4) = 3 skipped: 5 of 8 run; 0.5: 4
    assert sig(1.0) == sig(0.95) != sig(1.0, steps=7)
    assert "image_to_image strength=4/8 " in str(sig(0.5))


def test_output_size_follows_size_or_the_image():
    """``size`` scales to cover and centre-crops; without it the image's own size, bounded by
    max_pixels and rounded down to the model's multiple."""
    wide = Image.new("RGB", (160, 80), (0, 0, 255))
    wide.paste((255, 0, 0), (0, 0, 40, 80))  # a red band on the left, cropped away by a square output
    p = edit({"image": encoded(wide), "size": "64x64"})
    assert (p.width, p.height) == (64, 64) and tuple(p.images[0].array()[32, 0]) != (255, 0, 0)
    big = edit({"image": picture((120, 90))})
    assert (big.width, big.height) == (112, 80)
    refused_small = refused({"image": picture((8, 40))})
    assert refused_small.param == "image" and "at least 16 pixels" in str(refused_small)


def test_a_photo_larger_than_max_pixels_is_scaled_down_by_default():
    """``limits.max_input_pixels`` unset was ``max_pixels``: a 12 MP phone photo was refused
    where ``max_pixels`` is 2 MP (flux-dev-1gpu), though the output would be scaled down anyway
    (helper-63). It defaults to 16 x ``max_pixels``, at most 4096 x 4096 (helper-65: 16 MP on a
    64x64 CPU model cost 68 MB per decode); a config's own stands."""
    from deployments.config import LimitsConfig
    from pipeline.wire import ModelFacts

    facts = ModelFacts("flux", 16, True, num_blocks=4, input_modes=(InputMode.IMAGE_TO_IMAGE,))
    config = LimitsConfig(max_pixels=128 * 128).model_dump()
    limits = facts.limits("tiny-flux", config)
    assert limits.max_input_pixels == 16 * 128 * 128
    photo = edit({"image": picture((400, 300))}, limits)  # 120,000 pixels > max_pixels
    assert (photo.width, photo.height) == (144, 96)  # scaled to max_pixels, 16-pixel multiples
    assert refused({"image": picture((600, 500))}, limits).code == "image_too_large"  # 300,000 > 262,144
    flux_dev = facts.limits("flux-dev", {**config, "max_pixels": 2 * 1024 * 1024})
    assert flux_dev.max_input_pixels == 4096 * 4096  # a 12 MP photo is taken
    assert facts.limits("x", {**config, "max_pixels": 5000 * 5000}).max_input_pixels == 5000 * 5000
    own = facts.limits("tiny-flux", {**config, "max_input_pixels": 200 * 200})
    assert refused({"image": picture((400, 300))}, own).code == "image_too_large"


def test_a_long_thin_image_is_told_why_it_is_too_small_once_scaled():
    """helper-75: an 8x131072 upload was "each side must be at least 8 pixels", which it is; it
    is too long and thin to keep a side of 16 once scaled down to ``max_pixels`` (FLUX: 128x128,
    so an aspect ratio of at most 64:1). A side under 16 is told so; ``size`` makes either fit."""
    long_thin = refused({"image": picture((16, 65 * 16))}, dataclasses.replace(FLUX, max_input_pixels=10 ** 6))
    assert long_thin.code == "image_too_small" and long_thin.param == "image"
    assert "scaled down to at most 16384 pixels, its short side is under 16" in long_thin.message
    assert "aspect ratio at most 64:1" in long_thin.message
    narrow = refused({"image": picture((8, 64))})
    assert narrow.code == "image_too_small" and "each side must be at least 16 pixels" in narrow.message
    assert (edit({"image": picture((16, 64 * 16))}).width, edit({"image": picture((16, 64 * 16))}).height) == (16, 1024)
    roomy = dataclasses.replace(FLUX, max_input_pixels=10 ** 6)
    sized = edit({"image": picture((16, 65 * 16)), "size": "64x64"}, roomy)
    assert (sized.width, sized.height) == (64, 64)


def test_pixel_modes_convert_to_rgb_or_are_refused_by_name():
    cmyk = edit({"image": encoded(Image.new("CMYK", (64, 64), (0, 255, 255, 0)), "JPEG")})
    assert cmyk.images[0].array().shape == (64, 64, 3)
    grey16 = Image.fromarray(np.full((64, 64), 65535, dtype=np.uint16))
    assert tuple(edit({"image": encoded(grey16)}).images[0].array()[0, 0]) == (255, 255, 255)
    assert edit({"image": picture(mode="P", color=3)}).images[0].array().shape == (64, 64, 3)
    with pytest.raises(InvalidRequestError, match="pixel mode 'F' is not accepted"):
        to_rgb(Image.new("F", (4, 4)), "image")


@pytest.mark.parametrize("case, body, param, words", [
    ("not an image", {"image": b"hello, not a picture"}, "image", "not an image in an accepted format"),
    ("empty file", {"image": b""}, "image", "an image file is required"),
    ("truncated", {"image": NOISE_PNG[:len(NOISE_PNG) // 2]}, "image", "could not be decoded"),
    ("TIFF", {"image": encoded(Image.new("RGB", (64, 64)), "TIFF")}, "image", "accepted format"),
    ("over max pixels", {"image": picture((200, 200))}, "image", "at most 16384 pixels"),
    ("image bomb", {"image": encoded(Image.new("1", (12000, 12000)))}, "image", "pixels"),
    ("mask of another size", {"image": picture(), "mask": mask_png((32, 32))}, "mask", "same size"),
    ("alpha-less mask", {"image": picture(), "mask": picture()}, "mask", "no alpha channel"),
    ("mask not an image", {"image": picture(), "mask": b"GIF89a"}, "mask", "accepted format"),
    ("strength 0", {"image": picture(), "strength": 0.0}, "strength", "strength must be in (0, 1]"),
    ("strength above 1", {"image": picture(), "strength": 1.5}, "strength", "strength must be in (0, 1]"),
    ("strength just above 1", {"image": picture(), "strength": 1.0000001}, "strength", "got 1.0000001"),
    ("strength NaN", {"image": picture(), "strength": float("nan")}, "strength", "finite"),
    ("no step left", {"image": picture(), "strength": 1e-20, "num_inference_steps": 1}, "strength",
     "leaves no step to run"),
    ("too many images", {"image": [picture(), picture()]}, "image", "at most 1"),
    ("no image", {"image": []}, "image", "at least one image"),
    ("image as text", {"image": "aGVsbG8="}, "image", "image: 'aGVsbG8=' is not allowed; allowed: an image file"),
    # one message for the field, not one per list item (helper-61: image, image.0 and image.1)
    ("numbers for images", {"image": [1, 2]}, "image", "image: [1, 2] is not allowed; allowed: an image file (PNG, "
                                                       "JPEG or WebP), or a list of at most 1"),
])
def test_bad_uploads_are_400s_naming_the_field(case, body, param, words):
    error = refused(body)
    assert error.status_code == 400 and error.param == param, (case, error)
    assert words in str(error) and str(error).count("allowed: ") <= 1, (case, str(error))
    assert "Traceback" not in str(error) and "/" not in str(error).split(":")[0]


def test_modes_a_model_does_not_serve_are_refused():
    text_only = ServingLimits("flux-t2i", 16, 64, 64, 8, 3.5, input_modes=())
    assert "does not serve image edits" in str(refused({"image": picture()}, text_only))
    error = refused({"image": picture(), "mask": mask_png()}, KONTEXT)
    assert error.param == "mask" and "edits by reference" in str(error)
    assert refused({"image": picture(), "strength": 0.5}, KONTEXT).param == "strength"
    p = edit({"image": picture()}, KONTEXT)
    assert p.input_mode == InputMode.REFERENCE and p.strength is None and p.num_input_images == 1
    no_inpaint = ServingLimits("i2i-only", 16, 64, 64, 8, 3.5, input_modes=(InputMode.IMAGE_TO_IMAGE,))
    assert "does not serve inpaint" in str(refused({"image": picture(), "mask": mask_png()}, no_inpaint))


def test_cache_dit_step_knobs_are_checked_against_the_steps_that_run():
    """strength 0.5 of 8 steps runs 4: a warmup of 6 steps no longer fits."""
    error = refused({"image": picture(), "strength": 0.5, "num_inference_steps": 8, "enable_cache_dit": True,
                     "cache_dit_params": {"max_warmup_steps": 6}})
    assert error.param == "cache_dit_params" or "max_warmup_steps" in str(error)
    assert "strength 0.5 runs 4 of the 8 steps" in str(error)
    ok = edit({"image": picture(), "strength": 0.5, "num_inference_steps": 8, "enable_cache_dit": True,
               "cache_dit_params": {"scm_compute_bins": [2, 1], "scm_cache_bins": [1]}})
    assert ok.effective_steps == 4


def test_sequence_parallel_sizes_that_cannot_split_are_refused():
    sp = ServingLimits("tiny-flux", 16, 64, 64, 8, 3.5, world_size=2, max_pixels=128 * 128,
                       max_input_pixels=128 * 128, input_modes=(InputMode.IMAGE_TO_IMAGE,))
    error = refused({"image": picture((48, 16))}, sp)  # 3 x 1 latent tokens
    assert error.param == "image" and "sequence-parallel" in str(error)
    assert edit({"image": picture((64, 32))}, sp).width == 64


def test_video_input_reference_needs_an_image_to_video_model():
    t2v = ServingLimits("tiny-wan", 16, 64, 48, 4, 5.0, temporal_factor=4, default_num_frames=5, max_frames=9,
                        guidance_embeds=False)
    i2v = ServingLimits("tiny-wan-i2v", 16, 64, 48, 4, 5.0, temporal_factor=4, default_num_frames=5, max_frames=9,
                        guidance_embeds=False, input_modes=(InputMode.IMAGE_TO_VIDEO,))
    body = {"prompt": "a ball", "input_reference": picture((100, 80))}
    with pytest.raises(InvalidRequestError, match="does not serve image-to-video") as info:
        validate_video_request(body, t2v)
    assert info.value.param == "input_reference"
    p = resolve_video(validate_video_request(body, i2v), i2v)
    assert p.input_mode == InputMode.IMAGE_TO_VIDEO and p.images[0].array().shape == (48, 64, 3)
    assert "image_to_video" in str(BatchSignature.of(p))
    with pytest.raises(InvalidRequestError, match="accepted format") as info:
        resolve_video(validate_video_request({**body, "input_reference": b"nope"}, i2v), i2v)
    assert info.value.param == "input_reference"
    with pytest.raises(InvalidRequestError, match="input_reference"):  # an edit on a video model: the video route
        validate_edit_request({"prompt": "x", "image": picture()}, i2v)


def test_exif_orientation_is_applied():
    """A photo stored 64x32 with Orientation=6 (rotate 90) is used as displayed: 32x64."""
    stored = Image.new("RGB", (64, 32), (10, 200, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", exif=exif)
    p = edit({"image": buf.getvalue()})
    assert (p.width, p.height) == (32, 64)


def test_a_progressive_jpeg_scan_bomb_is_refused_before_decoding():
    from pipeline.contract.uploads import MAX_JPEG_SCANS

    base = encoded(Image.new("L", (64, 64)), "JPEG")
    bomb = base[:-2] + b"\xff\xda" * (MAX_JPEG_SCANS + 1) + base[-2:]  # SOS markers beyond any real JPEG's
    error = refused({"image": bomb})
    assert error.param == "image" and "scans" in str(error)
    # a JPEG with an MPF header (phones write one) opens as Pillow's "MPO": the bound held for
    # "JPEG" alone (helper-63)
    buf = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buf, format="MPO", save_all=True, append_images=[Image.new("RGB", (8, 8))])
    base = buf.getvalue()
    assert Image.open(io.BytesIO(base)).format == "MPO"
    edit({"image": base})  # a real one is taken
    end = base.index(b"\xff\xd9")  # the first picture's end
    error = refused({"image": base[:end] + b"\xff\xda" * (MAX_JPEG_SCANS + 1) + base[end:]})
    assert error.param == "image" and "scans" in str(error)


def test_only_fully_transparent_mask_pixels_are_repainted():
    """OpenAI: alpha 0 marks the edit; half-transparent pixels are kept."""
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 100))
    mask.paste((0, 0, 0, 0), (48, 0, 64, 64))
    alpha = edit({"image": picture(), "mask": encoded(mask)}).mask.array()[..., 0]
    assert alpha[:, :48].min() == 255 and alpha[:, 48:].max() == 0


def test_size_auto_is_the_images_own_size():
    p = edit({"image": picture((96, 64)), "size": "auto"})
    assert (p.width, p.height) == (96, 64)


def test_a_repeated_image_form_field_becomes_a_list():
    from deployments.http import form_to_body

    body = form_to_body([("prompt", "x"), ("image", b"a"), ("image", b"b")], files=("image", "mask"),
                        file_lists=("image",))
    assert body["image"] == [b"a", b"b"]
    assert "at most 1" in str(refused({"image": [picture(), picture()]}))


def test_a_handle_callers_bytes_like_files_are_taken_as_bytes():
    """``bytearray``, ``memoryview`` and a tuple of files were 400s ("Input should be a valid
    bytes") on the handle API, which takes file bytes (helper-63). They now resolve as bytes do."""
    image, mask = picture(), mask_png()
    want = edit({"image": image, "mask": mask, "seed": 1})
    for given in ({"image": bytearray(image), "mask": memoryview(mask)}, {"image": (image,), "mask": bytearray(mask)},
                  {"image": [memoryview(image)], "mask": mask}):
        p = edit({**given, "seed": 1})
        assert p.input_mode == want.input_mode and p.mask.array().tobytes() == want.mask.array().tobytes()
        assert p.images[0].array().tobytes() == want.images[0].array().tobytes()
    assert refused({"image": [image, 7]}).param == "image"  # what is not a file is still refused by name
    i2v = ServingLimits("tiny-wan-i2v", 16, 64, 48, 4, 5.0, temporal_factor=4, default_num_frames=5, max_frames=9,
                        guidance_embeds=False, input_modes=(InputMode.IMAGE_TO_VIDEO,))
    for reference in (bytearray(image), memoryview(image)):
        p = resolve_video(validate_video_request({"prompt": "a ball", "input_reference": reference}, i2v), i2v)
        assert p.images[0].array().shape == (48, 64, 3)
