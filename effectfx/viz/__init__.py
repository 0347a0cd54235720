"""Pictures of programs: graph -> JSON description (:mod:`.graph_json`) -> self-contained HTML
(:mod:`.html`)."""

from .graph_json import program_json
from .html import program_html, render_html, write_html

__all__ = ["program_html", "program_json", "render_html", "write_html"]
