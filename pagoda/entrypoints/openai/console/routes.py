"""The console's routes. The page itself (/, /console/FILE) holds no data and is open; every
endpoint that returns data (/console/api/...) takes the server's API key like /v1, so with
--api-key nothing is shown without it. The page shows nothing beyond what /metrics and the request
log's non-prompt fields hold (prompts only where the server logs them, --log-prompts).

None of these routes is in the OpenAPI schema: they are the page's, not part of the API.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, JSONResponse

from pagoda import __version__
from pagoda.bench.html_report import report_fragment
from pagoda.entrypoints.openai.console.feed import EngineFeed
from pagoda.entrypoints.openai.console.page import NO_STORE, page_file
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.serving import ServerState

REPORT_DEPTH = 2  # --reports DIR: DIR itself and the result folders up to two levels below it


def page_routes() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def index() -> FileResponse:
        return _served("/")

    @router.get("/console/{name}")
    async def console_file(name: str) -> FileResponse:
        return _served(f"/console/{name}")

    return router


def data_routes(state: ServerState, feed: EngineFeed, reports: Path | None) -> APIRouter:
    router = APIRouter(prefix="/console/api", include_in_schema=False)

    @router.get("/info")
    async def info() -> dict:
        return engine_info(state, reports)

    @router.get("/feed")
    async def live(after: int = Query(0, ge=0), after_request: int = Query(0, ge=0)) -> JSONResponse:
        """Samples with seq > `after` and request rows with seq > `after_request` (0: everything held)."""
        return JSONResponse(feed.since(after, after_request), headers=NO_STORE)

    @router.get("/reports")
    async def report_list() -> dict:
        return {"reports": [] if reports is None else await asyncio.to_thread(report_folders, reports)}

    @router.get("/report")
    async def report(name: str) -> dict:
        """The report of a listed folder, by its name as the list gives it (a query parameter: the
        folder itself, ".", would not survive a URL's path)."""
        folder = None if reports is None else await asyncio.to_thread(find_report, reports, name)
        if folder is None:
            raise APIError(404, f"No report `{name}` under --reports.", "name", "not_found")
        text = await asyncio.to_thread((folder / "report.md").read_text, encoding="utf-8")
        return {"name": name, "html": await asyncio.to_thread(report_fragment, text, folder)}

    return router


def _served(path: str) -> FileResponse:
    found = page_file(path)
    if found is None:
        raise APIError(404, f"The console has no file `{path.removeprefix('/console/')}`.", "name", "not_found")
    return FileResponse(found[0], media_type=found[1], headers=NO_STORE)


def engine_info(state: ServerState, reports: Path | None) -> dict:
    """The model and the engine's main settings, as the page's header and settings card show them."""
    c = state.engine.config
    return {
        "version": __version__,
        "model": c.model.name,
        "architecture": c.model.architecture,
        "dtype": str(c.model.dtype).removeprefix("torch."),
        "quantization": c.model.quantization or "none",
        "device": str(c.device),
        "attention_backend": c.attention_backend,
        "cuda_graphs": c.use_cuda_graphs,
        "max_model_len": c.model.max_model_len,
        "max_num_seqs": c.scheduler.max_num_seqs,
        "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
        "scheduling_policy": c.scheduler.policy,
        "block_size": c.cache.block_size,
        "prefix_caching": c.cache.enable_prefix_caching,
        "kv_cache_memory_gib": c.cache.kv_cache_memory_gib if c.device.type == "cpu" else None,
        "gpu_memory_utilization": c.cache.gpu_memory_utilization if c.device.type == "cuda" else None,
        "deterministic": c.deterministic,
        "speculative": c.speculative and f"{c.speculative.method}, {c.speculative.num_speculative_tokens} tokens",
        "lora_adapters": sorted(state.adapters) if c.enable_lora else None,
        "auto_tool_choice": state.config.tools.enable_auto_tool_choice,
        "prompts_shown": state.config.log_prompts,
        "reports": reports is not None,
    }


def report_folders(root: Path) -> list[str]:
    """Result folders (those holding a report.md) under `root`, by name relative to it ("." for
    `root` itself), newest first."""
    found = [root] if (root / "report.md").is_file() else []
    level = [root]
    for _ in range(REPORT_DEPTH):
        level = sorted(child for folder in level for child in _subfolders(folder))
        found += [folder for folder in level if (folder / "report.md").is_file()]
    found.sort(key=lambda folder: (folder / "report.md").stat().st_mtime, reverse=True)
    return [folder.relative_to(root).as_posix() for folder in found]


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [child for child in folder.iterdir() if child.is_dir()]
    except OSError:  # unreadable: listed as empty
        return []


def find_report(root: Path, name: str) -> Path | None:
    """The folder of a listed report; only names `report_folders` lists resolve, so no path
    outside `root` can be asked for."""
    return root / name if name in report_folders(root) else None
