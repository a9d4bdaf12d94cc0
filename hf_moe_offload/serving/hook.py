"""The one place that reaches into `transformers serve`: which model manager it builds, and one more route.

transformers 5 has no extension point for either: `Serve.__init__` imports `ModelManager` and `build_server` from
their modules when it runs and calls them with fixed arguments. `offload_serving()` swaps those two module names
while the server runs (in the `hf-moe-offload serve` process, which serves nothing else) and puts them back after.
`check_transformers()` verifies each thing relied on (here and in `served_batching`) and names the one that
changed; tests call it.

A request that fails inside generation (a failed expert read, mostly) gets a JSON error response from
`_failed_request` instead of escaping the app: an exception that escapes makes uvicorn close the connection, and
a client's next request on it would fail too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from transformers.cli import serve
from transformers.cli.serving import model_manager, server
from transformers.generation.continuous_batching import continuous_api

from ..policy.offload_policy import OffloadPolicy
from .manager import OffloadModelManager, stats_payload
from .request_checks import CheckedRequests
from .served_batching import NO_ROOM

logger = logging.getLogger(__name__)

STATS_ROUTE = "/v1/offload/stats"
# What `Serve.__init__` must import at call time for the swap to reach it.
CALL_TIME_IMPORTS = ("from .serving.model_manager import ModelManager", "from .serving.server import build_server")
LOAD_MODEL_PARAMS = ("self", "model_id_and_revision", "tqdm_class", "progress_callback", "gguf_file")
# What `served_batching` calls or patches on transformers' continuous-batching classes.
CB_MEMBERS = {"ContinuousBatchingManager": ("_generation_loop_body", "_generation_step", "cancel_request",
                                              "is_running"),
              "ContinuousBatchProcessor": ("handle_batch_error", "_handle_request_error", "prepare_next_batch"),
              "PagedAttentionCache": ("compute_free_capacity",)}
# Errors a failed request raises through the route (a CB worker's death keeps transformers' own 503 handler).
FAILED_REQUEST_ERRORS = (RuntimeError, OSError, ValueError)


class TransformersServeChanged(RuntimeError):
    """The installed transformers no longer has what the offload hook relies on."""


def check_transformers() -> None:
    """Raise `TransformersServeChanged` naming what changed when transformers' server no longer has what
    `offload_serving` relies on."""
    problems = []
    source = inspect.getsource(serve.Serve.__init__)
    problems += [f"Serve.__init__ no longer runs `{line}`" for line in CALL_TIME_IMPORTS if line not in source]
    params = tuple(inspect.signature(model_manager.ModelManager._load_model).parameters)
    if params != LOAD_MODEL_PARAMS:
        problems.append(f"ModelManager._load_model takes {params}, expected {LOAD_MODEL_PARAMS}")
    for name in ("model_manager", "generation_state"):
        if name not in inspect.signature(server.build_server).parameters:
            problems.append(f"build_server() has no `{name}` argument")
    if "self.loaded_models" not in inspect.getsource(model_manager.ModelManager.__init__):
        problems.append("ModelManager keeps no `loaded_models`")
    for cls_name, members in CB_MEMBERS.items():
        cls = getattr(continuous_api, cls_name, None)
        problems += [f"{cls_name}.{m} is gone" for m in members if cls is None or not hasattr(cls, m)]
    if "self.output_router.result_handlers" not in inspect.getsource(
            continuous_api.ContinuousBatchingManager.register_result_handler):
        problems.append("ContinuousBatchingManager keeps no `output_router.result_handlers`")
    if hasattr(continuous_api, "ContinuousBatchProcessor") and NO_ROOM not in inspect.getsource(
            continuous_api.ContinuousBatchProcessor.prepare_next_batch):
        problems.append("a request too long for the KV cache no longer raises the error `served_batching` handles")
    if problems:
        raise TransformersServeChanged("transformers serve changed; hf-moe-offload serve needs updating: "
                                       + "; ".join(problems))


@contextlib.contextmanager
def offload_serving(policy: OffloadPolicy, cb_overrides: dict[str, Any] | None = None) -> Iterator[None]:
    """While inside, `transformers.cli.serve.Serve` loads models with `policy` and its app answers
    `/v1/offload/stats`; `cb_overrides` are the `--cb-*` fields (see `OffloadModelManager`)."""
    check_transformers()
    original_manager, original_build = model_manager.ModelManager, server.build_server
    model_manager.ModelManager = functools.partial(OffloadModelManager, policy=policy, cb_overrides=cb_overrides)
    server.build_server = functools.partial(_build_server, original_build)
    try:
        yield
    finally:
        model_manager.ModelManager, server.build_server = original_manager, original_build


def _build_server(original, model_manager, *args: Any, generation_state=None, **kwargs: Any):
    """transformers' app, plus the stats route, and its generation threads stopped when the app shuts down."""
    app = original(model_manager, *args, generation_state=generation_state, **kwargs)
    app.add_api_route(STATS_ROUTE, lambda: stats_payload(model_manager), methods=["GET"])
    app.add_middleware(CheckedRequests)          # a malformed field: a 400 naming it, not a 500 from inside
    for error in FAILED_REQUEST_ERRORS:
        app.add_exception_handler(error, _failed_request)
    own_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_):
        async with own_lifespan(app_):
            yield
        # transformers stops the continuous-batching worker only in its test helper (`kill_server`).
        if generation_state is not None:
            generation_state.shutdown()

    app.router.lifespan_context = lifespan
    return app


async def _failed_request(request: Any, error: Exception) -> Any:
    """A 500 in OpenAI's error shape (`{"error": {"message": ..., "type": "server_error"}}`: the openai client
    shows the message) for a request whose generation failed; logged with its traceback."""
    from fastapi.responses import JSONResponse   # the serve extra's; this module is imported without it

    logger.error("hf_moe_offload serve: %s %s failed: %s", request.method, request.url.path, error, exc_info=error)
    return JSONResponse({"error": {"message": str(error), "type": "server_error", "param": None, "code": None}},
                        status_code=500)
