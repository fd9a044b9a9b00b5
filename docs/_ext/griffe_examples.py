"""Griffe extension for the API reference: read a Google-style ``Example:`` heading as
``Examples:``, so ``>>>`` lines render as code.

Griffe treats the singular ``Example:`` as an admonition (Markdown text, where ``>>>`` becomes
nested block quotes); fitdp's docstrings use the singular form.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename every ``Example:`` section heading to ``Examples:`` before parsing."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
