"""A model's module tree without its weights, for the layout checks that read modules before loading."""

from __future__ import annotations


def meta_model(config, trust_remote_code: bool = False):
    """The architecture's module tree on the meta device, no weights read and no memory taken: what the
    layout checks that need the model's modules ask before the weights load (the pipeline's stages, the
    TP plan's regions), and the planner for each row. `torch.device("meta")` rather than accelerate's
    `init_empty_weights`, which moves parameters only once registered: stacked experts are built as
    `nn.Parameter(torch.empty(...))`, allocated on the host first (DeepSeek-V3: 30 GB a layer)."""
    import torch

    from toolkit.model.vision import auto_class

    with torch.device("meta"):
        return auto_class(config).from_config(config, trust_remote_code=trust_remote_code)
