"""Zero-shot tasks through lm-eval's HFLM wrapper (optional dependency).

``--tasks`` entries may be, in any mix:

- a task YAML file (``my_task.yaml``): lm-eval loads it directly, so a task whose data
  is a local file (``dataset_path: json`` + ``dataset_kwargs: {data_files: ...}``) runs
  with no network at all;
- a task folder: added to lm-eval's include path (``TaskManager(include_path=...)``);
  every task defined in it runs, and its task names become usable as plain names;
- a registered task name (``arc_easy``), whose dataset must already be in the local
  Hugging Face datasets cache when offline.

Each kind of failure gets its own message: a YAML syntax error names the file and line,
an unknown name lists close matches, and only a real dataset download failure says the
data must be available offline.

Task files are data unless the user says otherwise. lm-eval runs Python from a task
YAML in two ways: a ``!function`` tag imports a module beside it, and its Jinja
templates (``doc_to_text``...) render in an unsandboxed environment that can reach
Python's internals. So unless ``trust_code`` (``--trust-task-code``) is given, every
task YAML — and every file it includes — is scanned and one with ``!function`` is
refused, and templates render in jinja2's sandbox. Registered task names are lm-eval's
own installed tasks and run as lm-eval runs them.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.errors import ConfigError, DataError, LowbitError

# exception classes (anywhere in the cause chain) that mean "could not fetch the dataset"
_DOWNLOAD_ERRORS = {"ConnectionError", "OfflineModeIsEnabled", "DatasetNotFoundError", "LocalEntryNotFoundError",
                    "HfHubHTTPError", "RequestException", "Timeout", "ConnectTimeout", "ReadTimeout",
                    "RepositoryNotFoundError", "GatedRepoError"}
_YAML_SUFFIXES = (".yaml", ".yml")


@dataclass
class TaskSpecs:
    """What to hand lm-eval: task specs (names or YAML paths) and folders for its include path."""

    specs: list[str] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # registered names still to check against the index


TRUST_HINT = ("lowbit runs code from task files only with --trust-task-code: read the Python it names first, "
              "then pass --trust-task-code (or use a task without it)")


def zero_shot(model: Any, tokenizer: Any, tasks: list[str], limit: int | None = None,
              batch_size: int = 8, trust_code: bool = False) -> dict:
    """Accuracy-style metrics per task (see module docstring for what ``tasks`` may hold).

    trust_code: allow ``!function`` in task files and render their templates unsandboxed.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ModuleNotFoundError:
        raise LowbitError("zero-shot tasks need lm-eval: pip install 'lowbit[eval]'") from None
    parsed = parse_tasks(tasks, trust_code)
    manager = task_manager(parsed)
    specs = resolve(parsed, manager)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        with contextlib.nullcontext() if trust_code else sandboxed_templates():
            out = lm_eval.simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit)
    except Exception as e:  # noqa: BLE001 - lm-eval and datasets raise many types; classified below
        raise explain_failure(e, specs) from None
    return {task: {k: v for k, v in res.items() if isinstance(v, (int, float))}
            for task, res in out["results"].items()}


def parse_tasks(tasks: list[str], trust_code: bool = False) -> TaskSpecs:
    """Sort ``--tasks`` entries into YAML files, folders and names; broken YAML, and (unless
    ``trust_code``) task files that would run Python, are refused here, before any model loads."""
    parsed = TaskSpecs()
    for raw in tasks:
        entry = raw.strip()
        if not entry:
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            for f in _yaml_files(path):
                check_yaml(f, trust_code)
            parsed.folders.append(path.resolve())
        elif path.is_file():
            if path.suffix.lower() not in _YAML_SUFFIXES:
                raise ConfigError(f"task file {path} is not a .yaml/.yml lm-eval task config")
            check_yaml(path, trust_code)
            parsed.specs.append(str(path.resolve()))
        elif path.suffix.lower() in _YAML_SUFFIXES or "/" in entry or "\\" in entry:
            raise ConfigError(f"task file or folder {entry} does not exist; pass an existing task YAML, a folder of "
                              "task YAMLs, or a registered lm-eval task name")
        else:
            parsed.names.append(entry)
    if not (parsed.specs or parsed.folders or parsed.names):
        raise ConfigError("--tasks is empty; pass task names, task YAML files or task folders, comma-separated")
    return parsed


def check_yaml(path: Path, trust_code: bool = False) -> None:
    """Parse a task YAML so a syntax error is reported as one, with its line.

    lm-eval's index skips files it cannot parse, which would turn a typo into an
    "unknown task". Tags (``!function``) are recorded, never run: without ``trust_code``
    a file that has one, or includes one that has, is refused.
    """
    cfg = _load_yaml(path, trust_code, seen=set())
    if not isinstance(cfg, dict) or not ({"task", "group", "tag", "include"} & set(cfg)):
        raise ConfigError(f"task file {path} is not an lm-eval task config (it needs a 'task' or 'group' key)")


def _load_yaml(path: Path, trust_code: bool, seen: set[Path]) -> Any:
    """One task YAML parsed with its tags recorded; its ``include`` files are scanned too (as lm-eval loads them)."""
    import yaml

    tags: list[tuple[str, str, int]] = []

    class _Loader(yaml.SafeLoader):
        pass

    def record(loader: Any, suffix: str, node: Any) -> None:
        tags.append((node.tag, str(getattr(node, "value", ""))[:80], node.start_mark.line + 1))

    _Loader.add_multi_constructor("!", record)
    try:
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"task file {path} has a YAML syntax error{where}: {what}; fix the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read task file {path} ({e})") from None
    if tags and not trust_code:
        tag, value, line = tags[0]
        raise ConfigError(f"task file {path} runs Python ({tag} {value} at line {line}); {TRUST_HINT}")
    seen.add(path.resolve())
    for inc in _includes(cfg, path):
        if inc.resolve() not in seen:
            if not inc.is_file():
                raise ConfigError(f"task file {path} includes {inc}, which does not exist; fix the include")
            _load_yaml(inc, trust_code, seen)
    return cfg


def _includes(cfg: Any, path: Path) -> list[Path]:
    """The files a task YAML's ``include`` names, resolved as lm-eval resolves them (as given, else beside it)."""
    names = cfg.get("include") if isinstance(cfg, dict) else None
    names = [names] if isinstance(names, str) else names if isinstance(names, list) else []
    out = []
    for name in names:
        if isinstance(name, str):
            p = Path(name)
            out.append(p if p.is_file() else path.parent / name)
    return out


@contextlib.contextmanager
def sandboxed_templates() -> Iterator[None]:
    """Render lm-eval's Jinja templates in jinja2's sandbox for the body.

    lm-eval renders ``doc_to_text`` and the other templates with a plain Jinja
    environment, where ``{{ cycler.__init__.__globals__.os }}`` reaches the os module.
    The sandbox refuses such attribute access while ordinary templates render the
    same. Every lm-eval module that bound lm-eval's ``apply_template`` gets the
    sandboxed one until the body ends.
    """
    import sys

    import lm_eval.utils as lm_utils
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    original = lm_utils.apply_template
    env = SandboxedEnvironment(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True)
    plain = getattr(lm_utils, "env", None) or getattr(original, "_env", None)
    env.filters.update(getattr(plain, "filters", {}))
    if "regex_replace" not in env.filters and hasattr(lm_utils, "regex_replace"):
        env.filters["regex_replace"] = lm_utils.regex_replace
    compile_ = functools.lru_cache(maxsize=256)(env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compile_(template).render(**doc)

    bound = [(m, name) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("lm_eval")
             for name, v in list(vars(m).items()) if v is original]
    for m, name in bound:
        setattr(m, name, apply_template)
    try:
        yield
    finally:
        for m, name in bound:
            setattr(m, name, original)


def _yaml_files(folder: Path) -> list[Path]:
    files = sorted(f for s in _YAML_SUFFIXES for f in folder.rglob(f"*{s}"))
    if not files:
        raise ConfigError(f"task folder {folder} holds no .yaml task configs")
    return files


def task_manager(parsed: TaskSpecs) -> Any:
    """lm-eval's TaskManager with the given folders on its include path."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(f) for f in parsed.folders] or None)


def resolve(parsed: TaskSpecs, manager: Any) -> list[str]:
    """Final spec list: YAML paths, every task defined in each folder, then the checked names."""
    specs = list(parsed.specs)
    for folder in parsed.folders:
        found = folder_tasks(manager, folder)
        if not found:
            raise ConfigError(f"task folder {folder} defines no lm-eval task (no YAML with a 'task' key)")
        specs += [n for n in found if n not in specs]
    known = set(manager.all_tasks)
    for name in parsed.names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown lm-eval task {name!r}{hint} (pass a registered name, a task YAML file or a "
                              "folder of task YAMLs)")
        if name not in specs:
            specs.append(name)
    return specs


def folder_tasks(manager: Any, folder: Path) -> list[str]:
    """Names of the tasks whose YAML lies in ``folder`` (groups and tags are not expanded)."""
    out = []
    for name, entry in sorted(manager.task_index.items()):
        path = getattr(entry, "yaml_path", None)
        kind = getattr(getattr(entry, "kind", None), "name", "")
        if path is not None and kind in ("TASK", "PY_TASK") and Path(path).resolve().is_relative_to(folder):
            out.append(name)
    return out


def explain_failure(e: BaseException, specs: list[str]) -> LowbitError:
    """One clear error for an lm-eval failure; "offline" only when a download really failed."""
    first = _first_line(e)
    if _in_chain(e, {"SecurityError"}):
        return ConfigError(f"a template of {specs} tries to reach Python's internals ({first}); lowbit renders task "
                           f"templates in a sandbox. {TRUST_HINT}")
    if _is_download_error(e):
        return DataError(f"lm-eval could not get the dataset of {specs} ({first}); with no network, a task's data "
                         "must already be in the Hugging Face datasets cache, or be a local file (a task YAML with "
                         "dataset_path: json and dataset_kwargs: {data_files: ...})")
    if isinstance(e, FileNotFoundError):
        return DataError(f"lm-eval could not run {specs}: a file it needs is missing ({first}); check the task's "
                         "data_files paths")
    return LowbitError(f"lm-eval could not run {specs}: {type(e).__name__}: {first}")


def _is_download_error(e: BaseException) -> bool:
    return _in_chain(e, _DOWNLOAD_ERRORS)


def _in_chain(e: BaseException, names: set[str]) -> bool:
    """Whether an exception of a class named in ``names`` is anywhere in ``e``'s cause chain."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(c.__name__ in names for c in type(cur).__mro__):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
