"""Configuration of the scheduler service (section ``scheduler``)."""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.config import BudgetConfig, Settings, moved_keys
from shared.envs.loading import EnvironmentRef
from shared.jsoncheck import check_json, check_size
from shared.topics import DEFAULT_POOL, POOL_PATTERN

DOMAIN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""What a configured domain name may be (it is a path segment of ``/v1/domains/{domain}``)."""
MAX_INT = 2**53
"""Bound of every integer the API takes: exact in a JSON number read by JavaScript (the dashboard) and
well inside orjson's 64 bits (a larger one was a 500)."""
MAX_PARAMS_BYTES = 1024 * 1024
"""Largest generator ``params`` of a domain or level (bytes of compact JSON)."""
Difficulty = Annotated[float, Field(ge=-1e9, le=1e9, allow_inf_nan=False)]


def _check_params(v: dict[str, Any]) -> dict[str, Any]:
    return check_size(check_json(v), MAX_PARAMS_BYTES, "params")


class LevelConfig(BaseModel):
    """One difficulty level of a domain (``domains.<d>.levels[i]``)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=128)
    """A label for reports (default ``L<i>``)."""
    params: Annotated[dict[str, Any], AfterValidator(_check_params)] = Field(default_factory=dict)
    """Generator domains: keyword arguments of the generator at this level, merged key by key (nested
    mappings too) over the domain's ``params`` (e.g. ``{config: {max_digits: 3}}``)."""
    difficulty: tuple[Difficulty, Difficulty] | None = None
    """Fixed-data domains: this level issues the tasks whose ``difficulty`` is in ``[lo, hi]``."""

    @model_validator(mode="after")
    def _ordered(self) -> "LevelConfig":
        if self.difficulty is not None and not self.difficulty[0] <= self.difficulty[1]:
            raise ValueError(f"difficulty range {list(self.difficulty)} is empty: lo must be <= hi")
        return self


class CurriculumConfig(BaseModel):
    """How a domain moves between its levels. ``adaptive``: up one level when the recent training pass
    rate of the current level's tasks rises above ``promote_above``, down one when it falls below
    ``demote_below``; after a move the window restarts and at least ``min_samples`` scored samples of the
    new level are needed before the next (hysteresis). ``fixed``: the level changes only when set."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["fixed", "adaptive"] = "fixed"
    promote_above: float = Field(0.8, gt=0.0, le=1.0)
    demote_below: float = Field(0.2, ge=0.0, lt=1.0)
    window: int = Field(64, ge=1, le=100_000)
    """Span of the recent pass rate: an exponential moving average over scored samples with
    α = 2 / (window + 1)."""
    min_samples: int = Field(32, ge=1, le=1_000_000)
    """Scored samples of the current level before it may move (again)."""

    @model_validator(mode="after")
    def _band(self) -> "CurriculumConfig":
        if self.demote_below >= self.promote_above:
            raise ValueError(f"demote_below ({self.demote_below}) must be below promote_above ({self.promote_above})")
        return self


class AdaptiveSamples(BaseModel):
    """Samples per group chosen per task from its pass rate p: the fewest ``n`` in ``[min, max]`` with
    P(a group of n has both a pass and a fail) = 1 − pⁿ − (1 − p)ⁿ ≥ ``target`` (the chance the group
    has a non-zero advantage, Knapsack RL, Li et al. 2025, arXiv:2509.25849); ``max`` while p is unknown
    or 0 (an unsolved task needs many tries to show a pass), ``min`` when p is 1."""

    model_config = ConfigDict(extra="forbid")
    min: int = Field(2, ge=2, le=1024)
    max: int = Field(16, ge=2, le=1024)
    target: float = Field(0.5, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _range(self) -> "AdaptiveSamples":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class DomainBudget(BaseModel):
    """Caps on what a domain may spend (``None``: no cap). Once a cap is reached (spent plus what its
    groups in flight are expected to cost) the domain's training groups stop; evaluation goes on."""

    model_config = ConfigDict(extra="forbid")
    samples: int | None = Field(None, ge=0, le=MAX_INT)
    """Training trajectories."""
    generated_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    tool_rounds: int | None = Field(None, ge=0, le=MAX_INT)
    sandbox_seconds: float | None = Field(None, ge=0, le=1e15, allow_inf_nan=False)
    """Sandbox seconds of the tool loop and of the unit tests together."""
    judge_calls: int | None = Field(None, ge=0, le=MAX_INT)


class LifecycleConfig(BaseModel):
    """When a training task leaves the rotation (it stays registered and keeps its statistics)."""

    model_config = ConfigDict(extra="forbid")
    retire_after: int = Field(2, ge=0, le=1000)
    """Retire a task solved in every sample of its last this many groups (0 = never): such groups have
    equal rewards, so no advantage, and only cost rollouts."""
    flag_after: int = Field(8, ge=0, le=1000)
    """Flag a task no sample of which passed in this many groups (0 = never): a broken or far too hard
    task, listed per domain. Flagged tasks keep being issued."""


SIGNALS: dict[str, str] = {
    "scorer_inconsistency": "share of repeated (task, completion) pairs whose reward differs from the first time",
    "infra_error_rate": "share of the current window (train and eval) that were infrastructure errors",
    "truncation_rate": "share of the current window's completions cut at the token budget",
    "diversity_collapse": "share of the last groups whose samples are all one answer and not all passed",
    "hack_rate": "share of the current window flagged by a reward-hacking detector",
    "pass_rate_jump": "pass rate of the current window minus the reference window's",
    "pass_rate_collapse": "pass rate of the reference window minus the current window's",
    "reward_shift": "Wasserstein-1 distance between the current and reference reward distributions",
    "length_inflation": "mean completion tokens of the current window over the reference window's",
    "entropy_drop": "1 − mean surprisal (nats/token) of the current window over the reference window's",
    "eval_accuracy_drop": "held-out accuracy of the previous evaluation round minus the latest's",
    "kl": "the trainer's per-token KL to the reference policy (loss/kl_ref_mean, nats), run-wide",
    "entropy_collapse": "1 − the trainer's policy entropy (loss/entropy) over its first value, run-wide",
}
"""Every signal the drift monitor computes (``scheduler_service.monitor``), with what its value is, most specific
first: when several turn critical at once, the first names the breaker's trip."""

RUN_SIGNALS = ("kl", "entropy_collapse")
"""Signals about the whole run (from the trainer's metrics), not a domain."""

THRESHOLD_FIELDS = ("warning", "critical", "min_rise", "min_samples", "enabled")


class SignalThreshold(BaseModel):
    """When one signal raises an alert: ``value ≥ warning`` (or ``≥ critical``), and, when ``min_rise`` is
    set, also ``value − reference ≥ min_rise`` (a rate that was already that high is not news). ``None``
    disables that level; ``min_samples`` (``None``: ``monitor.min_samples``) is the smallest window it is
    judged on."""

    model_config = ConfigDict(extra="forbid")
    warning: float | None = Field(None, allow_inf_nan=False)
    critical: float | None = Field(None, allow_inf_nan=False)
    min_rise: float | None = Field(None, allow_inf_nan=False)
    min_samples: int | None = Field(None, ge=1, le=100_000)
    enabled: bool = True


DEFAULT_THRESHOLDS: dict[str, SignalThreshold] = {
    "scorer_inconsistency": SignalThreshold(warning=0.1, critical=0.3, min_samples=8),
    "pass_rate_jump": SignalThreshold(warning=0.3, critical=0.7),
    "pass_rate_collapse": SignalThreshold(warning=0.3, critical=0.6),
    "reward_shift": SignalThreshold(warning=0.3),
    "length_inflation": SignalThreshold(warning=1.5),
    "truncation_rate": SignalThreshold(warning=0.25, critical=0.5, min_rise=0.3),
    "diversity_collapse": SignalThreshold(warning=0.5, critical=0.75, min_samples=4),
    "entropy_drop": SignalThreshold(warning=0.8),
    "hack_rate": SignalThreshold(warning=0.1, critical=0.5, min_rise=0.3),
    "infra_error_rate": SignalThreshold(warning=0.1, critical=0.5, min_samples=8),
    "eval_accuracy_drop": SignalThreshold(warning=0.2, min_samples=4),
    "kl": SignalThreshold(warning=1.0, min_samples=1),
    "entropy_collapse": SignalThreshold(warning=0.8, min_samples=1),
}
"""Default thresholds (docs/guides/drift.md says why each)."""


def check_overrides(v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``v`` (``{signal: {field: value}}``) validated: known signals and fields, each partial override valid.

    Raises:
        ValueError: an unknown signal or field, or a value :class:`SignalThreshold` refuses (named).
    """
    for sig, over in v.items():
        if sig not in SIGNALS:
            raise ValueError(f"unknown signal {sig!r}; known: {sorted(SIGNALS)}")
        if not isinstance(over, dict):
            raise ValueError(f"{sig}: expected a mapping of {list(THRESHOLD_FIELDS)}")
        bad = sorted(set(over) - set(THRESHOLD_FIELDS))
        if bad:
            raise ValueError(f"{sig}: unknown field(s) {bad}; known: {list(THRESHOLD_FIELDS)}")
        SignalThreshold.model_validate({**DEFAULT_THRESHOLDS[sig].model_dump(), **over})
    return v


class BreakerConfig(BaseModel):
    """The per-domain circuit breaker (``monitor.breaker``)."""

    model_config = ConfigDict(extra="forbid")
    cooldown_s: float = Field(60.0, gt=0, le=86_400)
    """Seconds an opened breaker waits before it goes half-open and issues a probe."""
    max_cooldown_s: float = Field(900.0, gt=0, le=864_000)
    """The cool-down doubles after each failed probe, up to this (seconds)."""
    probe_groups: int = Field(2, ge=1, le=64)
    """The fewest training groups of a half-open domain's probe (scored and judged, never trained). The probe
    is larger when the test of its tripping signal needs more samples (``scheduler_service/probe.py``)."""
    probe_max_groups: int = Field(16, ge=1, le=1024)
    """The most groups a probe may take: a probe whose test would need more is sent at this size (and closes the
    breaker only if the samples it got are evidence enough)."""
    probe_alpha: float = Field(0.05, gt=0, lt=0.5)
    """Significance of a probe's test: the chance that a probe closes the breaker while the condition that tripped
    it is still there (an exact binomial test for rate signals)."""
    probe_power: float = Field(0.8, gt=0, lt=1)
    """The chance a probe of a healthy domain passes, which sets its size (given the frozen reference)."""
    probe_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """A probe whose groups have not all been scored this long after issue counts as failed (seconds)."""


class MonitorConfig(BaseModel):
    """The drift monitor (section ``monitor``): per-domain windows over flywheel.rewards and the trainer's
    metrics, alerts on flywheel.alerts, a circuit breaker per domain (``scheduler_service.monitor``)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    window: int = Field(64, ge=4, le=100_000)
    """Current window: the domain's latest training samples (signals compare it with the reference). 64 = 8
    groups of 8: tasks differ so much that 4 groups' pass rate moves by 0.5 by chance alone."""
    reference: int = Field(128, ge=4, le=100_000)
    """Reference window: the samples just before the current window (frozen when the breaker opens)."""
    min_samples: int = Field(32, ge=1, le=100_000)
    """Smallest current and reference window a signal is judged on (per signal: ``min_samples``)."""
    group_window: int = Field(8, ge=1, le=10_000)
    """Completed groups the diversity signal looks at."""
    consistency_pairs: int = Field(1024, ge=0, le=1_000_000)
    """(task, completion) pairs remembered per domain for ``scorer_inconsistency`` (0 = off)."""
    signals: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Run-wide threshold overrides per signal, over :data:`DEFAULT_THRESHOLDS` (fields of
    :class:`SignalThreshold`)."""
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    warn_after: int = Field(3, ge=1, le=1000)
    """Consecutive evaluations (completed groups, or steps for the run-wide signals) a signal must stay at or above
    its warning threshold before the warning fires (Prometheus's ``for:``): a value that touches a threshold once
    pages no one. A critical level fires at once: it opens the breaker, which must not wait."""
    resolve_margin: float = Field(0.1, ge=0.0, lt=1.0)
    """A firing alert resolves (or steps down from critical to warning) only once its value is below the threshold
    it crossed by this fraction of that threshold (hysteresis): a value hovering at a threshold does not flap."""
    pause_training_on_critical: bool = True
    """A critical run-wide signal (only if an operator makes ``kl`` or ``entropy_collapse`` critical) pauses
    training."""

    @field_validator("signals")
    @classmethod
    def _known(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return check_overrides(v)


class DomainConfig(BaseModel):
    """One domain as the scheduler runs it (YAML ``domains.<name>``, ``PUT /v1/domains/{name}``).

    A domain is created with these defaults the first time a task of it is registered.
    """

    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, ge=0.0, le=1e6, allow_inf_nan=False)
    """Share of the issued training groups, relative to the other active domains' weights (0 = none)."""
    state: Literal["active", "paused", "retired"] = "active"
    """``paused``: no training groups (evaluation goes on); ``retired``: finished, as paused but for good."""
    levels: list[LevelConfig] | None = Field(None, min_length=1, max_length=64)
    """Difficulty levels, easiest first (``None``: one level holding every task)."""
    level: int = Field(0, ge=0, le=63)
    """The current level (index into ``levels``)."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    generator: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
    """``module`` or ``module:function`` (default function ``make``): ``make(n, seed, split, **params)``
    returns task bodies. The scheduler calls it to make the training tasks of a level when the domain
    enters it (``tasks_per_level``) or runs out of live ones, and ``eval_size`` held-out tasks once."""
    environment: EnvironmentRef | None = None
    """A user's environment (``{id | module | path, args}``, docs/guides/environments.md) whose dataset rows are
    the domain's tasks, made by the scheduler as a generator's are: ``eval_size`` held-out rows once, then
    ``tasks_per_level`` training rows at a time at the current level until its rows run out. The rows are shuffled
    with ``scheduler.seed``; held-out rows come from the environment's ``eval_dataset`` when it has one, else
    from the dataset, kept disjoint from the training rows by prompt. Levels: without ``levels``, one level holds
    every row; with them, each level gives a ``difficulty`` range and holds the rows whose ``difficulty`` column
    (a number, 0 when absent) is in it. A relative ``path`` is read from the scheduler's working directory (under
    ``flywheel run``, the run directory: give it absolute). Not together with a ``generator``. A run that
    makes its tasks only through domains sets ``tasks.kind: none``."""
    params: Annotated[dict[str, Any], AfterValidator(_check_params)] = Field(default_factory=dict)
    """Generator keyword arguments common to every level."""
    tasks_per_level: int = Field(32, ge=1, le=100_000)
    """Training tasks made at a time for the current level (when the domain enters it or has no live task left)."""
    eval_size: int = Field(0, ge=0, le=100_000)
    """Held-out tasks the generator makes at ``eval_level`` (generator and environment domains only)."""
    eval_level: int = Field(0, ge=0, le=63)
    samples_per_task: int | None = Field(None, ge=2, le=1024)
    """K of the domain's training groups (``None``: each task's own ``samples_per_task``)."""
    adaptive_samples: AdaptiveSamples | None = None
    """Samples per group from each task's pass rate (``None``: K as above)."""
    pool: str = Field(DEFAULT_POOL, pattern=POOL_PATTERN)
    """Rollout pool whose replicas generate this domain's groups (``rollout.pool``)."""
    max_tokens: int | None = Field(None, ge=1, le=32768)
    """``max_new_tokens`` of this domain's requests (``None``: ``scheduler.max_tokens``)."""
    budget: DomainBudget = Field(default_factory=DomainBudget)
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    """Sampling temperature of this domain's training groups (``None``: ``scheduler.temperature``)."""
    monitor: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=64)
    """Threshold overrides of the drift monitor for this domain, per signal (over ``monitor.signals``)."""

    @field_validator("monitor")
    @classmethod
    def _known_signals(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return check_overrides(v)

    @model_validator(mode="after")
    def _levels(self) -> "DomainConfig":
        self._environment()
        n = len(self.levels) if self.levels else 1
        if self.level >= n:
            raise ValueError(f"level {self.level} does not exist: the domain has {n} level(s)")
        if self.eval_level >= n:
            raise ValueError(f"eval_level {self.eval_level} does not exist: the domain has {n} level(s)")
        if self.curriculum.mode == "adaptive" and n < 2:
            raise ValueError("curriculum.mode adaptive needs at least two levels")
        if self.eval_size and not self.makes_tasks:
            raise ValueError("eval_size needs a generator or an environment (fixed-data domains submit their "
                             "held-out tasks)")
        return self

    def _environment(self) -> None:
        """Check an environment domain's fields.

        Raises:
            ValueError: ``environment`` with a generator, with generator ``params``, or with levels that give no
                ``difficulty`` range.
        """
        if self.environment is None:
            return
        if self.generator is not None:
            raise ValueError(f"environment and generator {self.generator!r} are mutually exclusive: an "
                             "environment's rows are the domain's tasks")
        if self.params or any(lv.params for lv in self.levels or []):
            raise ValueError("params are a generator's arguments: an environment takes its own as environment.args")
        if self.levels and any(lv.difficulty is None for lv in self.levels):
            raise ValueError("every level of an environment domain needs a difficulty range [lo, hi] over the rows' "
                             "difficulty column")

    @property
    def makes_tasks(self) -> bool:
        """Whether the scheduler makes this domain's tasks (from its ``generator`` or its ``environment``'s
        rows) rather than being sent them."""
        return self.generator is not None or self.environment is not None

    def level_params(self, level: int) -> dict[str, Any]:
        """The generator's keyword arguments at ``level``: ``params`` with the level's merged over them."""
        return deep_merge(self.params, self.levels[level].params if self.levels else {})


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in key by key; nested mappings merge, anything else is replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class SchedulerConfig(BaseModel):
    """Scheduler settings. Env names: ``FLYWHEEL_SCHEDULER__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Interface the REST API binds to."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port of the REST API."""
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024, le=1024**3)
    """Largest request body accepted (bytes); a larger one gets HTTP 413 before it is read (a body sent
    without ``Content-Length`` is refused as soon as it passes this). 64 MiB: four tasks of the largest size
    the broker's default 16 MiB record limit allows, or a full batch of 10,000 tasks of 6 KiB each (a
    typical task is 0.3-2 KiB); a 256 MB body used to be parsed whole (1.8 GB peak)."""
    validation_budget_s: float = Field(30.0, gt=0, le=600)
    """Seconds a ``POST /v1/tasks`` batch may spend in validation (in a worker thread, off the event
    loop); a batch still unvalidated then is refused with 413 (send smaller batches). Each pattern and
    gold is bounded in size, so one task costs at most ~0.1 s."""
    context_tokens: int | None = Field(None, ge=16, le=10_000_000)
    """The policy's context window in tokens, against which each prompt plus its ``max_new_tokens`` is
    checked at submission (422 naming the task). ``None``: ``max_position_embeddings`` of the model's
    ``config.json`` when the model directory exists (``model.name`` a directory, or SmolLM2 once cached:
    8192), else no check."""
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
    eval_timing: Literal["slack", "at_once"] = "slack"
    """When an eval round's requests are sent. ``slack``: in the rollout's slack, in chunks of
    ``eval_chunk_groups``: a chunk goes once no training group and no eval group is in flight (the rollout has
    generated everything the trainer's next step needs), so evaluation does not delay training data; a round
    waiting longer than ``eval_max_wait_s`` goes whole. ``at_once``: the whole round at once, ahead of the
    training groups issued in the same pass (with the whole round behind them, the main job's trainer waited 6-12 s for
    data after each round)."""
    eval_chunk_groups: int = Field(32, ge=1, le=100_000)
    """Eval groups sent per slack moment (``eval_timing: slack``)."""
    eval_max_wait_s: float = Field(30.0, ge=0.0)
    """Seconds an eval round may wait for slack before the rest of it is sent at once (``eval_timing: slack``)."""
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
    poll_interval_s: float = Field(0.5, gt=0, le=10)
    """Longest wait between two passes of the sampler's issue loop (seconds): deadlines, breaker timers and the
    periodic reports are checked at least this often. Any record the scheduler handles (a reward, a drop, a
    weight version, a control) and any mutating REST request wakes the loop at once, so the issue latency does
    not depend on it; an idle scheduler took 4-5 % of a core at 0.05 s."""
    stall_after_s: float = Field(30.0, ge=0, le=86_400)
    """Seconds the run may have no training work to issue and none in flight, while every domain's reason is one
    that will not pass by itself (retired or paused, over budget, every task retired, a generator that ran dry),
    before the scheduler says the run cannot go on: ``stalled`` in ``GET /v1/status`` and a critical
    ``run/stalled`` alert naming each domain's reason; ``flywheel run`` then ends with that message and writes its
    report. An open breaker (its probe decides) or a generator making tasks is waiting, not stalled."""
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
    metrics_interval_s: float = Field(10.0, gt=0, le=3600)
    """Seconds between two ``Metrics(source="scheduler")`` gauge records on flywheel.metrics (groups issued,
    in flight and completed, policy version, throughput, breakers...: ``scheduler_service.reports``)."""
    issue_order: Literal["cost", "fifo"] = "cost"
    """Order of the groups the mix chose. ``cost``: among the domains due within the next
    ``cost_lookahead`` decisions the one whose groups take the most work (learned from the samples' cost:
    tool, sandbox and verifier seconds plus generated tokens, see ``scheduler_service.issuing.work_per_group``) goes
    first, so long multi-turn groups start early and short ones fill around them; a domain passed over
    ``cost_lookahead`` times goes next whatever its cost, so a domain's count strays at most ``cost_lookahead`` + 1
    groups from its share. ``fifo``: strictly the mix's order."""
    cost_lookahead: int = Field(8, ge=1, le=1024)
    """Decisions a domain may be moved ahead by (``issue_order: cost``); also the bound on how far the
    per-domain counts drift from the weights because of it."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """Raises ValueError for keys that moved to the shared ``budget`` section, naming where they live."""
        return moved_keys("scheduler", data, {"oversample": "budget.oversample",
                                              "resample_unsolved": "budget.resample_unsolved"})


class SchedulerSettings(Settings):
    """What the scheduler process reads: its section, ``domains``, the shared ``budget``, and ``kafka``,
    ``model``, ``run``."""

    budget: BudgetConfig = BudgetConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    monitor: MonitorConfig = MonitorConfig()
    domains: dict[str, DomainConfig] = Field(default_factory=dict)
    """Domains by name. Applied at start: a domain the registry does not know, or whose entry here changed
    since it was last applied, takes this config; otherwise the registry's (REST changes) is kept."""

    @model_validator(mode="after")
    def _domain_names(self) -> "SchedulerSettings":
        import re

        bad = [d for d in self.domains if not re.match(DOMAIN_PATTERN, d)]
        if bad:
            raise ValueError(f"domains: invalid name(s) {bad[:5]} (letters, digits, '_', '.', '-'; up to 128)")
        return self
