"""Finding a user's environment by reference: an installed entry point, a module, or a file.

``environment: {id: ..., module: ..., path: ..., args: {...}}`` names exactly one of

- ``id``: an installed package's entry point in the group ``flywheel.environments`` (``pyproject.toml``:
  ``[project.entry-points."flywheel.environments"] my-env = "my_env:load_environment"``);
- ``module``: ``"pkg.mod"`` or ``"pkg.mod:function"`` on the Python path;
- ``path``: ``"envs/my_env.py"`` or ``"envs/my_env.py:function"`` (relative to the directory the run starts
  in; :meth:`EnvironmentRef.resolved` makes it absolute before the reference travels to the services);

and the function (``load_environment`` unless named) is called with ``args`` and returns an
:class:`~shared.envs.api.Environment`. The same reference loads the same environment in the driver, the verifier
and the rollout: each process imports the user's code itself, so no code travels over Kafka.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.envs.api import Environment
from shared.envs.datasets import DatasetError, check_first_row
from shared.jsoncheck import check_json, check_size

ENTRY_POINT_GROUP = "flywheel.environments"
DEFAULT_FUNCTION = "load_environment"


class EnvironmentLoadError(ValueError):
    """The reference names nothing loadable: no such entry point, module, file or function, the user's code
    raised while importing or building, it returned something other than an ``Environment``, or its dataset list's
    first row lacks its prompt column. The message names the reference's id, module, path and function."""


class EnvironmentRef(BaseModel):
    """Where an environment's code is: exactly one of ``id``, ``module``, ``path``, plus the ``args`` its
    loading function takes."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=200)
    """An installed entry point of the group ``flywheel.environments``."""
    module: str | None = Field(None, max_length=400)
    """``pkg.mod`` or ``pkg.mod:function`` (default function ``load_environment``)."""
    path: str | None = Field(None, max_length=4096)
    """A Python file, ``envs/my_env.py`` or ``envs/my_env.py:function``."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the loading function (JSON values)."""

    @field_validator("args")
    @classmethod
    def _storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_json(v)
        return check_size(v, 64 * 1024, "environment.args")

    @model_validator(mode="after")
    def _exactly_one(self) -> "EnvironmentRef":
        named = [k for k in ("id", "module", "path") if getattr(self, k)]
        if len(named) != 1:
            raise ValueError(f"environment needs exactly one of id, module, path (got {named or 'none'})")
        return self

    def resolved(self, base: Path | None = None) -> "EnvironmentRef":
        """The same reference with ``path`` made absolute against ``base`` (default: the working directory)."""
        if not self.path:
            return self
        file, _, func = self.path.partition(":")
        absolute = ((base or Path.cwd()) / Path(file).expanduser()).resolve()
        return self.model_copy(update={"path": f"{absolute}:{func}" if func else str(absolute)})

    def key(self) -> str:
        """A stable text key of the reference (the cache and worker-pool key)."""
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS).decode()

    def label(self) -> str:
        return f"id {self.id!r}" if self.id else f"module {self.module!r}" if self.module else f"path {self.path!r}"


def _from_entry_point(name: str) -> Callable[..., Any]:
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
        raise EnvironmentLoadError(f"no installed environment {name!r} (entry point group {ENTRY_POINT_GROUP!r}); "
                                   f"installed: {known or 'none'}; `pip install -e` the package that declares it")
    try:
        return found[0].load()
    except Exception as e:  # noqa: BLE001 - the user's import: report it with the entry point
        raise EnvironmentLoadError(f"environment {name!r} ({found[0].value}) failed to import: "
                                   f"{type(e).__name__}: {e}") from e


def _from_module(spec: str) -> Callable[..., Any]:
    module, _, func = spec.partition(":")
    func = func or DEFAULT_FUNCTION
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's import
        raise EnvironmentLoadError(f"environment module {module!r} failed to import: {type(e).__name__}: {e}") from e
    if not hasattr(mod, func):
        raise EnvironmentLoadError(f"environment module {module!r} ({getattr(mod, '__file__', '?')}) has no "
                                   f"attribute {func!r}")
    return getattr(mod, func)


def _from_path(spec: str) -> Callable[..., Any]:
    file, _, func = spec.partition(":")
    func = func or DEFAULT_FUNCTION
    try:
        path = Path(file).expanduser().resolve()
        is_file = path.is_file()
    except (OSError, RuntimeError, ValueError) as e:  # a name too long, a symlink loop, a NUL byte
        raise EnvironmentLoadError(f"environment path {file[:200]!r} cannot be read: {type(e).__name__}: "
                                   f"{str(e)[:200]}") from e
    if not is_file:
        raise EnvironmentLoadError(f"environment path {str(path)!r} is not a file")
    name = f"flywheel_env_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = mod
        try:
            module_spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - the user's import
            del sys.modules[name]
            raise EnvironmentLoadError(f"environment path {str(path)!r} failed to import: "
                                       f"{type(e).__name__}: {e}") from e
    mod = sys.modules[name]
    if not hasattr(mod, func):
        raise EnvironmentLoadError(f"environment path {str(path)!r} has no attribute {func!r}")
    return getattr(mod, func)


def load_environment(ref: EnvironmentRef | dict[str, Any]) -> Environment:
    """Import the referenced code and build its environment; a ``verifiers`` environment it returns is converted
    (:mod:`shared.envs.verifiers_adapter`). The first row of a dataset given as a list is checked here
    (:func:`~shared.envs.datasets.check_first_row`); a dataset given as a path is not opened.

    Raises:
        EnvironmentLoadError: see the class; also a dataset list whose first row lacks its prompt or a mapped
            column (the message names the column and the columns the row has).
        pydantic.ValidationError: ``ref`` as a dict is malformed.
    """
    ref = EnvironmentRef.model_validate(ref)
    factory = _from_entry_point(ref.id) if ref.id else _from_module(ref.module) if ref.module else _from_path(ref.path)
    if "verifiers" in sys.modules:  # a verifiers environment is built below: it must keep this process's signals
        from shared.envs.verifiers_adapter import keep_signal_handlers

        keep_signal_handlers()
    try:
        env = factory(**ref.args) if callable(factory) and not isinstance(factory, Environment) else factory
    except Exception as e:  # noqa: BLE001 - the user's builder
        raise EnvironmentLoadError(f"environment {ref.label()}: {getattr(factory, '__name__', factory)}"
                                   f"(**{ref.args}) raised {type(e).__name__}: {e}") from e
    if not isinstance(env, Environment):
        from shared.envs.verifiers_adapter import UnsupportedVerifiersEnv, from_verifiers, is_verifiers_env

        if not is_verifiers_env(env):
            raise EnvironmentLoadError(f"environment {ref.label()} returned {type(env).__name__}, not a "
                                       "flywheel.env.Environment (nor a verifiers environment)")
        try:
            env = from_verifiers(env)
        except UnsupportedVerifiersEnv as e:
            raise EnvironmentLoadError(f"environment {ref.label()} returned a verifiers {type(env).__name__}: "
                                       f"{e}") from e
    try:
        check_first_row(env.dataset, env.columns)
        if env.eval_dataset is not None:
            check_first_row(env.eval_dataset, env.columns, "eval_dataset")
    except DatasetError as e:
        raise EnvironmentLoadError(f"environment {ref.label()}: {e}") from e
    return env


@functools.lru_cache(maxsize=64)
def _cached(key: str) -> Environment:
    return load_environment(orjson.loads(key))


def cached_environment(ref: EnvironmentRef) -> Environment:
    """:func:`load_environment`, once per process and reference (the services score many tasks of one
    environment; its dataset is not re-read per call)."""
    return _cached(ref.key())
