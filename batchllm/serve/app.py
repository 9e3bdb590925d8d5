"""The HTTP layer: OpenAI's Files and Batches endpoints under `/v1`, the page at `/`.

Every refusal is OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`),
unknown routes and malformed requests included; an unexpected error is a 500 in that shape,
never a stopped server. With an API key, every route wants `Authorization: Bearer KEY`
(the page, which a browser opens, also takes the key as HTTP Basic's password); `/health`, which
says nothing but that the server is up, wants none.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchllm.serve.api_errors import ApiError
from batchllm.serve.batches import COMPLETION_WINDOW_S, BatchStore, check_metadata
from batchllm.serve.files import FileStore, Limits
from batchllm.serve.page import BatchView, render_page
from batchllm.serve.runner import Runner
from batchllm.serve.validation import ENDPOINTS
from batchllm.serve.worker import Worker


@dataclass
class Service:
    data: Path
    files: FileStore
    batches: BatchStore
    worker: Worker
    api_key: str | None = None

    def batch_object(self, batch_id: str) -> dict:
        record = self.batches.get(batch_id)
        return record.to_object(self.worker.counts(record))


def open_service(data: Path, runner: Runner, models: dict[str, str], *, limits: Limits = Limits(), api_key: str | None = None,
                 poll_s: float = 0.5, gather_s: float = 1.0) -> Service:
    data.mkdir(parents=True, exist_ok=True)
    files, batches = FileStore(data / "files", limits), BatchStore(data / "batches")
    return Service(data, files, batches, Worker(data, batches, files, runner, models, poll_s=poll_s, gather_s=gather_s), api_key)


def _error(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(value.strip().encode(), key.encode())
    if scheme.lower() == "basic":
        try:
            password = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
        return hmac.compare_digest(password.encode(), key.encode())
    return False


def _page_limit(value: str | None, default: int, most: int, param: str) -> int:
    if value is None:
        return default
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise ApiError(400, f"{param} must be an integer from 1 to {most}", param=param, code="invalid_value")
    return limit


def _listing(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.worker.start()
        try:
            yield
        finally:
            service.worker.stop()

    app = FastAPI(title="batchllm serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if service.api_key is not None and request.url.path != "/health" and not _authorized(request, service.api_key):
            headers = {"WWW-Authenticate": 'Basic realm="batchllm serve"'} if request.url.path == "/" else None
            return _error(ApiError(401, "Incorrect API key provided. Give the key of the server's --api-key-env variable "
                                        "as `Authorization: Bearer KEY`.", code="invalid_api_key"), headers)
        if request.method == "POST" and request.url.path == "/v1/files":
            declared = request.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > service.files.limits.max_file_bytes + 64 * 1024:
                return _error(service.files._too_large())
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        first = (error.errors() or [{}])[0]
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return _error(ApiError(400, f"{param or 'the request'}: {first.get('msg', 'invalid')}", param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error(ApiError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return _error(ApiError(500, f"the server failed: {type(error).__name__}: {error}", type="server_error"))

    # --- files
    @app.post("/v1/files")
    def upload_file(file: UploadFile = File(...), purpose: str = Form(...)) -> dict:
        return service.files.upload(file.file, file.filename or "", purpose, file.size).to_object()

    @app.get("/v1/files")
    def list_files(purpose: str | None = None, after: str | None = None, limit: str | None = None, order: str = "desc") -> dict:
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be asc or desc", param="order", code="invalid_value")
        files, more = service.files.listing(purpose=purpose, after=after, limit=_page_limit(limit, 10_000, 10_000, "limit"),
                                         order=order)
        return _listing([f.to_object() for f in files], more)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict:
        return service.files.get(file_id).to_object()

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        stored = service.files.get(file_id)
        return FileResponse(service.files.content_path(file_id), media_type="application/octet-stream",
                            filename=stored.filename)

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict:
        service.files.get(file_id)
        if service.batches.uses_file(file_id):
            raise ApiError(400, f"file {file_id!r} is the input of a batch that has not ended; cancel it or wait for it",
                           param="file_id", code="file_in_use")
        service.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # --- batches
    @app.post("/v1/batches")
    async def create_batch(request: Request) -> dict:
        try:
            body: Any = json.loads(await request.body() or b"null")
        except ValueError:
            raise ApiError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        input_file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
        if not isinstance(input_file_id, str):
            raise ApiError(400, "input_file_id is required", param="input_file_id", code="missing_required_parameter")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}", param="endpoint",
                           code="invalid_value")
        if window not in COMPLETION_WINDOW_S:
            raise ApiError(400, f"completion_window {window!r} is not supported; use '24h'", param="completion_window",
                           code="invalid_value")
        metadata = check_metadata(body.get("metadata"))
        try:
            stored = service.files.get(input_file_id)
        except ApiError:
            raise ApiError(400, f"no file with id {input_file_id!r}", param="input_file_id", code="invalid_value") from None
        if stored.purpose != "batch":
            raise ApiError(400, f"file {input_file_id!r} has purpose {stored.purpose!r}, not 'batch'", param="input_file_id",
                           code="invalid_value")
        record = service.batches.create(input_file_id, endpoint, window, metadata)
        service.worker.validate_soon(record.id)
        return record.to_object()

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: str | None = None) -> dict:
        records, more = service.batches.newest(after=after, limit=_page_limit(limit, 20, 100, "limit"))
        return _listing([r.to_object(service.worker.counts(r)) for r in records], more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict:
        return service.batch_object(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict:
        service.worker.cancel(batch_id)
        return service.batch_object(batch_id)

    # --- the page
    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        records, _ = service.batches.newest(limit=1_000)
        views = []
        for record in records:
            progress = service.worker.progress(record)
            counts = None if progress is None else (record.total, progress.completed, progress.failed)
            views.append(BatchView(record.to_object(counts), progress.eta_s if progress else None,
                                   progress.output_tokens_per_s if progress else None))
        files, _ = service.files.listing()
        return HTMLResponse(render_page(views, len(files), service.files.stored_bytes()))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    return app
