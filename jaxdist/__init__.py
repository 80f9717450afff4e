"""jaxdist: multi-GPU training for JAX/Flax with explicit communication schedules."""

from jaxdist._xla_flags import apply_default_flags

apply_default_flags()  # before anything below can start a JAX backend

from jaxdist import comm  # noqa: E402

__version__ = "0.1.0"

__all__ = ["comm", "__version__"]
