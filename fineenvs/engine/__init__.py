"""Inference engines behind one contract: an OpenAI-compatible URL that returns prompt and
completion token IDs with one processed logprob per sampled token.

- ``launch_transformers_engine``: the embedded transformers engine (CPU, or one GPU), as a child.
- ``launch_vllm``: vLLM with the published serve command (GPU machines).
- ``attach``: any running server (``engine.url=...``).
- ``probe_engine`` / ``require_training_grade``: can this engine produce training data?
- ``WeightSync`` implementations push trainer weights into the engine.

Importing this package imports neither torch nor vllm (``python -m fineenvs.engine`` runs the
embedded server; see ``server.py``).
"""

from fineenvs.engine.handle import EngineHandle, EngineLaunch, attach, launch_transformers_engine, launch_vllm
from fineenvs.engine.launcher import (
    EngineStartError,
    EngineUnavailableError,
    free_port,
    launched,
    launched_async,
    require_cuda,
)
from fineenvs.engine.probe import (
    EngineGradeError,
    EngineProbeError,
    Grade,
    ProbeReport,
    probe_engine,
    require_training_grade,
)
from fineenvs.engine.vllm import (
    ServingProfile,
    VLLMServeArgs,
    build_serve_command,
    build_serve_env,
    published_serve_args,
    write_chat_template,
)
from fineenvs.engine.weights import (
    EmbeddedWeightSync,
    VLLMControlPlane,
    VLLMNcclWeightSync,
    VLLMReloadWeightSync,
    WeightSync,
    WeightSyncError,
)

__all__ = [
    "EmbeddedWeightSync",
    "EngineGradeError",
    "EngineHandle",
    "EngineLaunch",
    "EngineProbeError",
    "EngineStartError",
    "EngineUnavailableError",
    "Grade",
    "ServingProfile",
    "ProbeReport",
    "VLLMControlPlane",
    "VLLMNcclWeightSync",
    "VLLMReloadWeightSync",
    "VLLMServeArgs",
    "WeightSync",
    "WeightSyncError",
    "attach",
    "build_serve_command",
    "build_serve_env",
    "free_port",
    "launch_transformers_engine",
    "launch_vllm",
    "launched",
    "launched_async",
    "probe_engine",
    "published_serve_args",
    "require_cuda",
    "require_training_grade",
    "write_chat_template",
]
