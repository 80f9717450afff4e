"""Checkpoints with orbax: the exact train state, plus the full parameters for another layout.

Each checkpoint holds the strategy's own train state (exact resume on the same
mesh and strategy), the full parameters in the single-device layout (restore
onto another mesh shape or strategy), and metadata (model config, layout,
step). Orbax writes a checkpoint to a temporary directory and renames it when
complete, so an interrupted save never touches the previous checkpoints; only
the newest `keep` are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxdist.train.config import ConfigError


class Checkpoints:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "params", "meta"))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, params, meta: dict) -> None:
        pure = nnx.to_pure_dict(params)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                params=ocp.args.StandardSave(pure),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore_state(self, step: int, like):
        """The train state saved at `step`, with the shapes and shardings of `like`."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state

    def restore_params(self, step: int, like_params):
        """The full parameters saved at `step`, as host arrays shaped like `like_params` (an nnx.State)."""
        pure = nnx.to_pure_dict(like_params)
        abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), pure)
        restored = self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
        return jax.tree.map(np.asarray, restored.params)

    def close(self) -> None:
        self.manager.close()


def check_same_model(meta: dict, model: dict, directory: Path) -> None:
    if meta.get("model") != model:
        saved = json.dumps(meta.get("model"), sort_keys=True)
        raise ConfigError(
            f"the checkpoint in {directory} is for another model ({saved}); use a new run.out_dir, "
            "set run.resume=false, or match the model settings"
        )
