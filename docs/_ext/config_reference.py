"""A Sphinx directive that renders the trainer's configuration keys from the config dataclasses.

``{jaxdist-config}`` in a page becomes one table per section (key, default, meaning), read from
`jaxdist.train.config` at build time, so the reference cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import json

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_markdown() -> str:
    """Markdown tables of every section and key, with defaults and help text."""
    from jaxdist.train import config

    out = []
    for section, cls in config._fields(config.TrainConfig).items():
        out += [f"**`[{section}]`**", "", "| key | default | meaning |", "| --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            default = "none" if f.default is None else json.dumps(f.default)
            meaning = f.metadata.get("help", "")
            allowed = f.metadata.get("range")
            if allowed:
                meaning = f"{meaning} (allowed: {allowed})" if meaning else f"allowed: {allowed}"
            out.append(f"| `{section}.{f.name}` | `{_cell(default)}` | {_cell(str(meaning))} |")
        out.append("")
    return "\n".join(out)


class ConfigReference(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(StringList(config_markdown().splitlines(), source="jaxdist.train.config"), 0, container)
        return container.children


def setup(app):
    app.add_directive("jaxdist-config", ConfigReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
