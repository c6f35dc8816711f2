"""Writing results safely: atomic files, provenance (versions, git commit, machine)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import platform
import reprlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import normlab
from normlab import allocator
from normlab.checks import is_fraction, is_int, is_seconds
from normlab.model import native


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: never a half file. A folder
    where the file goes, or a file where a folder must, is one line naming the path (the OS
    named the temp file, or said "File exists"); so is any error the OS gives (a full disk, a
    folder that takes no files such as /proc)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{str(path)!r}: expected a file to write; it is a folder")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{str(path)!r} cannot be written: {str(blocker)!r} is a file, not a "
                         "folder")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~process_umask())  # mkstemp makes 0600; results should be readable
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):  # the OS named the temp file, which the user never chose
            raise cannot_write(path, err) from err
        raise
    _fsync_dir(path.parent)


def cannot_write(path: Path, err: OSError) -> OSError:
    """The OS's error on writing `path` as one line naming it: its temp file was named, or no
    file at all (a full disk). The same class (a caller may catch FileNotFoundError), and the
    folder it could not make, where that failed."""
    at = str(err.filename) if err.filename else ""
    ours = at == str(path) or Path(at).name.startswith(f".{Path(path).name}.")  # or its temp
    at = f" ({at!r})" if at and not ours else ""
    return type(err)(f"{str(path)!r} cannot be written: {err.strerror or err}{at}")


def process_umask() -> int:
    """The process umask, read where Linux shows it: setting it to read it would change it
    for every thread meanwhile."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (it lives in the folder's entry, not the file)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


FIGURE_DPI = 200
"""Every figure normlab writes, at a resolution a paper can print (they were 100-120 dpi)."""


def save_figure(fig: Any, path: Path, dpi: int = FIGURE_DPI) -> None:
    """A matplotlib figure written as atomically as any result file, then closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")
    finally:  # a failed save (an unknown format) left the figure open for the process's life
        plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def check_out_folder(path: Path, name: str = "--out") -> Path:
    """`path` as a folder results can be written into: one already, or one `mkdir` can make
    (its nearest existing parent a folder this process may write to). Checked before any work:
    an `analyze --hf --out` naming a file failed at its first write, after the whole analysis,
    with "[Errno 17] File exists", naming no option. `name` leads every error."""
    path = Path(path)
    try:  # a part past the file system's 255 bytes: a bare "[Errno 36] File name too long"
        if path.exists() and not path.is_dir():
            raise ValueError(f"{name} {str(path)!r}: expected a folder for the results; it is a "
                             "file")
        parent = path
        while not parent.exists():  # ends at the root, or at "." for a relative path
            if parent.is_symlink():  # mkdir would say "File exists"
                raise ValueError(f"{name} {str(path)!r}: {str(parent)!r} is a link to "
                                 f"{os.readlink(parent)!r}, which does not exist")
            parent = parent.parent
    except OSError as err:
        raise ValueError(f"{name} {str(path)!r}: not a path this system can make "
                         f"({err.strerror})") from None
    if not parent.is_dir():
        raise ValueError(f"{name} {str(path)!r}: expected a folder for the results; "
                         f"{str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {str(path)!r}: {str(parent)!r} is not writable here")
    return path


class FolderBusy(ValueError):
    """Another process holds the folder (`FolderLock.take`): the folder is its, not ours."""


class FolderLock:
    """An exclusive `flock` on a folder while this process works in it, so a second process
    is refused in one line (`busy`, with `{out}`): a job started twice (requeued while its first
    start still ran) trained both, their log lines interleaved; two sweeps on one --out made
    the same evaluations twice and each reported the other's runs as failed. Where the file
    system has no locks (some network ones) the work goes on unguarded, as before; the lock
    goes with the process, killed or not."""

    def __init__(self, busy: str) -> None:
        self.busy = busy
        self.fd: int | None = None

    def take(self, out: Path) -> None:
        """Lock `out`, made if missing (before anything in it is deleted or tidied); refuse if
        another process holds it."""
        if self.fd is not None:
            return
        check_out_folder(out).mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderBusy(self.busy.format(out=repr(str(out)))) from None
        except OSError:
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:  # released on every way out
        self.release()


#: what a second analysis of one folder is told while the first writes it
#: each lock's refusal says what else may hold the folder: it names the refused command's work,
#: and `train --out` a sweep's folder was told the folder was "being trained"
ANALYSING = ("{out} is being analysed by another process (or its run trained); wait for it to "
             "end")


#: the name of `written_together`'s staging folders, hidden in the folder they write into
STAGE_PREFIX = ".staging-"


def clear_stages(folder: Path) -> None:
    """Remove the staging folders a killed writer left in `folder`; only under its lock, where
    none can be a live writer's. A link or a file of that name is not ours and stays."""
    for stage in Path(folder).glob(f"{STAGE_PREFIX}*"):
        if stage.is_dir() and not stage.is_symlink():
            shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def removed_if_left_empty(out: Path) -> Iterator[None]:
    """An `out` the block makes is removed again where the block fails with nothing in it (a
    failed analysis, or a sweep whose Ray cluster was out of reach, left an empty folder)."""
    made = not Path(out).exists()
    try:
        yield
    except FolderBusy:  # made by the process that holds it now, between the look and the lock:
        raise  # removed, its lock sat on a deleted folder and a third process took a new one
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # kept where it holds anything
                Path(out).rmdir()
        raise


@contextlib.contextmanager
def written_together(out: Path, last: str, busy: str = ANALYSING,
                     name: str = "--out") -> Iterator[Path]:
    """A folder to write a set of result files into: they land in `out` only once the block
    ends without error, `last` last, the mark readers take for a whole set. Written one by one,
    a full disk left one new norms.json, which a rerun refused to replace, and a failure or kill
    while figures were drawn left new files beside an older set's. `out` is locked from the
    start of the block (`busy`: what a second writer is told; enter it before the work, so that
    a second is refused before it loads anything), what a killed writer left is cleared, and an
    `out` the block made is removed again where it fails with nothing in it. `name` leads the
    error where `out` is no folder to write into."""
    out = check_out_folder(out, name)
    with removed_if_left_empty(out), FolderLock(busy) as lock:
        lock.take(out)
        if lock.fd is not None:
            clear_stages(out)
        stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out))
        try:
            yield stage
            files = sorted((p.name for p in stage.iterdir()), key=lambda n: n == last)
            for f in files:  # a folder in a file's place is refused before any file lands
                if (out / f).is_dir():
                    raise ValueError(f"{str(out / f)!r}: expected a file to write; it is a "
                                     "folder")
            for f in files:
                os.replace(stage / f, out / f)
            _fsync_dir(out)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def refuse_overwrite(folder: Path, names: str | Iterable[str], force: bool) -> None:
    """Results already written stay unless the user asks (`--force`): a one-line error naming
    the first of `names` (the files a command writes, exact names, not patterns) in `folder`.
    Other files there are not the command's: a pattern (`*.json`) refused a user's notes.json
    that --force then never touched, and `p[1].png` matched p1.png, not itself."""
    folder = Path(folder)
    for name in sorted([names] if isinstance(names, str) else names):
        if not force and (folder / name).exists():
            raise ValueError(f"{str(folder / name)!r} already exists; pass --force to "
                             "overwrite it")


def recorded(path: Path, *keys: str) -> Any:
    """What a result file records under `keys` (None: no file, one that does not parse, or
    no such key): the checkpoint step it was made from, or its settings."""
    try:
        doc = json.loads(Path(path).read_text())
        for key in keys:
            doc = doc[key]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # nested past json's
        return None
    return doc


def read_json(path: Path, what: str = "JSON",
              valid: Callable[[Any], bool] = lambda doc: True) -> Any:
    """A JSON file's contents, or one line naming the file and `what` it should hold: an empty
    or cut-short file (a full disk, a hand edit) said only "Expecting value: line 1 column 1",
    and a wrong shape failed later with a KeyError."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as err:  # not JSON, or not UTF-8
        raise ValueError(f"{str(path)!r}: expected {what}; not valid JSON ({err})") from None
    except RecursionError:  # a bare RecursionError named no file
        raise ValueError(f"{str(path)!r}: expected {what}; not valid JSON (nested too deeply "
                         "to read)") from None
    try:
        ok = valid(doc)
    except (ArithmeticError, TypeError, KeyError, ValueError, RecursionError):
        ok = False  # a count too large for a float failed in the check: "out of memory or range"
    if not ok:
        raise ValueError(f"{str(path)!r}: expected {what}; got {reprlib.repr(doc)}")
    return doc


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=jsonable) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's `metrics.jsonl`, in order.

    A last line that does not parse is skipped (a running job may be writing it); a bad line
    anywhere else is a one-line error naming the file and line, since it means a damaged log.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists() and not path.is_file():  # a folder was "not found: is it a run folder?"
        raise ValueError(f"{str(path)!r} is not a file; expected the run's log there")
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: is {str(run_dir)!r} a run folder?")
    # bytes, each line decoded on its own: a kill can cut a multi-byte character short too
    lines = [(i, ln) for i, ln in enumerate(path.read_bytes().splitlines(), 1) if ln.strip()]
    records = []
    for k, (i, line) in enumerate(lines):
        try:
            rec = json.loads(line.decode())
        except (json.JSONDecodeError, UnicodeDecodeError):
            if k == len(lines) - 1:
                break
            raise ValueError(f"{str(path)!r} line {i}: not valid JSON") from None
        if not isinstance(rec, dict) or not is_int(rec.get("step")) or rec["step"] < 0:
            # `"step": true` read as step 1
            raise ValueError(f"{str(path)!r} line {i}: expected an object with an int 'step' "
                             ">= 0")
        acc = rec.get("accuracy", {})  # what the learning curves read
        if not isinstance(acc, dict) or not all(is_fraction(v) for v in acc.values()):
            raise ValueError(f"{str(path)!r} line {i}: expected 'accuracy' to map splits to "
                             f"numbers in [0, 1]; got {acc!r}")  # 57.0 was plotted as 5700%
        t = rec.get("elapsed_s")
        if t is not None and not is_seconds(t):
            raise ValueError(f"{str(path)!r} line {i}: expected 'elapsed_s' to be seconds >= 0; "
                             f"got {t!r}")  # "12" failed as "Unknown format code 'f'"
        records.append(rec)
    return records


def jsonable(x: Any) -> Any:
    """`json.dumps`'s `default`: numpy scalars, tensors and paths as JSON values."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} to JSON")


def git_commit() -> str | None:
    """The commit of the normlab source tree, with '-dirty' if a tracked file has local changes
    or an untracked one sits in `src/` or `configs/` (code and configs that ran, in no commit);
    None where normlab is not a git checkout of its own: an installed copy inside another
    project's repository recorded that project's commit, and `GIT_DIR` (a git hook's) another
    repository's."""
    root = Path(normlab.__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None
        sha = git("rev-parse", "HEAD")
        dirty = (git("status", "--porcelain", "--untracked-files=no")
                 or git("status", "--porcelain", "--untracked-files=all", "--", "src", "configs"))
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")


def provenance() -> dict[str, Any]:
    """What produced a result: versions, commit, machine, threads."""
    return {
        "normlab": normlab.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "native": native.describe(),
        "malloc": allocator.describe(),  # glibc keeping freed memory (the command) or not
    }
