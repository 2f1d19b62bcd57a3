"""report.md as HTML: `report.html`, written beside it by `pagoda bench` and `pagoda bakeoff`, and
the console's Reports page (`pagoda serve --reports DIR`) render it the same way.

Only the markdown report.py writes is read: `#` headings, `- ` lists (two spaces nest one level),
`| ... |` tables with a `---` row, paragraphs, and inline `code`, **bold** and ![alt](image). Every
piece of text is escaped; an image that is a file of the report folder is inlined as a data URI,
so the HTML needs nothing beside it and works offline, wherever it is copied; any other image is
shown as its alt text and address, never fetched.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

IMAGE_TYPES = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
INLINE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)|`([^`]*)`|\*\*(.+?)\*\*")
STYLE = """
:root { color-scheme: light dark; --fg: #1d2430; --muted: #5b6577; --line: #d8dde6; --bg: #fff; --code: #f1f3f7; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #e4e8ef; --muted: #9aa5b8; --line: #333c4a; --bg: #14181f; --code: #222833; }
}
body { font: 15px/1.5 system-ui, sans-serif; color: var(--fg); background: var(--bg); margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 16px; }
.report table { border-collapse: collapse; margin: 8px 0 16px; font-variant-numeric: tabular-nums; }
.report .table { overflow-x: auto; }
.report th, .report td { border: 1px solid var(--line); padding: 4px 8px; text-align: right; white-space: nowrap; }
.report th:first-child, .report td:first-child { text-align: left; }
.report code { background: var(--code); padding: 1px 4px; border-radius: 4px; word-break: break-all; }
.report img { max-width: 100%; height: auto; background: #fff; border-radius: 6px; margin: 8px 0; }
.report h2 { border-bottom: 1px solid var(--line); padding-bottom: 4px; margin-top: 28px; }
"""


def report_fragment(markdown_text: str, folder: Path) -> str:
    """The report's body as an HTML fragment (a `<div class="report">`), images inlined from `folder`."""
    out: list[str] = ['<div class="report">']
    lines = markdown_text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")), 6)
            out.append(f"<h{level}>{_inline(line[level:].strip(), folder)}</h{level}>")
            i += 1
        elif line.startswith("|"):
            i = _table(lines, i, folder, out)
        elif line.lstrip().startswith("- "):
            i = _list(lines, i, folder, out)
        else:
            out.append(f"<p>{_inline(line.strip(), folder)}</p>")
            i += 1
    out.append("</div>")
    return "\n".join(out)


def report_html(markdown_text: str, folder: Path, title: str) -> str:
    """A whole HTML document, light or dark by the system setting, with nothing to fetch."""
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><main>\n{report_fragment(markdown_text, folder)}\n</main></body></html>\n"
    )


def write_report_html(folder: Path, title: str) -> Path:
    """report.html from the folder's report.md (and its plots)."""
    path = folder / "report.html"
    path.write_text(report_html((folder / "report.md").read_text(encoding="utf-8"), folder, title), encoding="utf-8")
    return path


def _table(lines: list[str], i: int, folder: Path, out: list[str]) -> int:
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([cell.strip() for cell in lines[i].strip().strip("|").split("|")])
        i += 1
    header, body = rows[0], [r for r in rows[1:] if not all(set(c) <= set("-: ") for c in r)]
    out.append('<div class="table"><table><thead>')
    out.append("<tr>" + "".join(f"<th>{_inline(cell, folder)}</th>" for cell in header) + "</tr>")
    out.append("</thead><tbody>")
    for row in body:
        out.append("<tr>" + "".join(f"<td>{_inline(cell, folder)}</td>" for cell in row) + "</tr>")
    out.append("</tbody></table></div>")
    return i


def _list(lines: list[str], i: int, folder: Path, out: list[str]) -> int:
    depth = 0
    while i < len(lines) and lines[i].lstrip().startswith("- "):
        line = lines[i]
        indent = (len(line) - len(line.lstrip())) // 2 + 1
        if indent > depth:
            out.append("<ul>" * (indent - depth))
        elif indent < depth:
            out.append("</ul>" * (depth - indent))
        depth = indent
        out.append(f"<li>{_inline(line.lstrip()[2:], folder)}</li>")
        i += 1
    out.append("</ul>" * depth)
    return i


def _inline(text: str, folder: Path) -> str:
    parts, end = [], 0
    for match in INLINE.finditer(text):
        parts.append(html.escape(text[end : match.start()]))
        alt, src, code, bold = match.groups()
        if src is not None:
            inlined = _inlined_image(src, folder)
            if inlined is None:  # not a file of the folder: nothing is fetched from elsewhere
                parts.append(f'<span class="image">[image: {html.escape(alt)}] {html.escape(src)}</span>')
            else:
                parts.append(f'<img alt="{html.escape(alt)}" src="{inlined}">')
        elif code is not None:
            parts.append(f"<code>{html.escape(code)}</code>")
        else:
            parts.append(f"<strong>{html.escape(bold)}</strong>")
        end = match.end()
    parts.append(html.escape(text[end:]))
    return "".join(parts)


def _inlined_image(src: str, folder: Path) -> str | None:
    """A data URI for a plain file name of the report folder; None for anything else."""
    kind = IMAGE_TYPES.get(Path(src).suffix.lower())
    path = folder / src
    if kind is None or "/" in src or "\\" in src or src.startswith(".") or not path.is_file():
        return None
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"
