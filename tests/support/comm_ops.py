"""Every comm op and async pair in one shard_map body, as the comm tests run them on each backend."""

from jaxdist import comm

OPS = [
    "all_reduce_sum",
    "all_reduce_mean",
    "all_reduce_max",
    "all_reduce_min",
    "all_gather_tiled",
    "all_gather_stacked",
    "reduce_scatter_sum",
    "reduce_scatter_mean",
    "sendrecv",
    "async_all_reduce",
    "async_all_gather",
    "async_reduce_scatter",
    "async_sendrecv",
]


def chain_perm(n: int):
    # a chain 0 -> 1 -> ... -> n-1: rank 0 only sends, rank n-1 only receives
    return [(i, i + 1) for i in range(n - 1)]


def run_all_ops(x, axis, n, gather_axis, scatter_axis, integer):
    """A dict of each op's result on `x` over `axis` (n ranks), in one token chain."""
    tok = comm.token()
    out = {}
    for op in ("sum", "mean", "max", "min"):
        if op == "mean" and integer:
            continue
        out[f"all_reduce_{op}"], tok = comm.all_reduce(x, axis, tok, op=op)
    out["all_gather_tiled"], tok = comm.all_gather(x, axis, tok, axis=gather_axis)
    out["all_gather_stacked"], tok = comm.all_gather(x, axis, tok, axis=gather_axis, tiled=False)
    for op in ("sum", "mean"):
        if op == "mean" and integer:
            continue
        out[f"reduce_scatter_{op}"], tok = comm.reduce_scatter(x, axis, tok, op=op, scatter_axis=scatter_axis)
    out["sendrecv"], tok = comm.sendrecv(x, axis, tok, perm=chain_perm(n))
    # async pairs, all in flight at once, waited in reverse order
    handles = {}
    handles["async_all_reduce"], tok = comm.all_reduce_start(x, axis, tok)
    handles["async_all_gather"], tok = comm.all_gather_start(x, axis, tok, axis=gather_axis)
    handles["async_reduce_scatter"], tok = comm.reduce_scatter_start(x, axis, tok, scatter_axis=scatter_axis)
    handles["async_sendrecv"], tok = comm.sendrecv_start(x, axis, tok, perm=chain_perm(n))
    for name in reversed(list(handles)):
        out[name], tok = comm.wait(handles[name], tok)
    return out
