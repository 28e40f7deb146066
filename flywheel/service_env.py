"""What each service process of a local system gets: its environment and umask, and the settings the
supervisor reads from the config before any service starts.

Services get only the variables of :data:`SERVICE_ENV_ALLOW` / :data:`SERVICE_ENV_PREFIXES` from the
caller's environment (plus, for the verifier only, the judge's API key variable named by
``verifier.judge.api_key_env``, :func:`judge_key_env`); the torch services may get an allocator
(:func:`allocator_env`). The supervisor also reads ``kafka.partitions`` (to re-create the topics after a broker
restart) and the precision the torch services will choose (:func:`precision_plan`, for ``flywheel.json``
and the run report): environment over YAML over the default, as the services do. ``--set`` overrides become
environment variables (:func:`overrides_to_env`).
"""

from __future__ import annotations

import ctypes.util
import logging
import os
from typing import Mapping

from shared import precision
from shared.config import KafkaConfig, RunConfig, read_yaml
from trainer_service.config import TrainerConfig, for_loss

log = logging.getLogger("flywheel")


#: Variables of the caller's environment every service gets, by exact name ("services get only the
#: environment they need"; an API key or cloud credential of the operator's shell never reaches a service,
#: the sandbox's programs or the broker). Add a name here, and nowhere else, when a service needs one.
SERVICE_ENV_ALLOW = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "XDG_CACHE_HOME",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
})


#: ... and by prefix: locale, Python, Hugging Face / tokenizers, torch and its CPU kernels' oneDNN, CUDA,
#: OpenTelemetry, Flywheel's own settings (``FLYWHEEL_<SECTION>__<FIELD>``), TLS trust stores.
SERVICE_ENV_PREFIXES = ("LC_", "PYTHON", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH_", "ONEDNN_", "DNNL_",
                        "CUDA_", "NVIDIA_", "OTEL_", "FLYWHEEL_", "SSL_CERT_")


#: umask of each service's process (0o077: files 0600, directories 0700). The sandbox keeps 0o022: its worker
#: builds the programs' read-only root with plain ``os.mkdir`` and relies on the usual umask for the slot uids
#: to traverse it (under 0o077 every run failed with ``Permission denied: '/dev/null'``); its files in the run
#: directory are still private, the run directory being 0700.
SERVICE_UMASK = {"sandbox": 0o022}


DEFAULT_UMASK = 0o077

#: The verifier alone also gets the variable named by ``verifier.judge.api_key_env`` (default below).
DEFAULT_JUDGE_KEY_ENV = "OPENAI_API_KEY"


def allowed_env(environ: Mapping[str, str], extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The variables of ``environ`` a service may see: :data:`SERVICE_ENV_ALLOW`, :data:`SERVICE_ENV_PREFIXES`
    and the names in ``extra``."""
    return {k: v for k, v in environ.items()
            if k in SERVICE_ENV_ALLOW or k.startswith(SERVICE_ENV_PREFIXES) or k in extra}


def judge_key_env(config_path: str | os.PathLike, env: Mapping[str, str]) -> str:
    """Name of the judge's API key variable: ``FLYWHEEL_VERIFIER__JUDGE__API_KEY_ENV``, else the YAML's
    ``verifier.judge.api_key_env``, else :data:`DEFAULT_JUDGE_KEY_ENV`."""
    if env.get("FLYWHEEL_VERIFIER__JUDGE__API_KEY_ENV"):
        return env["FLYWHEEL_VERIFIER__JUDGE__API_KEY_ENV"]
    return str(_yaml_value(config_path, "verifier", "judge", "api_key_env") or DEFAULT_JUDGE_KEY_ENV)


def _yaml_value(config_path: str | os.PathLike, *keys: str):
    """The value at ``keys`` (``"kafka", "partitions"``) of the YAML config, or None where the file is missing or
    unreadable or a level is absent or not a mapping (the services' own settings report a bad config)."""
    try:
        value = read_yaml(config_path)
    except (OSError, ValueError):
        return None
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def kafka_partitions(config_path: str | os.PathLike, env: Mapping[str, str]) -> int:
    """``kafka.partitions`` of the system (environment over YAML over the default), for re-creating topics."""
    if env.get("FLYWHEEL_KAFKA__PARTITIONS"):
        return int(env["FLYWHEEL_KAFKA__PARTITIONS"])
    try:
        return int(_yaml_value(config_path, "kafka", "partitions") or KafkaConfig().partitions)
    except (ValueError, TypeError):
        return KafkaConfig().partitions


TCMALLOC = "tcmalloc_minimal"


def allocator_env(config_path: str | os.PathLike, env: Mapping[str, str]) -> dict[str, str]:
    """``{"LD_PRELOAD": <libtcmalloc_minimal>}`` for the torch services when ``run.allocator`` (environment over
    YAML over the default) is ``tcmalloc`` and the library is installed; else ``{}`` (logged when it is missing)."""
    choice = env.get("FLYWHEEL_RUN__ALLOCATOR") or _yaml_value(config_path, "run", "allocator")
    if (choice or RunConfig().allocator) != "tcmalloc":
        return {}
    lib = ctypes.util.find_library(TCMALLOC)
    if lib is None:
        log.warning("run.allocator is tcmalloc but lib%s is not installed (Debian: libtcmalloc-minimal4): the torch "
                    "services use the system allocator", TCMALLOC)
        return {}
    return {"LD_PRELOAD": " ".join(x for x in (env.get("LD_PRELOAD"), lib) if x)}


def _setting(config_path: str | os.PathLike, env: Mapping[str, str], section: str, key: str, default):
    """``<section>.<key>`` of the system: environment over YAML over ``default`` (booleans spelled as in YAML
    or the environment become bools)."""
    value = env.get(f"FLYWHEEL_{section.upper()}__{key.upper()}")
    if value is None:
        value = _yaml_value(config_path, section, key)
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        value = value.lower() in ("true", "yes", "on", "1")
    return default if value is None else value


def precision_plan(config_path: str | os.PathLike, env: Mapping[str, str]) -> dict[str, dict]:
    """The precision the torch services choose on this machine, by setting (``rollout.dtype``,
    ``trainer.autocast_bf16``, ``trainer.output_bf16``), each :meth:`shared.precision.Precision.as_dict`: the same
    decision the services make at their start (:func:`shared.precision.resolve`, one hardware probe), for
    ``flywheel.json`` and the run report. A setting the system does not use (an ``sglang`` or ``null`` engine, the
    trainer's ``null_step``) is left out; one that is not a valid choice is left to the service to refuse."""
    plan = {}
    if _setting(config_path, env, "rollout", "engine", "torch") == "torch":
        plan["rollout.dtype"] = _setting(config_path, env, "rollout", "dtype", "auto")
    if not _setting(config_path, env, "trainer", "null_step", False):
        for key in ("autocast_bf16", "output_bf16"):
            plan[f"trainer.{key}"] = _setting(config_path, env, "trainer", key, "auto")
    out = {}
    for name, requested in plan.items():
        try:
            p = precision.resolve(requested)
        except ValueError:
            continue
        if name.startswith("trainer."):
            p = for_loss(p, _off_policy(config_path, env))
        out[name] = p.as_dict()
    return out


def _off_policy(config_path: str | os.PathLike, env: Mapping[str, str]) -> str:
    """``trainer.loss.off_policy`` of the system (environment over YAML over the loss kind's default)."""
    loss = _yaml_value(config_path, "trainer", "loss")
    if env.get("FLYWHEEL_TRAINER__LOSS__OFF_POLICY"):
        return env["FLYWHEEL_TRAINER__LOSS__OFF_POLICY"]
    try:
        return getattr(TrainerConfig(**({"loss": loss} if loss is not None else {})).loss, "off_policy", "decoupled")
    except ValueError:  # a bad loss section: the trainer refuses it at its start
        return "ppo_clip"


def overrides_to_env(pairs: list[str]) -> dict[str, str]:
    """``["budget.max_steps=3"]`` → ``{"FLYWHEEL_BUDGET__MAX_STEPS": "3"}``.

    Raises:
        ValueError: a pair is not ``section.field=value``.
    """
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"override {pair!r} is not section.field=value")
        env["FLYWHEEL_" + key.replace(".", "__").upper()] = value
    return env
