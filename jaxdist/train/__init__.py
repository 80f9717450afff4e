"""The training stack: the trainer (`trainer`), the `jaxdist` command (`cli`, `launch`), the
configuration (`config`), checkpoints and export (`checkpoint`, `export`), the data (`data`),
evaluation and sampling (`evaluate`, `sample`), metrics and plots.

It composes the strategies; nothing below it imports it. Import its modules by path
(`jaxdist.train.trainer.train`); this file loads nothing, so `jaxdist.train.launch` starts fast.
"""
