"""The console page's own files (static/), by the path each is served at. Read by the loaded
app's routes and by the app that answers while the model loads, so that the page opens from the
first second and waits for the engine itself (it imports nothing heavy)."""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"console.js": "text/javascript", "console.css": "text/css"}
NO_STORE = {"Cache-Control": "no-store"}


def route_path(path: str, root_path: str) -> str:
    """`path` as the app routes it: without `root_path` where it begins with it (a proxy that kept
    its prefix), else as it is (one that stripped it)."""
    root = root_path.rstrip("/")
    return path[len(root) :] if root and path.startswith(root + "/") else path


def page_file(path: str) -> tuple[Path, str] | None:
    """The file and media type served at `path` (below the root path): `/` the page, and
    `/console/NAME` its script and style sheet; None for any other path."""
    if path == "/":
        return STATIC / "index.html", "text/html"
    name = path.removeprefix("/console/")
    if name != path and name in PAGE_FILES:
        return STATIC / name, PAGE_FILES[name]
    return None
