"""jaxdist: multi-GPU training for JAX/Flax with explicit communication schedules."""

from jaxdist import comm

__version__ = "0.1.0"

__all__ = ["comm", "__version__"]
