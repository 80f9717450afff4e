"""XLA's matmul (cuBLAS on a GPU) against JAX's own Hopper matmul kernel (Pallas on Mosaic GPU) at a GPT
flavor's forward shapes, and what the bias and GELU cost beside the matmul: the headroom of a matmul
kernel of jaxdist's own with the activation in its epilogue (the GELU is the largest element-wise cost
of the step that XLA does not fuse into cuBLAS in training).

    python bench/matmul_kernels.py --flavor 1.3b --batch 8

Needs a Hopper GPU. Times are CUPTI's kernel times (the median of 20 calls); the Pallas kernel's time
is its best over a small sweep of its tuning options.
"""

import argparse
import functools
import itertools
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxdist.models.gpt import FLAVORS  # noqa: E402

PEAK = 989e12  # H100 / H200 dense bf16, datasheet


def kernel_ms(f, *args) -> float:
    _, times = profiler.measure(f, iterations=20)(*args)
    return statistics.median(times)


def best_pallas_ms(a, b) -> tuple[float, str]:
    best, name, chosen = float("inf"), "", None
    dims = (hopper.MatmulDimension.M, hopper.MatmulDimension.N)
    for tile_n, steps, minor, width, wg in itertools.product((128, 256), (4, 5), dims, (4, 8, 16), dims):
        config = hopper.TuningConfig(
            tile_m=128, tile_n=tile_n, tile_k=64, max_concurrent_steps=steps,
            grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg,
        )  # fmt: skip
        try:
            ms = kernel_ms(jax.jit(functools.partial(hopper.matmul, c=None, config=config)), a, b)
        except Exception:  # noqa: BLE001 (a tiling the shape or the shared memory does not allow)
            continue
        if ms < best:
            best, name, chosen = ms, f"tile_n={tile_n} steps={steps} minor={minor} width={width} wg={wg}", config
    if chosen is None:
        raise RuntimeError(f"no tiling of the Pallas matmul runs {a.shape} x {b.shape} here")
    # a time is only worth comparing if the kernel computes the same product
    out = hopper.matmul(a, b, None, config=chosen).astype(jnp.float32)
    ref = jnp.matmul(a, b).astype(jnp.float32)
    error, scale = float(jnp.max(jnp.abs(out - ref))), float(jnp.max(jnp.abs(ref)))
    if error > 1e-2 * scale:
        raise RuntimeError(f"the Pallas matmul ({name}) is {error:.3g} off XLA's dot (largest value {scale:.3g})")
    return best, name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="1.3b", choices=sorted(FLAVORS))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cfg = FLAVORS[args.flavor]
    tokens, d = args.batch * cfg.seq_len, cfg.d_model
    shapes = {"q/k/v": (d, 3 * d), "proj": (d, d), "fc1": (d, 4 * d), "fc2": (4 * d, d)}
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, GPT-{args.flavor}, {tokens} tokens")
    columns = ["matmul (M x K x N)", "XLA dot", "Pallas Hopper matmul (best)", "XLA / Pallas"]
    print("| " + " | ".join([*columns, "XLA dot + bias + GELU", "bias + GELU alone"]) + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (k, n) in shapes.items():
        a = jax.random.normal(jax.random.key(0), (tokens, k), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16) * 0.02
        bias = jnp.zeros((n,), jnp.bfloat16)
        flops = 2 * tokens * k * n
        xla = kernel_ms(jax.jit(jnp.matmul), a, b)
        fused = kernel_ms(jax.jit(lambda a, b, c: jax.nn.gelu(a @ b + c)), a, b, bias)
        alone = kernel_ms(jax.jit(lambda h, c: jax.nn.gelu(h + c)), a @ b, bias)
        pallas, config = best_pallas_ms(a, b)
        tflops = [flops / (ms * 1e-3) / 1e12 for ms in (xla, pallas)]
        print(
            f"| {name} ({tokens} x {k} x {n}) "
            f"| {xla * 1e3:.1f} us ({tflops[0]:.0f} TFLOP/s, {tflops[0] * 1e12 / PEAK:.1%}) "
            f"| {pallas * 1e3:.1f} us ({tflops[1]:.0f} TFLOP/s; {config}) | {xla / pallas:.3f} "
            f"| {fused * 1e3:.1f} us | {alone * 1e3:.1f} us |",
            flush=True,
        )


if __name__ == "__main__":
    main()
