"""Data parallelism with gradient buckets (`DDP`), and ZeRO-1 (a distributed optimizer).

`run` is the strategy, `leaf_loss` the loss it differentiates (over flat parameter leaves),
`buckets` the flat-buffer layouts, `bucket_schedule` and `interleave` the schedule that slots each
bucket's reduction into backward for a model jaxdist did not write, `canonical` the checkpoint form.
"""

from jaxdist.ddp.run import DDP, DDPRun

__all__ = ["DDP", "DDPRun"]
