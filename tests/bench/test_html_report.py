"""report.html: report.md's markdown as escaped HTML, the folder's plots inlined."""

from __future__ import annotations

import base64

from pagoda.bench.html_report import report_fragment, write_report_html

MARKDOWN = """# pagoda bench report

Command: `pagoda bench --api-key ***`

## Engines

- **a<b>**: model `m` at http://x
  - launch: `serve <script>`

## Results: a

| metric | c=1 |
| --- | --- |
| output tokens/s (higher is better) | 1,234.5 |

## Plots

![throughput](plot.png)
![elsewhere](../secret.png)
![remote](http://tracker.example/pixel.png)
"""


def test_markdown_becomes_escaped_html_with_its_plots_inlined(tmp_path):
    (tmp_path / "plot.png").write_bytes(b"\x89PNG fake")
    (tmp_path.parent / "secret.png").write_bytes(b"\x89PNG other")
    html = report_fragment(MARKDOWN, tmp_path)
    assert "<h1>pagoda bench report</h1>" in html and "<h2>Results: a</h2>" in html
    assert "<li><strong>a&lt;b&gt;</strong>: model <code>m</code> at http://x</li>" in html
    assert "<li>launch: <code>serve &lt;script&gt;</code></li>" in html
    assert html.count("<ul>") == 2 and html.count("</ul>") == 2  # the nested list
    assert "<th>metric</th><th>c=1</th>" in html and "<td>1,234.5</td>" in html and "---" not in html
    inlined = base64.b64encode(b"\x89PNG fake").decode()
    assert f'<img alt="throughput" src="data:image/png;base64,{inlined}">' in html
    # only the folder's own files are read, and nothing is fetched from elsewhere
    assert '<span class="image">[image: elsewhere] ../secret.png</span>' in html
    assert '<span class="image">[image: remote] http://tracker.example/pixel.png</span>' in html
    assert html.count("<img") == 1


def test_write_report_html_is_a_whole_document(tmp_path):
    (tmp_path / "report.md").write_text(MARKDOWN)
    path = write_report_html(tmp_path, "pagoda bench report")
    text = path.read_text()
    assert path.name == "report.html" and text.startswith("<!doctype html>")
    assert "prefers-color-scheme: dark" in text and "http" not in text.split("<main>")[0]  # nothing to fetch
