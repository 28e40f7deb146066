"""Configuration of the verifier service (section ``verifier``)."""

from pydantic import BaseModel, ConfigDict, Field

from shared.verifier_specs import Recipe
from verifier_service.judge import JudgeConfig


class VerifierConfig(BaseModel):
    """Verifier settings. Env names: ``FLYWHEEL_VERIFIER__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    sandbox_url: str = "http://127.0.0.1:8100"
    """Base URL of the sandbox service used by the ``unit_tests`` verifier kind."""
    max_batch: int = Field(64, ge=1, le=10000)
    """Trajectories fetched from Kafka per poll."""
    infra_retries: int = Field(3, ge=0, le=20)
    """Attempts after the first when a scorer hits an infrastructure failure (sandbox down, timeout)."""
    retry_backoff_s: float = Field(0.5, ge=0, le=60)
    """Sleep before each infrastructure retry, doubled every attempt (seconds)."""
    regex_timeout_s: float = Field(1.0, gt=0, le=60)
    """Longest a ``regex`` verifier's match may run (seconds); past it the sample gets reward 0 with the error."""
    math_timeout_s: float = Field(5.0, gt=0, le=120)
    """Wall-clock bound of one math-verify comparison, enforced by the process pool (seconds)."""
    code_timeout_s: float = Field(10.0, gt=0, le=300)
    """Wall-clock limit given to the sandbox for one unit-test run (seconds)."""
    math_workers: int = Field(1, ge=1, le=64)
    """Processes of the CPU pool (math-verify and the slow reasoning-gym scorers; each holds sympy, ~100 MB)."""
    check_timeout_s: float = Field(30.0, gt=0, le=600)
    """Bound of one deterministic check run in a thread or the pool (regex has its own; seconds)."""
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """The judge endpoint used by recipes with a ``judge`` rubric."""
    recipes: dict[str, Recipe] = Field(default_factory=dict)
    """Reward recipe per task domain (a task's own ``verifier.recipe`` wins)."""
    default_recipe: Recipe = Field(default_factory=Recipe)
    """Recipe of domains without one: correctness only."""
    consumer_group: str = "verifier"
    """Kafka consumer group of flywheel.trajectories (copies with the same group share partitions)."""
    metrics_interval_s: float = Field(10.0, gt=0, le=3600)
    """Seconds between two Metrics snapshots on flywheel.metrics."""
