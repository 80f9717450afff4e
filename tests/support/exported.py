"""Loading an exported run as docs/trainer.md shows: orbax and Flax only, no jaxdist."""

import orbax.checkpoint as ocp
from flax import nnx


def readme_load(path, model):
    """The loading snippet of docs/trainer.md: orbax and Flax only."""
    abstract = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    pure = ocp.StandardCheckpointer().restore(path, abstract)
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, pure)
    nnx.update(model, params)
    return model
