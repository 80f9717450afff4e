"""What tests share: meshes of CPU devices, model layouts, HLO schedule readers.

`tests/` is on pytest's `pythonpath` (pyproject.toml), so any test, in any folder, imports these
as `from support.meshes import cpu_mesh`.
"""
