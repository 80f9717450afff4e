"""Data parallelism with gradient buckets (`DDP`), and ZeRO-1 (a distributed optimizer).

`run` is the strategy, `buckets` the flat-buffer layouts, `interleave` the schedule that slots
each bucket's reduction into backward for a model jaxdist did not write.
"""

from jaxdist.ddp.run import DDP, DDPRun

__all__ = ["DDP", "DDPRun"]
