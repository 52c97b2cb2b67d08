"""What runs a batch: the request/sampling contract, batch signatures, model-family
adapters, the denoising loop and the per-replica batch runner. Never imports Ray."""
