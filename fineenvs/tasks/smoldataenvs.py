"""SmolDataEnvs: from a local directory (Harbor or flat row layout) or from the Hugging Face Hub.

Hub sources (``FineEnvs`` organisation): the Harbor layout is one dataset repo per split,
``FineEnvs/SmolDataEnvs-harbor-{train,test,eval}``; the row layout is ``FineEnvs/SmolDataEnvs``
with splits train/test/eval. Pass ``revision=<commit sha>`` to pin a download. `PINNED_REVISIONS`
holds the commits this project has verified; it is empty because no machine of this project has
reached the Hub yet, so an unpinned load logs a warning and records the commit it resolved to in
every task's metadata (``source_revision``). Without network, loading fails with
`TaskSetUnavailableError`, which says how to load from a local copy instead.

Input data: upstream tasks pull their tables from a Hub bucket (``bucket_prefix``) inside the
container; staging those buckets is not implemented here. Tasks whose files are not present
locally carry ``metadata["inputs_local"] = False``; `TaskFilter(require_inputs=True)` drops them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fineenvs.tasks.harbor import is_harbor_dir, read_harbor_dir
from fineenvs.tasks.model import Task, TaskError
from fineenvs.tasks.row_layout import find_rows_file, read_rows, task_from_row

log = logging.getLogger(__name__)

SPLITS = ("train", "test", "eval")
HUB_ORG = "FineEnvs"
ROWS_REPO = f"{HUB_ORG}/SmolDataEnvs"
HARBOR_REPOS = {split: f"{HUB_ORG}/SmolDataEnvs-harbor-{split}" for split in SPLITS}
PINNED_REVISIONS: dict[str, str] = {}
LAYOUTS = ("harbor", "rows")


class TaskSetUnavailableError(RuntimeError):
    """The task set could not be fetched (no network, no Hub access, unknown revision)."""


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise TaskError(f"split={split!r} is not one of {SPLITS} (tasks.split=train|test|eval)")


def load_local(path: Path, *, split: str, layout: str | None = None) -> list[Task]:
    """Tasks of `split` from a local directory, detecting the layout unless `layout` is given.

    Harbor: ``path/<split>/tasks/<id>/`` or ``path/tasks/<id>/`` (a directory per split, as on
    the Hub). Rows: ``path/<split>.jsonl|.json|.parquet`` or ``path/data/<split>-*.parquet``.
    """
    check_split(split)
    path = Path(path)
    if not path.is_dir():
        raise TaskError(f"tasks.path={str(path)!r} is not a directory")
    if layout not in (None, *LAYOUTS):
        raise TaskError(f"layout={layout!r} is not one of {LAYOUTS}")
    harbor_root = path / split if is_harbor_dir(path / split) else path
    if layout in (None, "harbor") and is_harbor_dir(harbor_root):
        return read_harbor_dir(harbor_root, split=split)
    rows_files = find_rows_file(path, split)
    if layout in (None, "rows") and rows_files:
        rows = read_rows(rows_files)
        files_root = path / "files"
        source = f"rows:{path}"
        return [task_from_row(r, files_root=files_root if files_root.is_dir() else None, split=split, source=source)
                for r in rows]  # fmt: skip
    raise TaskError(
        f"no {split!r} tasks found in {path} (layout={layout or 'auto'}); expected either the Harbor layout "
        f"({path}/{split}/tasks/<task_id>/task.toml or {path}/tasks/<task_id>/task.toml) or rows "
        f"({path}/{split}.jsonl, {split}.parquet, or data/{split}-*.parquet)"
    )


def load_hub(*, split: str, revision: str | None = None, layout: str = "harbor") -> list[Task]:
    """Download `split` from the Hub (needs network) and load it. Raises `TaskSetUnavailableError`."""
    check_split(split)
    if layout not in LAYOUTS:
        raise TaskError(f"layout={layout!r} is not one of {LAYOUTS}")
    repo = HARBOR_REPOS[split] if layout == "harbor" else ROWS_REPO
    revision = revision or PINNED_REVISIONS.get(repo)
    if revision is None:
        log.warning(
            "loading %s at its newest revision (unpinned); pass revision=<commit sha> to pin it", repo
        )
    try:
        if layout == "harbor":
            tasks, resolved = _hub_harbor(repo, split, revision)
        else:
            tasks, resolved = _hub_rows(repo, split, revision)
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - every download failure gets the same actionable message
        raise TaskSetUnavailableError(unavailable_message(repo, revision, exc)) from exc
    for task in tasks:
        task.metadata.update(source_repo=repo, source_revision=resolved)
    return tasks


def unavailable_message(repo: str, revision: str | None, exc: BaseException) -> str:
    return (
        f"could not fetch SmolDataEnvs from the Hugging Face Hub ({repo}, revision {revision or 'unpinned'}): "
        f"{type(exc).__name__}: {exc}\n"
        "This machine cannot reach the Hub (no network, or HF_HUB_OFFLINE=1). Either download the dataset "
        f"on a machine that can (`hf download {repo} --repo-type dataset --local-dir DIR`) and load it "
        "with tasks.path=DIR, or use the offline demo set: tasks=demo."
    )


def _hub_harbor(repo: str, split: str, revision: str | None) -> tuple[list[Task], str | None]:
    from huggingface_hub import snapshot_download

    local = Path(snapshot_download(repo_id=repo, repo_type="dataset", revision=revision))
    # The snapshot directory is named after the commit it resolved to.
    return load_local(local, split=split, layout="harbor"), local.name


def _hub_rows(repo: str, split: str, revision: str | None) -> tuple[list[Task], str | None]:
    from datasets import load_dataset

    dataset = load_dataset(repo, split=split, revision=revision)
    source = f"hub:{repo}"
    tasks = [task_from_row(dict(row), files_root=None, split=split, source=source) for row in dataset]
    fingerprint = getattr(dataset, "_fingerprint", None)
    return tasks, revision or (str(fingerprint) if fingerprint else None)
