"""Import a pipeline file from its path, the way ``mlplat run|submit FILE`` name it
(``mlplat.pipeline.definition.load_pipeline`` then picks its ``@pipeline``).

The file is imported under its package path (``pipelines/quickstart.py`` inside a package
directory is ``pipelines.quickstart``) from the directory above its packages, so step
functions pickle by reference and Ray workers import the same module from the same code.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from types import ModuleType

from mlplat.errors import MlplatError


def module_location(path: Path) -> tuple[Path, str]:
    """(import root, dotted module name) of a .py file, walking up through ``__init__.py`` packages."""
    path = path.resolve()
    parts = [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    return root, ".".join(parts)


def import_file(file: str | Path) -> ModuleType:
    """The module of a .py file, imported under its package path; import errors as one-line MlplatErrors."""
    path = Path(file)
    if path.suffix != ".py" or not path.is_file():
        raise MlplatError(f"{file}: pipeline file not found (expected a .py file defining a @pipeline)")
    root, module_name = module_location(path)
    existing = sys.modules.get(module_name)
    if existing is not None and Path(getattr(existing, "__file__", "") or "").resolve() != path.resolve():
        raise MlplatError(f"{file}: its module name {module_name!r} is taken by {existing.__file__ or 'a built-in module'}: rename the file")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as err:
        raise MlplatError(f"{file}:{err.lineno}: syntax error: {err.msg}") from None
    except MlplatError as err:
        raise MlplatError(f"{file}: {err}") from None
    except Exception as err:  # noqa: BLE001 - any import-time error of user code, as one line
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise MlplatError(f"{file}: importing it failed: {type(err).__name__}: {err} ({Path(frame.filename).name}:{frame.lineno})") from None
    return module
