"""Command line: list, show and grade tasks; generate the demo set.

    python -m fineenvs.tasks list tasks=demo                      # or: list --tasks demo
    python -m fineenvs.tasks list tasks=smoldataenvs path=/data/harbor split=test difficulty=hard
    python -m fineenvs.tasks show demo-a-sales_orders [--gold]
    python -m fineenvs.tasks grade demo-a-sales_orders 84         # an answer ...
    python -m fineenvs.tasks grade demo-a-sales_orders run/answer.txt   # ... or a file
    python -m fineenvs.tasks grade path/to/tasks/<task_id> answer.txt --score-only
    python -m fineenvs.tasks generate-demo /tmp/demo [--seed N]

Options may be written Hydra style (``tasks=demo``, ``tasks.split=test``) or as flags (``--tasks demo``).
Exit codes: 0 ok, 1 ungraded (grader could not decide), 2 bad input.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from fineenvs.tasks import (
    DEMO_SEED,
    TASK_SETS,
    Task,
    TaskError,
    TaskFilter,
    TrainingSubset,
    generate_demo,
    grade,
    load_tasks,
)
from fineenvs.tasks.harbor import read_harbor_task
from fineenvs.tasks.smoldataenvs import TaskSetUnavailableError

OPTIONS = ("tasks", "split", "path", "revision", "limit", "layout", "seed", "difficulty", "subset")


def _hydra_to_flags(argv: list[str]) -> list[str]:
    out = []
    for token in argv:
        key, sep, value = token.partition("=")
        key = key.removeprefix("tasks.") if key.startswith("tasks.") else key
        if sep and not token.startswith("-") and key in OPTIONS:
            out += [f"--{key}", value]
        else:
            out.append(token)
    return out


def _parser() -> argparse.ArgumentParser:
    source = argparse.ArgumentParser(add_help=False)
    source.add_argument("--tasks", default="demo", help=f"task set: {' | '.join(TASK_SETS)} (default demo)")
    source.add_argument("--split", default="train", help="train | test | eval")
    source.add_argument("--path", default=None, help="local copy of the task set (Harbor or row layout)")
    source.add_argument("--revision", default=None, help="Hub revision (commit sha) to pin")
    source.add_argument("--layout", default=None, choices=("harbor", "rows"))
    source.add_argument("--seed", type=int, default=DEMO_SEED, help="demo set seed")
    source.add_argument(
        "--subset",
        default=None,
        help="a training subset named in conf/tasks/<tasks>.yaml (published_1000: 400 medium + 600 hard)",
    )
    parser = argparse.ArgumentParser(prog="python -m fineenvs.tasks", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lister = sub.add_parser("list", parents=[source], help="list tasks")
    lister.add_argument("--limit", type=int, default=None)
    lister.add_argument("--difficulty", default=None, help="easy | medium | hard")
    show = sub.add_parser("show", parents=[source], help="show one task")
    show.add_argument("task", help="task id, or a Harbor task directory")
    show.add_argument("--gold", action="store_true", help="also print the hidden answer")
    grader = sub.add_parser("grade", parents=[source], help="grade an answer (text, or a file holding it)")
    grader.add_argument("task", help="task id, or a Harbor task directory")
    grader.add_argument("answer", help="the answer text, a file holding it, or - for stdin")
    grader.add_argument("--score-only", action="store_true", help="print only the score (for verifiers)")
    gen = sub.add_parser("generate-demo", help="write the demo set into a new directory")
    gen.add_argument("out_dir")
    gen.add_argument("--seed", type=int, default=DEMO_SEED)
    return parser


def _source_tasks(args: argparse.Namespace, filters: TaskFilter | None = None) -> list[Task]:
    return load_tasks(
        args.tasks,
        split=args.split,
        path=args.path,
        revision=args.revision,
        layout=args.layout,
        seed=args.seed,
        filters=filters,
        limit=getattr(args, "limit", None),
        subset=None if args.subset in (None, "null", "none") else _named_subset(args.tasks, args.subset),
    )


def _named_subset(tasks: str, name: str) -> TrainingSubset:
    """A training subset named in ``conf/tasks/<tasks>.yaml`` (``subsets``), where runs read it too."""
    from omegaconf import OmegaConf

    from fineenvs.paths import CONF_DIR

    path = CONF_DIR / "tasks" / f"{tasks}.yaml"
    conf = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    subsets = (conf.get("subsets") if isinstance(conf, dict) else None) or {}
    if name not in subsets:
        raise TaskError(
            f"unknown subset {name!r} of the {tasks} tasks; choose one of {sorted(subsets) or 'none'} "
            f"({path} lists them) or null"
        )
    return TrainingSubset(name, **{k: int(v) for k, v in subsets[name].items()})


def _find_task(args: argparse.Namespace) -> Task:
    if Path(args.task, "task.toml").is_file():
        return read_harbor_task(Path(args.task))
    tasks = _source_tasks(args)
    for task in tasks:
        if task.task_id == args.task:
            return task
    close = difflib.get_close_matches(args.task, [t.task_id for t in tasks], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; `list tasks={args.tasks}` shows the ids"
    raise TaskError(f"no task {args.task!r} in tasks={args.tasks} split={args.split}{hint}")


def _read_answer(answer: str) -> str:
    if answer == "-":
        return sys.stdin.read()
    path = Path(answer)
    if len(answer) < 4096 and path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    return answer


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_hydra_to_flags(list(sys.argv[1:] if argv is None else argv)))
    try:
        if args.command == "list":
            difficulties = tuple(args.difficulty.split(",")) if args.difficulty else None
            tasks = _source_tasks(args, TaskFilter(difficulties=difficulties))
            for task in tasks:
                files = ",".join(sorted(task.input_files)) or "-"
                print(f"{task.task_id}\t{task.difficulty}\t{task.hidden.answer_type}\t{files}")
            print(f"{len(tasks)} tasks (tasks={args.tasks} split={args.split})", file=sys.stderr)
        elif args.command == "show":
            task = _find_task(args)
            print(f"task_id:    {task.task_id}\ndifficulty: {task.difficulty}")
            print(f"answer:     type={task.hidden.answer_type} match={task.hidden.match_mode} "
                  f"atol={task.hidden.atol:g} rtol={task.hidden.rtol:g}")  # fmt: skip
            if args.gold:
                print(f"gold:       {task.hidden.gold}")
            for name, source in sorted(task.input_files.items()):
                print(f"input:      {name} <- {source}")
            print(f"\n{task.instruction}")
        elif args.command == "grade":
            task = _find_task(args)
            result = grade(_read_answer(args.answer), task.hidden)
            if args.score_only:
                if result.score is not None:
                    print(result.score)
            else:
                print(f"score: {result.score}\nreason: {result.reason}")
            return 0 if result.score is not None else 1
        elif args.command == "generate-demo":
            out = generate_demo(Path(args.out_dir), args.seed)
            print(f"demo set (seed {args.seed}) written to {out}")
    except (TaskError, FileExistsError, TaskSetUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
