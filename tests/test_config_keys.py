"""Every config key of every shipped experiment reaches code that uses it.

A key that is only declared, validated, printed or logged looks live to a user and does nothing
(``model.family`` was only printed, ``harness.*.version`` repeated the adapters' pins and was
ignored, ``trainer.num_generations`` was only checked against ``scheduler.group_size``). Each
experiment is composed with the whole harness list, its leaf keys are mapped to the typed schema,
and each must be read by the package (``config_reads``: a static scan, see its docstring). A key
that feeds another through an interpolation (``proxy.max_output_tokens: ${sampling.max_tokens}``)
is used when that key is.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from config_reads import SECTIONS, TOP, config_reads, schema_keys
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from fineenvs.paths import CONF_DIR

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
_REF = re.compile(r"\$\{([a-zA-Z0-9_.]+)\}")


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Leaf paths of an unresolved config (dict-valued schema fields like ``reward.terms`` are leaves)."""
    out: dict[tuple[str, ...], Any] = {}
    if isinstance(node, DictConfig) and not (len(prefix) == 2 and _is_dict_field(prefix)):
        for key in node.keys():
            out |= _leaves(node._get_node(key), (*prefix, str(key)))  # type: ignore[union-attr]
        return out
    out[prefix] = node._value() if hasattr(node, "_value") else node
    return out


def _is_dict_field(path: tuple[str, ...]) -> bool:
    section, key = path
    return section in SECTIONS and section != "harness" and (section, key) in _DICT_FIELDS


_DICT_FIELDS = {("reward", "terms"), ("model", "chat_template_kwargs")}


def _schema_key(path: tuple[str, ...]) -> tuple[str, str] | None:
    """(section, key) of a leaf path; ``harness.<name>.<key>`` is ``harness``'s ``key``."""
    if path[0] == "hydra":
        return None
    if len(path) == 1:
        return ("", path[0]) if path[0] in TOP else None
    if path[0] == "harness":
        return ("harness", path[2]) if len(path) >= 3 else None
    return (path[0], path[1]) if path[0] in SECTIONS else None


def experiment_keys(name: str) -> set[tuple[str, str]]:
    """The schema keys experiment ``name`` sets or inherits, including those only interpolated."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}", "harness=all"])
    leaves = _leaves(cfg)
    keys = {k for path in leaves if (k := _schema_key(path)) is not None}
    refs: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for path, value in leaves.items():
        for ref in _REF.findall(str(value)) if isinstance(value, str) else ():
            source = _schema_key(tuple(ref.split(".")))
            target = _schema_key(path)
            if source is not None and target is not None:
                refs.setdefault(source, set()).add(target)
    reads = config_reads()
    # An interpolated key is used when a key it feeds is.
    return {k for k in keys if k not in reads and not (refs.get(k, set()) & reads)}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_key_of_the_experiment_is_read(name: str) -> None:
    unread = experiment_keys(name)
    assert not unread, (
        f"+experiment={name} sets keys nothing in fineenvs/ reads (declared, validated or printed only): "
        + ", ".join(".".join(k for k in key if k) for key in sorted(unread))
        + ". Make a component consume each, or delete it from the schema and conf/."
    )


def test_every_schema_key_is_read() -> None:
    """Also the keys no shipped experiment sets (a user may)."""
    unread = schema_keys() - config_reads()
    assert not unread, sorted(unread)


def test_the_scan_does_not_count_display_or_validation(tmp_path: Any) -> None:
    pkg = tmp_path / "fineenvs"
    pkg.mkdir()
    (pkg / "config.py").write_text("def check(run):\n    return run.trainer.learning_rate > 0\n")
    (pkg / "a.py").write_text(
        "import logging\n"
        "def describe_plan(run):\n    return run.model.family\n"
        "def f(run):\n"
        "    print(run.model.dtype)\n"
        "    logging.info('%s', run.model.seed)\n"
        "    t, s = run.trainer, run.scheduler\n"
        "    x = {n: h.weight for n, h in run.harness.items()}\n"
        "    if s.passes < 1:\n        raise ValueError(f'{t.epsilon}')\n"
        "    return t.beta, run.harness['pi'].step_limit, run.seed\n"
        "def g(m: 'MiniReproSettings'):\n    return m.rl_steps\n"
    )
    reads = config_reads(pkg)
    assert reads == {
        ("trainer", "beta"),
        ("harness", "weight"),
        ("harness", "step_limit"),
        ("scheduler", "passes"),
        ("", "seed"),
        ("recipe", "rl_steps"),
    }


def test_interpolated_keys_count_through_their_target() -> None:
    cfg = OmegaConf.create(
        {"sampling": {"max_tokens": 7}, "proxy": {"max_output_tokens": "${sampling.max_tokens}"}}
    )
    leaves = _leaves(cfg)
    assert leaves[("proxy", "max_output_tokens")] == "${sampling.max_tokens}"
