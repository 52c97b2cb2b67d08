"""The embedded models' names, without building or importing them (no torch): what a config's
``model.name`` may be without a ``model.path``. ``pipeline.tiny.registry.EMBEDDED`` holds the
same names with their builders (``tests/test_configs.py`` checks the two agree)."""

EMBEDDED_NAMES = ("tiny-flux", "tiny-flux-random", "tiny-wan", "tiny-wan-moe", "tiny-wan-paired", "tiny-wan-i2v",
                  "tiny-flux-kontext", "tiny-flux2", "tiny-qwen-image", "tiny-qwen-image-edit", "tiny-z-image")
# the embedded models with two transformers, by how they run them (pipeline.modes.DualMode; the
# others have one): what a config may be checked against before any replica loads the model
EMBEDDED_DUAL_MODES = {"tiny-wan-moe": "boundary", "tiny-wan-paired": "paired"}
# the embedded video models (the ``wan`` family): a config's video defaults (frames) apply to them
EMBEDDED_VIDEO_NAMES = ("tiny-wan", "tiny-wan-moe", "tiny-wan-paired", "tiny-wan-i2v")
# the embedded models' output grids, as their loaded ``ModelFacts`` give them: name ->
# (spatial_factor, max_side, max_aspect_ratio) (pixels, pixels, long side / short; 0: any). What a
# config's ``limits.default_size`` is checked against before any replica loads the model.
EMBEDDED_SIZE_GRIDS = {"tiny-flux": (8, 0, 0.0), "tiny-flux-random": (8, 0, 0.0), "tiny-flux-kontext": (8, 0, 0.0),
                       "tiny-flux2": (4, 0, 0.0), "tiny-qwen-image": (16, 0, 0.0),
                       "tiny-qwen-image-edit": (16, 0, 128.0), "tiny-z-image": (4, 512, 0.0),
                       **{name: (16, 4096, 0.0) for name in EMBEDDED_VIDEO_NAMES}}
