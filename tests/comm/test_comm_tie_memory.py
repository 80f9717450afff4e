"""A token chain keeps nothing alive: each value tied to it can be freed after its last use.

On CPU a tie is made of data (see `jaxdist.comm._sequence`); its new token must be
computed once, or XLA's fusion copies the chain of earlier ties into every later
one and every value ever tied (e.g. every gathered unit of an FSDP step) lives to
the end of the program.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm

MESH = cpu_mesh((8,), ("x",))
WIDTH = 4096  # one gathered (8, WIDTH) float32 array: 128 KiB


def _temp_bytes(units: int) -> int:
    """Temp memory of `units` gathers on one chain, each consumed right away (as FSDP's units)."""

    def body(shards, x):
        tok = comm.token()
        for i in range(units):
            h, tok = comm.all_gather_start(shards[i], "x", tok, tiled=False)
            w, tok = comm.wait(h, tok)
            x, tok = comm.tie(x + jnp.tanh(w).sum(0)[: x.shape[0]], tok)
        return x

    spec = NamedSharding(MESH, P(None, "x"))
    shards = jax.ShapeDtypeStruct((units, 8 * WIDTH), jnp.float32, sharding=spec)
    x = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=NamedSharding(MESH, P()))
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(None, "x"), P()), out_specs=P(), check_vma=False))
    return f.lower(shards, x).compile().memory_analysis().temp_size_in_bytes


def test_tied_values_die_after_their_last_use():
    gathered = 8 * WIDTH * 4
    growth = (_temp_bytes(8) - _temp_bytes(2)) / 6
    # seen: 16 KiB per unit (its slice of `shards`); 144 KiB (one gathered array more) while each tie
    # recomputed the chain before it
    assert growth < gathered / 4, (growth, gathered)
