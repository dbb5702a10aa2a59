"""A FAKE of vLLM's weight-transfer control routes (not vLLM): records what the trainer side sends.

The real vLLM CPU server cannot open a NCCL group, so the test of vLLM's own trainer-side NCCL
engine (``test_vllm_parsers.py``) needs a server that answers the routes that engine drives
(``/get_world_size``, ``/init_weight_transfer_engine``, ``/pause``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/reset_prefix_cache``, ``/resume``,
``/weight_info``, ``/shutdown_weight_transfer_engine``) the way vLLM 0.33's RL router answers them,
and keeps every request. The payloads it records are then checked with vLLM's own dataclasses.
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def control_recorder(world_size: int = 1) -> tuple[Starlette, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    state: dict[str, Any] = {"version": "default"}

    async def handle(request: Request) -> JSONResponse:
        route = request.url.path.lstrip("/")
        body = await request.json() if request.method == "POST" and await request.body() else None
        events.append({"route": route, "query": dict(request.query_params), "body": body})
        if route == "get_world_size":
            return JSONResponse({"world_size": world_size})
        if route == "finish_weight_update" and body and body.get("weight_version") is not None:
            state["version"] = body["weight_version"]
        if route == "update_weight_version":
            state["version"] = body["new_version"]
        if route == "weight_info":
            return JSONResponse({"weight_version": state["version"]})
        if route == "reset_prefix_cache":
            return JSONResponse({"success": True})
        return JSONResponse({"status": "ok"})

    names = [
        "get_world_size", "init_weight_transfer_engine", "pause", "start_weight_update", "update_weights",
        "finish_weight_update", "reset_prefix_cache", "resume", "weight_info", "update_weight_version",
        "shutdown_weight_transfer_engine",
    ]  # fmt: skip
    routes = [Route(f"/{name}", handle, methods=["GET", "POST"]) for name in names]
    return Starlette(routes=routes), events
