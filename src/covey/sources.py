"""Where the things a run loads come from, when not from a plain file: the embedded default model,
the marker a run's saved config puts where something was passed in memory (a model object, rows, a
function), and references to the user's own code ('path/to/file.py:name', 'package.module:name')."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
IN_MEMORY = "<in-memory "


def in_memory(what: str) -> str:
    """How a run's saved config notes what a file cannot name: a model object, rows or a function passed
    in memory."""
    return f"{IN_MEMORY}{what}>"


def why_unloadable(value: Any, field: str) -> str | None:
    """For a value a saved config notes as passed in memory (``in_memory``), why it cannot be loaded;
    else None."""
    if isinstance(value, str) and value.startswith(IN_MEMORY):
        return (f"{field} {value!r} is how a run's config.yaml notes what was passed in memory, not something to "
                "load: give a file, folder, hub id or name in its place (for covey eval: --eval-dataset FILE)")
    return None


def load_reference(spec: str, what: str, error: type[Exception]) -> Any:
    """The callable named by ``spec``, 'path/to/file.py:name' or 'package.module:name' (``what`` it is
    for, and the ``error`` to raise, name it in the messages). A file is loaded once per process, so
    that what several references name in it (an environment class and the rewards that check it) is
    the same object, until the file changes."""
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        module = _module_from_file(spec, Path(where), what, error)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise error(f"{what} {spec!r}: cannot import module {where!r} ({e})") from e
        except Exception as e:  # the module's own code failed: any exception
            raise error(f"{what} {spec!r}: importing module {where!r} raised {type(e).__name__}: {e}; "
                        "fix the module") from e
    found = getattr(module, name, None)
    if not callable(found):
        raise error(f"{what} {spec!r}: {where} has nothing callable named {name!r}")
    return found


def _module_from_file(spec: str, path: Path, what: str, error: type[Exception]) -> Any:
    """The module of ``path``, run with its folder first on sys.path (so that it can import the files
    beside it, as a script can); the folder then moves to the end of sys.path, where a function that
    imports a file beside it when called still finds it, and no installed package is shadowed."""
    if not path.is_file():
        raise error(f"{what} {spec!r}: file {path} does not exist")
    status = path.stat()  # a file changed since it was loaded is loaded again
    module_name = f"covey_user_{abs(hash((str(path.resolve()), status.st_mtime_ns, status.st_size)))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: a syntax error, a missing dependency, any raise
        sys.modules.pop(module_name, None)
        fix = "install the package it imports, or fix the import" if isinstance(e, ImportError) else "fix the file"
        raise error(f"{what} {spec!r}: loading {path} raised {type(e).__name__}: {e}; {fix}") from e
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module
