"""What the rotary decoder families (Llama-style, Gemma-style) share around their blocks: the forward
as units over (optionally packed) batches, the loss, KV-cache decoding and the TP plan.

A batch is `{"tokens": [batch, T + 1]}`: the model reads every token but the last and predicts every
token but the first. Packed batches add `segment_ids` and/or `positions`, of the tokens' shape:
tokens attend only within their document (same segment id), rotary positions restart per document,
and a label counts in the loss only where it continues its document (segment id 0 is padding, never
read and never counted). The loss is then the mean over counted labels (`head_loss`), or their sum
and count (`PACKED_UNITS`, `next_token_loss_sum_and_count`) so that the strategies divide the sum over
all data ranks by the count over all of them: the single-device token mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.engine.run import Units
from jaxdist.tp import plan as tp_plan

SIDE_INPUTS = ("positions", "segment_ids")


class Decoder(nnx.Module):
    """The forward shared by Llama and Gemma: `embed_tokens`, then `blocks`, then `logits` (each family
    defines those two and sets `cfg`, with `n_layers`, `n_kv_heads`, `head_dim`, `seq_len`, `dtype`)."""

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None):
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x, positions, segment_ids)
        return self.logits(x)

    def empty_cache(self, batch: int) -> jax.Array:
        """Keys and values for `decode`: [n_layers, 2, batch, seq_len, n_kv_heads, head_dim] zeros."""
        c = self.cfg
        return jnp.zeros((c.n_layers, 2, batch, c.seq_len, c.n_kv_heads, c.head_dim), c.dtype)

    def decode(self, tokens: jax.Array, cache: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Logits of `tokens` placed at positions pos, pos + 1, ... after those cached: the values of
        `__call__` on the whole sequence, one chunk at a time (the cache holds only the kv heads)."""
        x = self.embed_tokens(tokens)
        layers = []
        for block, layer in zip(self.blocks, cache, strict=True):
            x, layer = block.decode(x, layer, pos)
            layers.append(layer)
        return self.logits(x), jnp.stack(layers)


def check_config(cfg) -> None:
    """Sizes no model of these families can have: a one-line ValueError naming the field."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "seq_len"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(cfg).__name__}.{name} must be a positive int, got {value!r}")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(
            f"{type(cfg).__name__}: n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads} "
            "(each key/value head serves n_heads / n_kv_heads query heads)"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"{type(cfg).__name__}.head_dim must be even for rotary embeddings, got {cfg.head_dim}")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{type(cfg).__name__}.sliding_window must be None or a positive int, got {window!r}")


def _side(batch: dict, key: str) -> jax.Array | None:
    value = batch.get(key) if isinstance(batch, dict) else None
    if value is None:
        return None
    if value.shape != batch["tokens"].shape:
        raise ValueError(
            f"batch[{key!r}] has shape {tuple(value.shape)} but the tokens {tuple(batch['tokens'].shape)}; "
            "give one value per token, aligned with batch['tokens']"
        )
    return value


def attention_inputs(batch: dict) -> tuple[jax.Array | None, jax.Array | None]:
    """(positions, segment_ids) of the model's inputs (every token but the last), None where absent."""
    return tuple(None if (v := _side(batch, k)) is None else v[:, :-1] for k in SIDE_INPUTS)


def label_weights(batch: dict) -> jax.Array | None:
    """1.0 for each label that continues its document (not padding), 0.0 elsewhere; None: all count."""
    segments = _side(batch, "segment_ids")
    if segments is None:
        return None
    return ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)).astype(jnp.float32)


def embed_inputs(model: Decoder, batch: dict) -> jax.Array:
    """The first unit: embeddings of every token but the last."""
    return model.embed_tokens(batch["tokens"][:, :-1])


def block_call(block: nnx.Module, x: jax.Array, batch: dict) -> jax.Array:
    """One block on the activations, with the batch's positions and document masks."""
    return block(x, *attention_inputs(batch))


def head_loss_sum_and_count(model: Decoder, x: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The last unit: (sum, count) of the next-token cross-entropy over the counted labels (float32)."""
    # tp_plan.cross_entropy: optax's on one device; under the TP plan each rank's vocabulary slice
    losses = tp_plan.cross_entropy(model.logits(x), batch["tokens"][:, 1:])
    weights = label_weights(batch)
    if weights is None:
        return losses.sum(), jnp.float32(losses.size)
    return (losses * weights).sum(), weights.sum()


def head_loss(model: Decoder, x: jax.Array, batch: dict) -> jax.Array:
    """The last unit: the mean next-token cross-entropy over the counted labels."""
    total, count = head_loss_sum_and_count(model, x, batch)
    return total / jnp.maximum(count, 1.0)


def _blocks(model: Decoder, batch: dict) -> jax.Array:
    x = embed_inputs(model, batch)
    for block in model.blocks:
        x = block_call(block, x, batch)
    return x


def next_token_loss(model: Decoder, batch: dict) -> jax.Array:
    """The whole model's loss: `head_loss` after the blocks after `embed_inputs`."""
    return head_loss(model, _blocks(model, batch), batch)


def next_token_loss_sum_and_count(model: Decoder, batch: dict) -> tuple[jax.Array, jax.Array]:
    """`next_token_loss` as (sum, count), for `DDP(sum_and_count=True)` on packed batches."""
    return head_loss_sum_and_count(model, _blocks(model, batch), batch)


# The model as units: embeddings, each block (with the batch's positions and segments), final norm,
# head and mean loss. PACKED_UNITS returns (sum, count): exact token means when ranks count differently.
UNITS = Units(embed=embed_inputs, head_loss=head_loss, blocks="blocks", block_call=block_call)
PACKED_UNITS = Units(
    embed=embed_inputs, head_loss=head_loss_sum_and_count, blocks="blocks", block_call=block_call, sum_and_count=True
)


def tp_plan_for(cfg, *, tied: bool, gather_logits: bool = False) -> tp_plan.TPPlan:
    """Megatron's layout for these decoders: q/k/v and gate/up split by output features (whole heads:
    the plan divides the blocks' n_heads and n_kv_heads), o and down by input features, the
    embedding's vocabulary and the separate head's; logits stay split for the vocabulary-parallel
    loss unless `gather_logits` (a model that computes on whole logits, e.g. soft-capping them)."""
    layers = {
        "embed": tp_plan.vocab(loss_parallel=not gather_logits),
        "blocks/*/attn/q": tp_plan.column(),
        "blocks/*/attn/k": tp_plan.column(),
        "blocks/*/attn/v": tp_plan.column(),
        "blocks/*/attn/o": tp_plan.row(),
        "blocks/*/mlp/gate": tp_plan.column(),
        "blocks/*/mlp/up": tp_plan.column(),
        "blocks/*/mlp/down": tp_plan.row(),
    }
    if not tied:
        layers["head"] = tp_plan.column(gather_output=gather_logits, loss_parallel=not gather_logits)
    return tp_plan.TPPlan(layers=layers, divide={"blocks/*/attn": ("n_heads", "n_kv_heads")})


def check_tp(cfg, tp: int) -> None:
    """Raise a one-line ValueError when the TP plan cannot split `cfg` over `tp` ranks."""
    sizes = (
        ("n_kv_heads", cfg.n_kv_heads, "key/value heads (each rank holds whole kv heads)"),
        ("n_heads", cfg.n_heads, "query heads"),
        ("d_ff", cfg.d_ff, "MLP features"),
        ("vocab_size", cfg.vocab_size, "vocabulary rows"),
    )
    for name, value, what in sizes:
        if value % tp:
            raise ValueError(
                f"{name}={value} is not divisible by tp={tp}: the TP plan splits the {what} over tp; "
                f"choose a tp that divides {value}"
            )
