"""Embedding matplotlib figures in self-contained HTML: below the report, validation and fairness modules that draw
them, so none of those imports the report package. matplotlib (the ``[report]`` extra) is imported when a figure
is encoded, not on import."""

from __future__ import annotations

import base64
import html
import io


def figure_png_base64(figure) -> str:
    """The figure as a base64 PNG; the figure is closed (pyplot keeps every open figure alive)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def img_tag(encoded: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'
