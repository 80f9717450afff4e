"""Pipeline parallelism over a `pp` mesh axis: schedules as data (`schedule`: GPipe, 1F1B,
interleaved) and the strategy that runs them (`Pipelined`), composed with the engine's data and
tp axes.
"""

from jaxdist.pipeline.run import Pipelined, PipelineRun

__all__ = ["Pipelined", "PipelineRun"]
