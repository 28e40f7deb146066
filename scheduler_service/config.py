"""Configuration of the scheduler service (section ``scheduler``)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.config import BudgetConfig, Settings, moved_keys


class SchedulerConfig(BaseModel):
    """Scheduler settings. Env names: ``FLYWHEEL_SCHEDULER__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Interface the REST API binds to."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port of the REST API."""
    database_url: str = "sqlite:///flywheel-registry.db"
    """Task registry. ``sqlite:///PATH`` (relative paths are under the run directory)."""
    group_deadline_s: float = Field(600.0, gt=0)
    """A group whose rewards have not all arrived this long after it was issued is re-issued (seconds)."""
    max_attempts: int = Field(3, ge=1, le=100)
    """Issues of one group (first issue included) before it is given up and counted."""
    eval_every: int = Field(0, ge=0)
    """Run a held-out evaluation every this many policy versions (0 = only when asked over REST)."""
    eval_before_training: bool = True
    """Evaluate the held-out split at policy version 0 before any training request is issued."""
    max_tokens: int = Field(24, ge=1, le=32768)
    """Default ``max_new_tokens`` of the rollout requests."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature of training rollouts (evaluation is greedy)."""
    curriculum: Literal["uniform", "learnability"] = "uniform"
    """Which training tasks get the next groups. ``uniform``: those with the fewest groups so far
    (every task once before any twice). ``learnability``: up to ``replay_fraction`` of them go to
    tasks whose pass rate p is strictly between 0 and 1, drawn with weight p(1 − p) (Foster &
    Foerster 2025, "Learning to Reason at the Frontier of Learnability"), the rest as ``uniform``.
    A task the policy only just started to solve is sampled again while it still teaches something."""
    replay_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Largest share of newly issued groups given to partly solved tasks (``curriculum: learnability``)."""
    poll_interval_s: float = Field(0.05, gt=0, le=10)
    """How often the sampler loop looks for capacity (seconds)."""
    seed: int = 0
    """Seed of the task sampler."""
    consumer_group: str = Field("scheduler", min_length=1)
    """Kafka consumer group of the flywheel.rewards consumer (one group per scheduler deployment)."""
    weights_model: str | None = None
    """Only WeightUpdates whose ``model`` equals this count for the policy version (``None`` = ``model.name``)."""
    status_window_s: float = Field(60.0, gt=0, le=86400)
    """Window of ``throughput_samples_per_s`` in ``GET /v1/status`` (seconds)."""
    recent_samples: int = Field(256, ge=1, le=1_000_000)
    """Train reward events kept for the recent reward mean and staleness in ``GET /v1/status``."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """Raises ValueError for keys that moved to the shared ``budget`` section, naming where they live."""
        return moved_keys("scheduler", data, {"oversample": "budget.oversample",
                                              "resample_unsolved": "budget.resample_unsolved"})


class SchedulerSettings(Settings):
    """What the scheduler process reads: its section, the shared ``budget``, and ``kafka``, ``model``, ``run``."""

    budget: BudgetConfig = BudgetConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
