"""Push trainer weights into a running engine: one protocol, three transports.

``WeightSync.push(weights, version) -> int`` takes either an in-memory state dict (HF parameter
names, the trainer's tensors) or a checkpoint directory, and returns the weight version the engine
serves afterwards. Completions record that version (the embedded engine returns it on every
response; vLLM with ``return_weight_versions``), which is how staleness is counted.

- ``EmbeddedWeightSync``: the embedded transformers engine. Saves safetensors under the run's
  staging folder and calls ``POST /update_weights_from_path``.
- ``VLLMReloadWeightSync``: any vLLM started with ``VLLM_SERVER_DEV_MODE=1``. Saves a checkpoint,
  then ``/pause?mode=wait`` (in-flight requests finish on the old weights), ``/collective_rpc
  reload_weights``, ``/update_weight_version``, and always ``/resume``.
- ``VLLMNcclWeightSync``: vLLM with ``--weight-transfer-config '{"backend":"nccl"}'``. Broadcasts
  tensors GPU to GPU through vLLM's NCCL weight-transfer engine, imported only when the first push
  happens (the trainer process then needs CUDA and an importable vllm).

Not covered: sharded (FSDP) state dicts (gather on rank 0 before calling ``push``), LoRA deltas,
vLLM's IPC and sparse backends.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from fineenvs.engine.launcher import free_port

if TYPE_CHECKING:
    import torch

Weights = Mapping[str, "torch.Tensor"] | Path


class WeightSyncError(RuntimeError):
    """The engine rejected or failed a weight update; the message carries its answer."""


class WeightSync(Protocol):
    def push(self, weights: Weights, version: int) -> int:
        """Make the engine serve ``weights`` as ``version``; return the version it reports."""
        ...

    def close(self) -> None: ...


def save_safetensors(state_dict: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write ``state_dict`` as ``directory/model.safetensors`` (CPU, contiguous, shared storage split:
    tied embeddings share memory, which safetensors refuses to serialise twice)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen:
            t = t.clone()
        seen.add((t.untyped_storage().data_ptr(), int(t.storage_offset())))
        tensors[name] = t
    path = directory / "model.safetensors"
    tmp = directory / "model.safetensors.partial"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)  # a reader never sees a half-written file
    return path


def _check(response: httpx.Response, what: str) -> httpx.Response:
    if response.status_code >= 400:
        raise WeightSyncError(
            f"{what}: {response.request.method} {response.request.url} answered {response.status_code}: "
            f"{response.text[:500]}"
        )
    return response


class _StagedWeights:
    """Per-version staging folders under ``staging_dir``, keeping the last ``keep`` versions."""

    def __init__(self, staging_dir: Path, keep: int) -> None:
        self.staging_dir = staging_dir
        self.keep = max(1, keep)
        self._dirs: list[Path] = []

    def stage(self, weights: Weights, version: int) -> Path:
        if isinstance(weights, Path):
            if not weights.exists():
                raise FileNotFoundError(f"Checkpoint {weights} does not exist; nothing to push.")
            return weights.resolve()
        directory = (self.staging_dir / f"v{version:06d}").resolve()
        save_safetensors(weights, directory)
        self._dirs.append(directory)
        return directory

    def prune(self) -> None:
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)


class EmbeddedWeightSync:
    """Weight sync for the embedded transformers engine (``POST /update_weights_from_path``)."""

    def __init__(
        self, url: str, staging_dir: Path, *, client: httpx.Client | None = None, keep: int = 1
    ) -> None:
        self.url = url.rstrip("/")
        self._staged = _StagedWeights(staging_dir, keep)
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=600.0)

    def push(self, weights: Weights, version: int) -> int:
        path = self._staged.stage(weights, version)
        body = {"path": str(path), "weight_version": version}
        answer = _check(
            self.client.post(self.url + "/update_weights_from_path", json=body), "weight update"
        ).json()
        self._staged.prune()
        return int(answer["weight_version"])

    def close(self) -> None:
        if self._own_client:
            self.client.close()


class VLLMReloadWeightSync:
    """Save a checkpoint and make vLLM reload it from disk (needs ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(
        self,
        url: str,
        staging_dir: Path,
        *,
        client: httpx.Client | None = None,
        keep: int = 1,
        reload_timeout_s: float = 1800.0,
    ) -> None:
        self.url = url.rstrip("/")
        self._staged = _StagedWeights(staging_dir, keep)
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=reload_timeout_s)

    def push(self, weights: Weights, version: int) -> int:
        # Write before pausing: saving is the slow part and generation continues meanwhile.
        path = self._staged.stage(weights, version)
        _check(self.client.post(self.url + "/pause", params={"mode": "wait"}), "pause (drain in-flight)")
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
            _check(self.client.post(self.url + "/collective_rpc", json=rpc), "reload_weights")
            _check(
                self.client.post(self.url + "/update_weight_version", json={"new_version": str(version)}),
                "update_weight_version",
            )
        finally:
            _check(self.client.post(self.url + "/resume"), "resume")
        self._staged.prune()
        return version

    def close(self) -> None:
        if self._own_client:
            self.client.close()


class NcclTransport(Protocol):
    """Trainer side of the NCCL data plane (the HTTP control plane lives in VLLMNcclWeightSync)."""

    def init(self, master_address: str, master_port: int, world_size: int) -> None: ...

    def send(self, items: Iterable[tuple[str, torch.Tensor]], packed: bool) -> None: ...


class VLLMNcclTransport:
    """vLLM's ``NCCLWeightTransferEngine`` trainer helpers, imported on first use only."""

    def __init__(self) -> None:
        self._group: Any = None

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self._group = NCCLWeightTransferEngine.trainer_init(
            {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        )

    def send(self, items: Iterable[tuple[str, torch.Tensor]], packed: bool) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        args = NCCLTrainerSendWeightsArgs(group=self._group, packed=packed)
        NCCLWeightTransferEngine.trainer_send_weights(iterator=iter(items), trainer_args=args)


@dataclass
class NcclEndpoint:
    """Where vLLM's workers meet the trainer (rank 0) for the NCCL group."""

    master_address: str = "127.0.0.1"
    master_port: int = 0
    """0 picks a free port."""


class VLLMNcclWeightSync:
    """Native vLLM weight transfer: HTTP control plane, NCCL broadcast of the tensors."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: NcclEndpoint | None = None,
        client: httpx.Client | None = None,
        transport: NcclTransport | None = None,
        packed: bool = True,
        timeout_s: float = 1800.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.endpoint = endpoint or NcclEndpoint()
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=timeout_s)
        self.transport = transport or VLLMNcclTransport()
        self.packed = packed
        self._ready = False

    def _post_in_thread(
        self, path: str, body: dict[str, Any], errors: list[BaseException]
    ) -> threading.Thread:
        # These calls block server-side until the trainer joins the collective, so they run
        # concurrently with the trainer's half of the handshake.
        def call() -> None:
            try:
                _check(self.client.post(self.url + path, json=body), path.lstrip("/"))
            except BaseException as exc:  # re-raised on the caller's thread after join
                errors.append(exc)

        thread = threading.Thread(target=call, name=f"vllm{path}", daemon=True)
        thread.start()
        return thread

    def _join(self, thread: threading.Thread, errors: list[BaseException]) -> None:
        thread.join()
        if errors:
            raise errors[0]

    def init(self) -> None:
        inference_world = int(
            _check(self.client.get(self.url + "/get_world_size"), "get_world_size").json()["world_size"]
        )
        port = self.endpoint.master_port or free_port(self.endpoint.master_address)
        world_size = inference_world + 1  # the trainer is rank 0, vLLM's workers follow
        init_info = {
            "master_address": self.endpoint.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
        }
        errors: list[BaseException] = []
        thread = self._post_in_thread("/init_weight_transfer_engine", {"init_info": init_info}, errors)
        self._run_transport_side(
            lambda: self.transport.init(self.endpoint.master_address, port, world_size), thread, errors
        )
        self._ready = True

    def _run_transport_side(
        self, trainer_side: Callable[[], None], thread: threading.Thread, errors: list[BaseException]
    ) -> None:
        try:
            trainer_side()
        finally:
            self._join(thread, errors)

    def push(self, weights: Weights, version: int) -> int:
        if isinstance(weights, Path):
            raise ValueError(
                f"VLLMNcclWeightSync broadcasts in-memory tensors, not checkpoint directories ({weights}). "
                "Pass the state dict, or use engine.weight_sync=reload to load a checkpoint from disk."
            )
        if not self._ready:
            self.init()
        items = list(weights.items())
        update_info = {
            "names": [name for name, _ in items],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "packed": self.packed,
        }
        _check(self.client.post(self.url + "/pause", params={"mode": "wait"}), "pause (drain in-flight)")
        try:
            _check(
                self.client.post(self.url + "/start_weight_update", json={"is_checkpoint_format": True}),
                "start_weight_update",
            )
            errors: list[BaseException] = []
            thread = self._post_in_thread("/update_weights", {"update_info": update_info}, errors)
            self._run_transport_side(lambda: self.transport.send(items, self.packed), thread, errors)
            _check(
                self.client.post(self.url + "/finish_weight_update", json={"weight_version": str(version)}),
                "finish_weight_update",
            )
        finally:
            _check(self.client.post(self.url + "/resume"), "resume")
        return version

    def close(self) -> None:
        if self._ready:
            try:
                self.client.post(self.url + "/shutdown_weight_transfer_engine")
            except httpx.HTTPError:
                pass  # the server may already be gone at shutdown
        if self._own_client:
            self.client.close()
