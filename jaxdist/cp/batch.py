"""A data rank's batch as one cp rank sees it: every array with the sequence along dimension 1 cut
to the rank's two chunks (`jaxdist.cp.layout`), the arrays named in `whole` left whole, and the
global positions of the local tokens added as `batch["positions"]` when the batch has none.

Token-wise code (embeddings, norms, MLPs, the loss) then runs unchanged on the chunks; a model
must take its positions from the batch (RoPE, learnt positions), since `arange` over the local
tokens would number them 0 .. 2 L - 1 wherever they sit in the sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxdist.cp.layout import chunk_len, split_sequence, traced_local_indices

POSITIONS = "positions"  # the batch key holding each token's global position (added when absent)


def sequence_length(batch, x_shape: tuple[int, ...], who: str) -> int:
    """The sequence length cp splits: dimension 1 of the activations the embed makes of the whole batch."""
    if len(x_shape) < 3:
        raise ValueError(
            f"{who}: context parallelism splits dimension 1 (the sequence) of the activations, but the embed "
            f"returned shape {tuple(x_shape)}; the activations must be [batch, sequence, features]"
        )
    return x_shape[1]


def _check_dict(batch, who: str) -> None:
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"{who}: context parallelism needs the batch as a dict of arrays (it adds batch['{POSITIONS}']), "
            f"got {type(batch).__name__}"
        )


def _cut(batch, length: int, whole: tuple[str, ...], cut, positions):
    """`batch` with `cut(x)` applied to each array whose dimension 1 is `length` (outside `whole`), and
    `positions(rows)` added under POSITIONS when absent."""

    def one(key):
        def leaf(x):
            return cut(x) if key not in whole and x.ndim >= 2 and x.shape[1] == length else x

        return jax.tree.map(leaf, batch[key])

    out = {key: one(key) for key in batch}
    if POSITIONS not in out:
        rows = jax.tree.leaves(batch)[0].shape[0]
        out[POSITIONS] = positions(rows)
    return out


def local_batch(batch, rank, cp: int, length: int, whole: tuple[str, ...] = ()) -> dict:
    """Rank `rank`'s view of a data rank's `batch` (inside `shard_map`; `rank` traced)."""
    idx = traced_local_indices(rank, cp, length)
    return _cut(
        batch,
        length,
        whole,
        lambda x: split_sequence(x, rank, cp),
        lambda rows: jnp.broadcast_to(idx[None], (rows, idx.shape[0])),
    )


def local_batch_avals(batch, cp: int, length: int, whole: tuple[str, ...], who: str) -> dict:
    """The avals of `local_batch` for a data rank's batch of avals `batch` (refused unless it is a dict
    and the sequence splits into 2 cp chunks)."""
    _check_dict(batch, who)
    if isinstance(whole, str) or not all(isinstance(k, str) for k in whole):
        raise ValueError(f"{who}: cp_whole must be a tuple of batch keys, e.g. ('segment_ids',), got {whole!r}")
    n = chunk_len(cp, length)

    cut_keys = []

    def cut(x):
        cut_keys.append(x)
        return jax.ShapeDtypeStruct((x.shape[0], 2 * n, *x.shape[2:]), x.dtype)

    out = _cut(batch, length, whole, cut, lambda rows: jax.ShapeDtypeStruct((rows, 2 * n), jnp.int32))
    if not cut_keys:
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in batch.items()}
        raise ValueError(
            f"{who}: cp cuts the batch arrays whose dimension 1 is the sequence length {length}, but none of "
            f"{shapes} has it; give the inputs and targets that length (for jaxdist's GPT: "
            "jaxdist.models.gpt.next_token_batch)"
        )
    return out


def sequence_dims(batch) -> dict[str, int]:
    """Dimension 1 of each batch array that has one, by its path."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    return {jax.tree_util.keystr(path): x.shape[1] for path, x in leaves if len(getattr(x, "shape", ())) >= 2}


def check_step_batch(batch, prepared: dict[str, int], length: int, who: str) -> None:
    """Refuse a step's batch whose arrays have another dimension 1 than `prepare`'s example (`prepared`,
    its `sequence_dims`): which arrays cp cuts, and into what, was decided for that sequence length; an
    array of another length would pass uncut (the attention seeing tokens twice) or fail on shapes."""
    for path, dim in sequence_dims(batch).items():
        if path in prepared and dim != prepared[path]:
            raise ValueError(
                f"{who}: under context parallelism the sequence length is fixed at prepare ({length} tokens, cut "
                f"into chunks per cp rank), but this step's batch{path} has dimension 1 of {dim} where prepare's "
                f"example had {prepared[path]}; give every step batches of prepare's length (pad shorter ones), "
                "or prepare another run for this length"
            )
