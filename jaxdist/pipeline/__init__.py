"""Pipeline parallelism over a `pp` mesh axis: schedules as data (`schedule`: GPipe, 1F1B,
interleaved, ZB-H1) and the strategy that runs them (`Pipelined`), composed with the engine's data
and tp axes: the engine's parts (`jaxdist.engine.run.EngineParts`) laid out with the blocks also
split over pp (`placement`), and the schedule's per-device program (`stage_step`, its ops
`stage_ops`, ZB-H1's split backward `backward_split`) as the train step's.
"""

from jaxdist.pipeline.run import Pipelined, PipelineRun

__all__ = ["Pipelined", "PipelineRun"]
