"""`normlab` command line: a thin layer over the library; every error is one line, exit 2 (a
sweep or reproduce whose runs failed, each named, exits 1)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normlab.allocator import keep_freed_memory
from normlab.checks import check_int, check_seed, check_threads


def _cmd_train(args: argparse.Namespace) -> int:
    from normlab.config import load_config
    from normlab.train import train

    # a resume reads the run's own config.toml too: one trained before a rule still resumes
    cfg = load_config(args.config, args.set or [], seed=args.seed, given=not args.resume)
    if args.device:
        from normlab.train import check_device_flag

        check_device_flag(args.device)
        cfg.train.device = args.device
    if args.compile:
        cfg.train.compile = True
    # a mistyped --out: said, not refused, since a job script may pass --resume on its first
    # start too (with --force as well, train refuses the pair: no note before the error)
    if args.resume and not args.force and not Path(args.out).exists():
        print(f"normlab: --resume: {args.out!r} does not exist; starting a new run there",
              file=sys.stderr)
    last = train(cfg, Path(args.out), resume=args.resume, force=args.force, progress=not args.quiet)
    if args.resume:  # results made before this resume now describe an earlier checkpoint
        out = Path(args.out)
        for cmd, path, keys in (
                ("eval", out / "eval.json", ("checkpoint", "step")),
                ("analyze", out / "analysis" / "interference.json", ("checkpoint_step",))):
            made = _recorded_step(path, *keys)
            if made is not None and made != last.get("step"):
                print(f"normlab: {str(path)!r} is from step {made}, training now ended at step "
                      f"{last.get('step')}; rerun `normlab {cmd} {shlex.quote(str(out))} "
                      "--force`", file=sys.stderr)
    print(json.dumps(last))
    return 0


def eval_run(run_dir: Path, *, limit: int | None = None, force: bool = False) -> dict[str, Any]:
    """Evaluate a run's newest checkpoint on every split; write eval.json and heatmap.png."""
    import torch

    from normlab.evaluate import answer_token_accuracy, check_limit, evaluate, heatmap
    from normlab.io import check_out_folder, provenance, recorded, refuse_overwrite, write_json
    from normlab.tasks.addition import eval_sets
    from normlab.train import check_run_folder, load_run

    check_limit(limit)
    check_run_folder(run_dir)  # a copied result: not "pass --force", which then failed too
    # where eval.json cannot be written, said before the evaluation, not after it (as analyze)
    check_out_folder(Path(run_dir), "eval: run folder")
    old = Path(run_dir) / "eval.json"
    if old.is_file() and not force:  # say what the old one is, where it is not the run's own
        made = _recorded_step(old, "checkpoint", "step")
        why = (stale(Path(run_dir), made, None, recorded(old, "config")) if made is not None
               else None)
        if why:
            raise ValueError(f"{str(old)!r} already exists, made from step {made}, {why}; pass "
                             "--force to overwrite it")
    refuse_overwrite(Path(run_dir), "eval.json", force)
    cfg, model, meta = load_run(run_dir)
    torch.set_num_threads(cfg.train.threads)
    task = cfg.task.resolve()
    sets = eval_sets(task)
    if limit is not None and all(len(p) <= limit for b in sets.values() for p in b.values()):
        limit = None  # every question asked: recorded as a --limit, it was starred in compare
    result = evaluate(model, task, sets, limit=limit)
    # Where in the answer each cell fails (teacher-forced; same questions as above).
    result["answer_tokens"] = [
        {"cell": str(cell), "split": split}
        | answer_token_accuracy(model, probs[:limit], answer_format=task.answer_format,
                                digit_positions=task.digit_positions)
        for split, by_cell in sets.items()
        for cell, probs in by_cell.items()
    ]
    result.update(
        {
            "config": cfg.to_dict(),
            "checkpoint": {
                "step": meta["step"],
                "sha256": meta["sha256"],
                "train_elapsed_s": meta.get("elapsed_s"),
            },
            "seed": cfg.train.seed,
            "eval_seed": task.eval_seed,
            "limit": limit,  # examples per cell (None: all), so reports compare like with like
            "provenance": provenance(),
        }
    )
    # no lock is taken (a run may be evaluated while it trains), so the run is looked at again:
    # a `train --force` while it was evaluated left the deleted run's results in the new one
    if retrained(Path(run_dir), cfg.to_dict(), meta):
        raise ValueError(f"{str(run_dir)!r} was trained again while it was evaluated (train "
                         "--force?); nothing written: evaluate it again")
    # the figure first: eval.json, written last, marks the evaluation done (a heatmap that
    # could not be written left an eval.json that a rerun then refused to replace)
    heatmap(
        result,
        task.train_cells,
        Path(run_dir) / "heatmap.png",
        title=f"{cfg.model.norm_placement} seed {cfg.train.seed}, step {meta['step']}: exact "
              f"match %{_per_cell(result)} (red: train cells)",
    )
    write_json(Path(run_dir) / "eval.json", result)
    return result


def _per_cell(result: dict[str, Any]) -> str:
    """", N a cell" where every cell has N questions (the heatmap's title), else ""."""
    counts = {c.get("count") for c in result["cells"]}
    return f", {counts.pop()} a cell" if len(counts) == 1 and None not in counts else ""


def retrained(run_dir: Path, config: Any, meta: dict[str, Any] | None = None) -> bool:
    """Whether `run_dir` now holds another run than the one of `config` (an evaluation's,
    where it records one) and, given, of checkpoint `meta`: trained again with --force under
    another config, or its checkpoint of that step another. What the run trained with is read
    from its train_done.json, else its newest checkpoint, never config.toml (a file a user may
    edit: an unfinished run's edited one refused every evaluation). A config or record that
    does not read says nothing here (their own checks name them)."""
    from normlab.checkpoint import list_checkpoints, sidecar_of
    from normlab.io import recorded
    from normlab.train import DONE, _comparable

    folder = Path(run_dir) / "checkpoints"
    now = recorded(Path(run_dir) / DONE, "config")
    if not isinstance(now, dict) and (sides := list_checkpoints(folder)):
        now = recorded(sides[-1], "config")
    try:
        if isinstance(config, dict) and isinstance(now, dict) and _comparable(
                now) != _comparable(config):
            return True
    except (ValueError, TypeError, KeyError, AttributeError):  # a config that does not read
        pass
    if meta is None:
        return False
    side = sidecar_of(folder, meta["step"])  # pruned since (a live run's): nothing to compare
    return side.is_file() and recorded(side, "sha256") != meta.get("sha256")


def stale(run_dir: Path, step: int, limit: int | None, config: Any = None) -> str | None:
    """Why an evaluation of `run_dir` made from checkpoint `step` (on `limit` questions a cell,
    under `config` where given) is not the finished run's, to follow "made from step N, ", or
    None: a run evaluated, then resumed, kept the earlier checkpoint's accuracy in `compare`,
    unmarked; one evaluated, then trained again with --force, the deleted run's."""
    from normlab.train import DONE

    if retrained(Path(run_dir), config):
        return "but the run was trained again since, under another config (train --force)"

    done = Path(run_dir) / DONE
    final = _recorded_step(done, "step")  # a damaged record is said, not raised after eval wrote
    why = []
    if not done.is_file() and not (Path(run_dir) / "checkpoints").is_dir():
        why.append(f"with no {DONE} or checkpoints/ to tell whether training finished")
    elif not done.is_file():
        why.append(f"before training finished (no {DONE})")
    elif final is None:
        why.append(f"but {DONE} records no step to compare it with")
    elif final != step:
        why.append(f"but training finished at step {final}")
    if limit is not None:
        why.append(f"on at most {limit} questions a cell (--limit)")
    return "; ".join(why) or None


def _recorded_step(path: Path, *keys: str) -> int | None:
    """The checkpoint step a result file records under `keys`; None if it cannot be read (the
    command that reads it refuses it by name)."""
    from normlab.io import recorded

    step = recorded(path, *keys)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _check_flags(args: argparse.Namespace, flags: dict[str, int]) -> None:
    """Counts given on the command line, checked under their flags' names (the library's own
    checks would name its parameter, `n_examples` for `--examples`). `flags`: flag -> lowest
    value; 0 is refused where it is below, not taken for "the default"."""
    for flag, low in flags.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            check_int(value, flag, low=low)


def _cmd_eval(args: argparse.Namespace) -> int:
    _check_flags(args, {"--limit": 1})
    result = eval_run(Path(args.run_dir), limit=args.limit, force=args.force)
    step = result["checkpoint"]["step"]
    why = stale(Path(args.run_dir), step, None)
    print(f"checkpoint step {step}" + (f" ({why})" if why else ""))
    for split, r in result["splits"].items():
        lo, hi = r["ci95"]
        print(
            f"{split:>14}: {100 * r['accuracy']:6.2f}%  [{100 * lo:.1f}, {100 * hi:.1f}]  "
            f"n={r['count']}"
        )
    print(f"wrote {Path(args.run_dir) / 'eval.json'} and heatmap.png")
    return 0


def _check_same_cells(results: list[tuple[Path, dict[str, Any]]]) -> None:
    """A column of `compare` is one split: runs whose split of that name holds other cells
    (another grid, or a split defined otherwise) measured something else under its name. Runs
    whose eval.json lists no cells (older ones) are not compared."""
    first: dict[str, tuple[list[str], Path]] = {}
    for d, r in results:
        if not isinstance(r.get("cells"), list):
            continue
        by_split: dict[str, list[str]] = {}
        for c in r["cells"]:
            if isinstance(c, dict) and "split" in c and "cell" in c:
                by_split.setdefault(str(c["split"]), []).append(str(c["cell"]))
        for split, cells in by_split.items():
            seen, where = first.setdefault(split, (sorted(cells), d))
            if sorted(cells) != seen:
                raise ValueError(f"{str(d / 'eval.json')!r}: split {split!r} holds cells "
                                 f"{', '.join(sorted(cells))}, {str(where / 'eval.json')!r}'s "
                                 f"{', '.join(seen)}; expected one split's runs to share its "
                                 "cells (compare puts them in one column)")


def compare_rows(run_dirs: Sequence[Path]) -> tuple[list[str], list[list[str]]]:
    """Split accuracies (with CI) of several evaluated runs, as table rows."""
    from normlab.curves import run_labels
    from normlab.evaluate import EVAL_RESULT, is_eval_result
    from normlab.io import read_json
    from normlab.stats import percent

    results = []
    for d in run_dirs:
        if Path(d).is_file():  # "run `normlab eval FILE` first", which then refused the file
            raise ValueError(f"RUN_DIR {str(d)!r} is a file; expected a run folder")
        path = Path(d) / "eval.json"
        if path.is_dir():
            raise ValueError(f"{str(path)!r}: expected the file `normlab eval` writes; "
                             "got a folder")
        if not path.is_file():
            # quoted: a folder "my run" was suggested as `normlab eval my run`, which fails
            raise ValueError(f"{str(path)!r} not found; run `normlab eval "
                             f"{shlex.quote(str(d))}` first")
        r = read_json(path, EVAL_RESULT, is_eval_result)
        results.append((Path(d), r))
    _check_same_cells(results)
    splits = list(dict.fromkeys(s for _, r in results for s in r["splits"]))
    header = ["run", "placement", "seed", "step", *splits]
    rows = []
    for (d, r), label in zip(results, run_labels([d for d, _ in results]), strict=True):
        step = _recorded_step(d / "eval.json", "checkpoint", "step")  # None: not recorded
        why = None if step is None else stale(d, step, r.get("limit"), r.get("config"))
        if why:  # marked in the table and said once, with the remedy where there is one
            fix = (f"`normlab eval {shlex.quote(str(d))} --force` evaluates the newest "
                   "checkpoint on every question" if (d / "checkpoints").is_dir()
                   else "a copied result: nothing here to evaluate again")
            print(f"normlab: {str(d / 'eval.json')!r}: made from step {step}, {why}; {fix}",
                  file=sys.stderr)
        cells = []
        for s in splits:
            v = r["splits"].get(s)
            cells.append(
                "-"
                if v is None
                else f"{percent(v['accuracy'], 1)} [{percent(v['ci95'][0], 1)}, "
                f"{percent(v['ci95'][1], 1)}]"
            )
        rows.append([label, r["config"]["model"]["norm_placement"],
                     str(r["config"]["train"]["seed"]),
                     "-" if step is None else f"{step}{' *' if why else ''}", *cells])
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cmd_compare(args: argparse.Namespace) -> int:
    from normlab.io import refuse_overwrite

    if args.force and not args.plot:  # accepted, and did nothing
        raise ValueError("--force: only with --plot (it overwrites the figure)")
    if args.curve is not None:  # "--curve ''" printed the accuracy table
        import dataclasses

        from normlab.curves import (
            check_same_split,
            curve_table,
            learning_curve,
            periodic_questions,
            plot_curves,
            run_labels,
        )

        check_same_split([Path(d) for d in args.run_dirs], args.curve)
        labels = run_labels(args.run_dirs)
        curves = [dataclasses.replace(learning_curve(Path(d), args.curve), name=label)
                  for d, label in zip(args.run_dirs, labels, strict=True)]
        header, rows = curve_table(curves)
        title = f"exact match % on {args.curve} (training seconds)"
        asked = {label: q for d, label in zip(args.run_dirs, labels, strict=True)
                 if (q := periodic_questions(Path(d))) is not None}
        if asked:  # which runs asked which count, unless all asked one ("16 / 32" named none)
            counts = sorted(set(asked.values()))
            which = (f"the first {counts[0]} questions a cell"
                     if len(asked) == len(labels) and len(counts) == 1 else "; ".join(
                         f"the first {n}{' questions a cell' if i == 0 else ''} in "
                         + ", ".join(k for k, q in asked.items() if q == n)
                         for i, n in enumerate(counts)))
            title += f"; {which} (train.eval_examples; `normlab eval` asks every question)"
        if args.plot:
            if Path(args.plot).is_dir():  # "already exists; pass --force", which then failed
                raise ValueError(f"--plot {args.plot!r}: expected a file to write the figure "
                                 "to; it is a folder")
            from matplotlib.figure import Figure

            kinds = Figure().canvas.get_supported_filetypes()  # matplotlib's own said no flag
            if Path(args.plot).suffix.lstrip(".").lower() not in kinds:
                raise ValueError(f"--plot {args.plot!r}: expected a figure file ending in one of "
                                 f"{', '.join('.' + k for k in sorted(kinds))}")
            refuse_overwrite(Path(args.plot).parent, Path(args.plot).name, args.force)
            plot_curves(curves, Path(args.plot), args.curve)
    else:
        if args.plot:
            raise ValueError("--plot: needs --curve SPLIT (it plots learning curves)")
        header, rows = compare_rows([Path(d) for d in args.run_dirs])
        title = "exact match % [95% CI]"
        if any(r[3].endswith("*") for r in rows):
            title += "; step *: not the finished run's checkpoint, or a --limit evaluation"
    if args.markdown or not sys.stdout.isatty():
        print(f"{title}\n")  # the units, also where the table is pasted
        print(markdown_table(header, rows))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in header:  # a split's whole name: 80 columns cut it to "interpolati…"
            table.add_column(h, min_width=len(h))
        for r in rows:
            table.add_row(*r)
        Console().print(table)
    return 0


#: `analyze`'s flags by the library parameter they set, whose checks name the parameter
ANALYZE_FLAGS = {"sigmas": "--sigmas", "threshold": "--threshold", "n_draws": "--draws",
                 "n_examples": "--examples", "targets": "--targets"}


def _cmd_analyze(args: argparse.Namespace) -> int:
    try:
        return _analyze(args)
    except ValueError as err:  # "sigmas[1]: ..." is "--sigmas[1]: ..." as the user typed it
        msg = str(err)
        for param, flag in ANALYZE_FLAGS.items():
            if msg.startswith((f"{param}:", f"{param}[")):
                raise ValueError(flag + msg.removeprefix(param)) from None
        raise


def _analyze(args: argparse.Namespace) -> int:
    from normlab.analysis.report import analyze_run

    kwargs: dict[str, Any] = {
        "threshold": args.threshold,
        "mode": args.mode,
        "noise": args.noise,
        "seed": args.seed,
        "targets": args.targets,  # "q,k", "qk" or "q, k", as the library reads them
    }
    if args.sigmas is not None:  # "" was taken as the defaults unseen
        try:
            kwargs["sigmas"] = [float(s) for s in args.sigmas.split(",")]
        except ValueError:
            raise ValueError(f"--sigmas: expected numbers separated by commas; got "
                             f"{args.sigmas!r}") from None
    if args.draws is not None:
        kwargs["n_draws"] = args.draws
    if args.examples is not None:
        kwargs["n_examples"] = args.examples
    # each mode's options only with it: an option the other mode takes was dropped unseen
    if args.hf and args.run_dir:
        raise ValueError("analyze: give RUN_DIR or --hf DIR, not both")
    if not args.hf:
        given = [f for f, v in (("--out", args.out), ("--tokens", args.tokens),
                                ("--text", args.text)) if v is not None]
        if given or args.seq_len is not None:
            raise ValueError(f"analyze: {(given or ['--seq-len'])[0]} is for --hf DIR only; a "
                             "run's analysis goes to RUN_DIR/analysis")
        if args.rows is not None:
            kwargs["rows"] = args.rows
    elif args.rows is not None:  # a text has no scored/unscored split of its own
        raise ValueError("analyze: --rows is for a run folder's analysis; with --hf every "
                         "real row counts")
    _check_flags(args, {"--draws": 1, "--examples": 1, "--seq-len": 2})
    check_seed(args.seed, "--seed")
    if args.threads is not None:
        import torch

        torch.set_num_threads(check_threads(args.threads, "--threads"))
    if args.hf:
        from normlab.interop.analyze import analyze_hf

        out = Path(args.out) if args.out else None
        if args.seq_len is not None:  # else analyze_hf's own default
            kwargs["seq_len"] = args.seq_len
        # analyze_hf refuses earlier results in --out itself, after its input checks
        done = analyze_hf(Path(args.hf), tokens=args.tokens, text=args.text, out=out,
                          overwrite=args.force, **kwargs)
    else:
        if not args.run_dir:
            raise ValueError("analyze: give RUN_DIR, or --hf DIR with --tokens/--text and --out")
        # earlier results refused by analyze_run itself, after its flag and folder checks
        done = analyze_run(Path(args.run_dir), overwrite=args.force, **kwargs)
    print(f"wrote {done['out']}: {', '.join(Path(f).name for f in done['files'])}")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from normlab.reproduce import RunsFailed, reproduce

    try:
        reproduce(args.profile, Path(args.out), jobs=args.jobs, device=args.device)
    except RunsFailed as err:  # each run named already, and left out of the written report
        print(f"normlab: error: {err}", file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from normlab.sweep import run_sweep

    failed = run_sweep(
        Path(args.config),
        Path(args.out),
        backend=args.backend,
        address=args.address,
        jobs=args.jobs,
        device=args.device,
    )
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="normlab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train one model from a TOML config")
    t.add_argument(
        "--config", required=True, help="TOML run config, e.g. configs/addition/pre.toml"
    )
    t.add_argument("--out", required=True, help="run folder to create (or resume)")
    t.add_argument("--seed", type=int, help="overrides train.seed")
    t.add_argument(
        "--set",
        action="append",
        metavar="TABLE.KEY=VALUE",
        help="override a config value, e.g. --set model.d_model=128 (repeatable)",
    )
    t.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="overrides train.device (auto: CUDA where there is one)")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (sets train.compile; a one-off "
                        "compile of tens of seconds on CPU)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument("--force", action="store_true",
                   help="start over: delete the files normlab wrote in --out (others are kept)")
    t.add_argument("--quiet", action="store_true",
                   help="no progress output on stderr (the final record still goes to stdout)")
    t.set_defaults(fn=_cmd_train)

    e = sub.add_parser("eval", help="evaluate a run on every split; writes eval.json")
    e.add_argument("run_dir", help="a run folder `normlab train` wrote")
    e.add_argument("--limit", type=int, help="at most this many examples per cell")
    e.add_argument("--force", action="store_true", help="overwrite an existing eval.json")
    e.set_defaults(fn=_cmd_eval)

    c = sub.add_parser("compare", help="table of split accuracies (or learning curves) across runs")
    c.add_argument("run_dirs", nargs="+", metavar="run_dir", help="evaluated run folders")
    c.add_argument("--markdown", action="store_true",
                   help="print a Markdown table (for a paper or an issue) instead of a rich one")
    c.add_argument("--curve", metavar="SPLIT",
                   help="learning curves of SPLIT from metrics.jsonl instead of eval.json")
    c.add_argument("--plot", metavar="PNG", help="with --curve: also plot them to this file")
    c.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    c.set_defaults(fn=_cmd_compare)

    a = sub.add_parser("analyze", help="norm spread, sparse heads, circuit collapse, interference")
    a.add_argument("run_dir", nargs="?", help="a trained run folder (or give --hf)")
    # the library's defaults, said here (tested to match): argparse's are None, so that
    # analyze_run and analyze_hf keep their own
    a.add_argument("--sigmas", help="comma-separated noise levels (default "
                   "0,0.01,0.02,0.05,0.1,0.15,0.2,0.3)")
    a.add_argument("--draws", type=int, help="noise draws per sigma (default 32)")
    a.add_argument("--examples", type=int,
                   help="evaluation sequences to analyse (default 256; with --hf, 32 rows)")
    a.add_argument("--threshold", type=float, default=0.9,
                   help="sparse-row threshold theta (default 0.9)")
    a.add_argument("--rows", choices=["all", "loss"],
                   help="query rows that may count as sparse: every real one (default), or "
                        "only those whose output reaches a position the training loss scores; "
                        "a run folder's analysis only")
    a.add_argument("--mode", choices=["token", "vector"], default="token",
                   help="token: one eps per token, shared by its q, k, v; vector: one per q, k, "
                        "v vector, head and token (default token)")
    a.add_argument("--noise", choices=["normal", "uniform"], default="normal",
                   help="N(0, sigma^2) or uniform +-sigma (default normal)")
    a.add_argument("--targets", default="q,k,v", help="subset of q,k,v to perturb (default all)")
    a.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    a.add_argument("--threads", type=int,
                   help="torch threads (default: torch's own, one per core; the run's "
                        "train.threads does not apply here)")
    a.add_argument("--hf", help="a local Hugging Face model folder (save_pretrained format)")
    a.add_argument("--tokens", help="with --hf: a file of whitespace-separated token ids")
    a.add_argument("--text", help="with --hf: a text file, tokenised with the folder's tokenizer")
    a.add_argument("--out", help="with --hf: output folder")
    a.add_argument("--seq-len", type=int,
                   help="with --hf: tokens a row (default 128; at most the model's context)")
    a.add_argument("--force", action="store_true", help="overwrite existing analysis files")
    a.set_defaults(fn=_cmd_analyze)

    r = sub.add_parser("reproduce", help="train, evaluate, analyse and report a whole profile")
    r.add_argument("--profile", default="quick", help="smoke, quick or paper (default quick)")
    r.add_argument("--out", required=True,
                   help="the study's folder: runs/, report.md, report.html, figures/")
    r.add_argument("--jobs", type=int, help="runs at once (default: the usable cores over a run's "
                   "threads)")
    r.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="override every run's train.device")
    r.set_defaults(fn=_cmd_reproduce)

    s = sub.add_parser("sweep", help="expand a grid of configs into runs and train them")
    s.add_argument("--config", required=True,
                   help="sweep file (TOML: base, name, [grid], [set], [run]; see the README)")
    s.add_argument("--out", required=True, help="folder of the runs, one folder each")
    s.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local process pool, or Ray (pip install 'normlab[ray]'; default local)")
    s.add_argument("--address", help="Ray cluster address (with --backend ray)")
    s.add_argument("--jobs", type=int, help="runs at once, local backend (default: the usable "
                   "cores over the most threads a run takes)")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="override every run's train.device")
    s.set_defaults(fn=_cmd_sweep)
    return p


PATH_ARGS = {"config": "--config", "out": "--out", "run_dir": "RUN_DIR", "run_dirs": "RUN_DIR",
             "plot": "--plot", "hf": "--hf", "tokens": "--tokens", "text": "--text"}
"""Every argument that names a file or folder, as the user wrote it."""


def _check_paths(args: argparse.Namespace) -> None:
    """An empty path (an unset shell variable) is refused by name: as a Path it is '.', the
    current folder, which was read as the run, config or output folder meant."""
    for dest, flag in PATH_ARGS.items():
        value = getattr(args, dest, None)
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError(f"{flag}: expected a path; got an empty string")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (a scheduler's stop, `kill`) as Ctrl-C: a sweep then ends its workers and a run
    # closes its log; by default the process died at once and left a sweep's workers training
    main_thread = threading.current_thread() is threading.main_thread()  # signals' only home
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        keep_freed_memory()  # this is normlab's own process (normlab.allocator says why)
        _check_paths(args)
        return args.fn(args)
    except BrokenPipeError:  # a reader that stopped early (`| head`): quiet, as `cat` is
        # stdout to /dev/null: the exit's flush raised again, "Exception ignored ..." (exit 120)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's code for a command its reader left
    except KeyboardInterrupt:
        runs = "; finished runs and checkpoints are kept (rerun it to continue)"
        kept = {"train": "; finished checkpoints are kept (rerun with --resume)", "sweep": runs,
                "reproduce": runs}.get(args.cmd, "")
        print(f"normlab: interrupted{kept}", file=sys.stderr)
        return 130
    # OSError names its file (a full disk); MemoryError and OverflowError come from a size in
    # the config past what fits
    except (ValueError, OSError, RuntimeError, MemoryError, OverflowError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        if isinstance(err, MemoryError | OverflowError):
            msg = f"out of memory or range ({msg}); is a size in the config too large?"
        print(f"normlab: error: {msg}", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
