"""Each setting's default has one home: its settings dataclass.

An option file under ``conf/<group>/`` sets only what makes it that option; a key set to the value
its dataclass already defaults to is a second home that drifts (``dtype`` once defaulted to float32
in one place and bfloat16 in another). In the option each group starts from (``conf/config.yaml``'s
defaults list), a value that differs from the dataclass default says why on its line (or in a
comment right above it).
Interpolations (``${sampling.temperature}``) say where a value comes from and are left alone.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra.core.config_store import ConfigStore

from fineenvs.config import register_configs
from fineenvs.paths import CONF_DIR

GROUPS_WITHOUT_SCHEMA = {"experiment", "sweep", "cluster", "harness"}
"""Experiments and sweeps override across groups; ``harness`` options are dicts of harness specs."""


def _schema_of(group: str, option: dict[str, Any]) -> type | None:
    names = [d for d in option.get("defaults") or [] if isinstance(d, str) and d.endswith("_schema")]
    if not names:
        return None  # an option built on another option (``defaults: [tiny_agent]``)
    register_configs()
    node = ConfigStore.instance().repo[group][f"{names[0]}.yaml"].node
    schema = node._metadata.object_type
    assert isinstance(schema, type)
    return schema


def _defaults(schema: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            value: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        if value == "???":  # omegaconf.MISSING: the option must set it
            continue
        out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def _options() -> list[Path]:
    return sorted(
        p
        for group in CONF_DIR.iterdir()
        if group.is_dir() and group.name not in GROUPS_WITHOUT_SCHEMA
        for p in group.glob("*.yaml")
    )


def _starting_options() -> set[Path]:
    config = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    picked = [d for d in config["defaults"] if isinstance(d, dict)]
    return {
        CONF_DIR / group / f"{name}.yaml"
        for entry in picked
        for group, name in entry.items()
        if "/" not in group and not group.startswith("override") and name is not None  # `recipe: null`
    }


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def restated(option: Path) -> list[str]:
    """Keys of ``option`` set to the value its schema already defaults to."""
    data = yaml.safe_load(option.read_text()) or {}
    schema = _schema_of(option.parent.name, data)
    if schema is None:
        return []
    defaults = _defaults(schema)
    return [k for k, v in data.items() if k in defaults and not _is_interpolation(v) and v == defaults[k]]


def silent(option: Path) -> list[str]:
    """Keys of ``option`` that differ from their schema's default with no comment saying why."""
    text = option.read_text()
    data = yaml.safe_load(text) or {}
    schema = _schema_of(option.parent.name, data)
    if schema is None:
        return []
    defaults = _defaults(schema)
    said: set[str] = set()  # keys with a comment on their line or right above it
    previous = ""
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            if "#" in line or previous.startswith("#"):
                said.add(line.split(":", 1)[0])
        previous = line
    return [
        k
        for k, v in data.items()
        if k in defaults and not _is_interpolation(v) and v != defaults[k] and k not in said
    ]


@pytest.mark.parametrize("option", _options(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_option_does_not_restate_a_default(option: Path) -> None:
    found = restated(option)
    assert not found, (
        f"{option.relative_to(CONF_DIR.parent)} sets {', '.join(found)} to the value its settings "
        "dataclass already defaults to: a second home for the same value. Delete the line (the "
        "dataclass field holds the default and its reason)."
    )


@pytest.mark.parametrize("option", sorted(_starting_options()), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_starting_option_says_why_it_differs_from_a_default(option: Path) -> None:
    found = silent(option)
    assert not found, (
        f"{option.relative_to(CONF_DIR.parent)} differs from its settings dataclass's defaults on "
        f"{', '.join(found)} without saying why. Add the reason as a comment on the line, or change "
        "the dataclass default if this is the value every run should start from."
    )


def test_the_checks_find_a_restated_and_an_unexplained_value(tmp_path: Path) -> None:
    option = tmp_path / "trainer" / "grpo.yaml"
    option.parent.mkdir()
    option.write_text(
        "defaults: [grpo_schema]\nlearning_rate: 3.0e-6\nseed: ${seed}\nmax_steps: 5\n"
        "# fewer steps for this option\nsave_steps: 5\nbeta: 0.1  # with a KL term\n"
    )
    assert restated(option) == ["learning_rate"]
    assert silent(option) == ["max_steps"]


def test_the_engine_section_agrees_with_the_vllm_command_it_builds() -> None:
    """``VLLMServeArgs`` models ``vllm serve``'s command line for the launcher (usable without a run
    config); where a run's ``engine.*`` knob maps one to one onto an argument, both defaults must
    be the same value, so a run and a direct launch start the same server."""
    import dataclasses

    from fineenvs.config import EngineSpec
    from fineenvs.engine.vllm import VLLMServeArgs

    def defaults(cls: type) -> dict[str, Any]:
        return {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }

    engine, command = defaults(EngineSpec), defaults(VLLMServeArgs)
    # Knobs whose run default means "derive it" (None, auto, 0 = a free port) differ on purpose.
    derived = {"dtype", "max_model_len", "platform", "port", "weight_sync", "devices"}
    shared = sorted(set(engine) & set(command) - derived)
    assert len(shared) >= 8, shared
    differing = {k: (engine[k], command[k]) for k in shared if engine[k] != command[k]}
    assert not differing, f"engine.* defaults differ from VLLMServeArgs': {differing}"
