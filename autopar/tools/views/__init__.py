"""Views of a plan: renderings meant for people rather than for the compiler.

`html.render_html` draws a plan document (`autopar.compiler.plan_file.plan_document`) as one self-contained
HTML page: mesh, placement-coloured graph, per-layer communication ledger.
"""
from autopar.tools.views.html import render_html

__all__ = ["render_html"]
