"""What tests share: CPU meshes, models and their batches, optimizers, the single-device reference
trainer, checkpoint layouts, HLO schedule readers, trainer settings.

`tests/` is on pytest's `pythonpath` (pyproject.toml), so any test, in any folder, imports these
as `from support.meshes import cpu_mesh`. Test modules never import each other: what two tests
share lives here.
"""
