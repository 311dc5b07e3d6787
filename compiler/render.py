"""Writing a plan's placement graph to a file, in the format its suffix names.

Owns the choice of drawing by suffix: the HTML page (``compiler.viz_html``) or Graphviz
(``compiler.viz``: DOT source, SVG/PNG through the ``dot`` program).
"""

from __future__ import annotations

from pathlib import Path

from compiler.plan import Plan
from compiler.viz import to_dot
from compiler.viz_html import to_html


def render(plan: Plan, path: str | Path) -> Path:
    """Write the placement graph of ``plan`` to ``path``; the format follows the suffix:
    ``.html`` (self-contained page, no network), ``.svg`` / ``.png`` (Graphviz), ``.dot``.

    Raises:
        ValueError: another suffix.
        RuntimeError: ``.svg``/``.png`` without the Graphviz ``dot`` program installed.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".html":
        path.write_text(to_html(plan))
    elif suffix == ".dot":
        path.write_text(to_dot(plan))
    elif suffix in (".svg", ".png"):
        import graphviz

        try:
            data = graphviz.Source(to_dot(plan)).pipe(format=suffix[1:])
        except graphviz.ExecutableNotFound:
            raise RuntimeError(
                f"rendering {path.name} needs the Graphviz 'dot' program (apt-get install graphviz); "
                "the .html and .dot outputs need nothing"
            ) from None
        path.write_bytes(data)
    else:
        raise ValueError(f"cannot render {path}: suffix must be .html, .svg, .png or .dot")
    return path
