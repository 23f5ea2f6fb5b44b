"""A self-contained HTML page: inline CSS, figures embedded as data URIs, no scripts, no CDN.

The page opens from a file with no network access, and the same figures are also written
beside it (PNG and SVG) for papers and slides. The page embeds each figure at screen size
(:func:`screen_png`), about 8x smaller than the print-quality file it links to, so that a study's
report with a dozen methods stays under a megabyte.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from dmlkit.utils import path_bytes

__all__ = ["Figure", "Section", "render_page", "screen_png", "table_html"]

#: Widest embedded figure in pixels (the page is at most 1,180 CSS pixels wide).
SCREEN_WIDTH = 1400

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       max-width: 1180px; margin: 2em auto; padding: 0 1em; color: #111; line-height: 1.45; }
h1 { border-bottom: 2px solid #222; padding-bottom: .3em; }
h2 { margin-top: 2em; border-bottom: 1px solid #bbb; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #999; padding: .3em .6em; text-align: right; }
th { background: #eee; } td:first-child, th:first-child { text-align: left; }
td.best { font-weight: bold; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: .9em; color: #333; }
pre { background: #f6f6f6; border: 1px solid #ddd; padding: .8em; overflow-x: auto; font-size: .85em; }
.note { color: #555; font-size: .9em; }
nav a { margin-right: 1em; }
"""


@dataclass
class Figure:
    """A figure file (PNG) with a caption; ``svg`` is linked when present."""

    png: Path
    caption: str
    svg: Path | None = None


@dataclass
class Section:
    """A titled block of the page: paragraphs (HTML-escaped), raw HTML and figures."""

    title: str
    paragraphs: list[str] = field(default_factory=list)
    html_blocks: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return "".join(ch if ch.isalnum() else "-" for ch in self.title.lower()).strip("-")


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]],
               bold: Collection[tuple[int, int]] = ()) -> str:
    """An HTML table with escaped cells; the cells ``(row, column)`` in ``bold`` (a benchmark's
    best cells, :func:`dmlkit.protocol.results.best_cells`) have class ``best``, never a whole row."""
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>"]
    best_td = '<td class="best">'
    for i, row in enumerate(rows):
        out.append("<tr>" + "".join(
            f"{best_td if (i, j) in bold else '<td>'}{html.escape(str(c))}</td>"
            for j, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def screen_png(path: Path) -> bytes:
    """The PNG at ``path`` for the page: at most :data:`SCREEN_WIDTH` pixels wide (Lanczos),
    on white, in an adaptive 256-colour palette (no dithering), or the file itself where that
    is not smaller. A 200-dpi figure of training curves: 460-520 KB -> about 60 KB."""
    from PIL import Image

    original = path.read_bytes()
    with Image.open(io.BytesIO(original)) as im:
        im.load()
        if im.mode in ("RGBA", "LA", "P"):
            rgba = im.convert("RGBA")
            img = Image.new("RGB", rgba.size, "white")
            img.paste(rgba, mask=rgba.getchannel("A"))
        else:
            img = im.convert("RGB")
    if img.width > SCREEN_WIDTH:
        height = max(1, round(img.height * SCREEN_WIDTH / img.width))
        img = img.resize((SCREEN_WIDTH, height), Image.Resampling.LANCZOS)
    img = img.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    buf = io.BytesIO()
    img.save(buf, "PNG", optimize=True)
    return buf.getvalue() if buf.tell() < len(original) else original


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(screen_png(path)).decode("ascii")


def render_page(title: str, subtitle: str, sections: Sequence[Section], page_path: Path) -> str:
    """The whole page as a string; figure files are linked relative to ``page_path``."""
    nav = " ".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in sections)
    body = [f"<h1>{html.escape(title)}</h1>", f'<p class="note">{html.escape(subtitle)}</p>', f"<nav>{nav}</nav>"]
    for s in sections:
        body.append(f'<h2 id="{s.anchor}">{html.escape(s.title)}</h2>')
        body.extend(f"<p>{html.escape(p)}</p>" for p in s.paragraphs)
        body.extend(s.html_blocks)
        for f in s.figures:
            links = []
            for p in (f.png, f.svg):
                if p is not None:
                    rel = _relative(p, page_path.parent)
                    links.append(f'<a href="{html.escape(rel)}">{p.suffix[1:].upper()}</a>')
            body.append(
                f'<figure><img src="{_data_uri(f.png)}" alt="{html.escape(f.caption)}">'
                f"<figcaption>{html.escape(f.caption)} ({' / '.join(links)})</figcaption></figure>"
            )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _relative(path: Path, start: Path) -> str:
    """A link to ``path`` from a page in ``start``: the relative path as a URL (percent-encoded:
    in ``r#1_figures/curves.png`` a ``#`` began a fragment, and ``%``/``?`` broke it too, so
    every figure link of a page named ``r#1.html`` led to the page itself), else a file URI."""
    try:
        rel = path.resolve().relative_to(start.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_uri()
    return quote(path_bytes(rel))  # bytes: a file name that is not UTF-8 keeps its own
