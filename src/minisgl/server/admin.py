"""Routes about the server itself rather than one API: health, version and metrics (open to probes, no key),
behind the API key tokenize / detokenize, and the admin routes (`admin`): dropping the prefix cache (SGLang's and
vLLM's paths), which change what every client gets. Those need the API key where one is set, and a keyless
server serves them only with --enable-admin (check_admin): any local user can reach a loopback port."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl import __version__
from minisgl.errors import MiniSGLError
from minisgl.server.edge import EdgeRoute
from minisgl.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from minisgl.server.state import APIError, check_admin, check_key, server_of

probes = APIRouter(route_class=EdgeRoute)
router = APIRouter(dependencies=[Depends(check_key)], route_class=EdgeRoute)
admin = APIRouter(dependencies=[Depends(check_admin)], route_class=EdgeRoute)


def version_string() -> str:
    return __version__


@probes.get("/health")
async def health(request: Request) -> Response:
    server = server_of(request)
    try:
        await asyncio.wait_for(server.client.stats(), timeout=5.0)  # a round trip: is the daemon serving now?
    except (MiniSGLError, asyncio.TimeoutError) as e:
        reason = str(e) or "no answer within 5s"
        return APIError(503, f"the minisgl daemon is unavailable: {reason}", "service_unavailable").response()
    return JSONResponse({"status": "ok", "model": server.model_name})


# What other servers answer at these paths, for clients that probe them: Ollama's root ("Ollama is running",
# GET and HEAD, which its CLI and chat UIs check), vLLM's /version and /ping (the SageMaker liveness route).
@probes.api_route("/", methods=["GET", "HEAD"])
async def root(request: Request) -> Response:
    name = server_of(request).model_name
    return Response(f"minisgl is running ({name}): OpenAI /v1, Ollama /api, SGLang /generate", media_type="text/plain")


@probes.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": version_string()})


@probes.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return await health(request)


@probes.get("/metrics")
async def metrics(request: Request) -> Response:
    server = server_of(request)
    try:
        server.metrics.set_daemon_stats(await asyncio.wait_for(server.client.stats(), timeout=2.0))
    except (MiniSGLError, asyncio.TimeoutError):
        pass  # the server's own metrics are still worth scraping
    return Response(server.metrics.render(), media_type=server.metrics.content_type)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    server = server_of(request)
    await server.check_model(body.model)
    prompt, kwargs = body.tokenize_args()
    tokens = await server.client.tokenize(prompt, **kwargs)
    return TokenizeResponse(count=len(tokens), max_model_len=await server.context_len(), tokens=tokens)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    server = server_of(request)
    await server.check_model(body.model)
    return DetokenizeResponse(prompt=await server.client.detokenize(body.tokens))


# SGLang's and vLLM's names for dropping the prefix cache (what no running request holds).
@admin.post("/flush_cache")
@admin.post("/reset_prefix_cache")
async def flush_cache(request: Request) -> JSONResponse:
    stats = await server_of(request).client.flush_cache()
    return JSONResponse({"status": "ok", "cached_pages": stats["cached_pages"]})
