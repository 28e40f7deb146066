"""Configuration of the verifier service (section ``verifier``)."""

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from shared.config import Settings
from shared.verifier_specs import Recipe, safe_default_recipe


class JudgeConfig(BaseModel):
    """The judge endpoint (section ``verifier.judge``). Env: ``FLYWHEEL_VERIFIER__JUDGE__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")
    base_url: str | None = None
    """OpenAI-compatible base URL, e.g. ``https://api.openai.com/v1`` or ``http://vllm:8000/v1``;
    ``None`` = no judge (a recipe with a judge then gives infra_error, flagged ``misconfigured``)."""
    model: str = "gpt-4o-mini"
    api_key: SecretStr | None = None
    """API key; ``None`` = the environment variable named by ``api_key_env`` (may be unset for local servers)."""
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = Field(60.0, gt=0, le=600)
    """Bound of one judge request (seconds)."""
    max_concurrency: int = Field(8, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(512, ge=16, le=32768)
    calibration_file: str | None = None
    """JSONL labelled set (see :func:`load_labelled`) rescored every ``calibration_every_s`` by the service."""
    calibration_every_s: float = Field(0.0, ge=0)
    """0 = never."""
    min_agreement: float = Field(0.8, ge=0, le=1)
    """Below this pass/fail agreement the service logs a drift alert."""


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
    reward_workers: int = Field(2, ge=1, le=64)
    """Processes per user environment that run its reward functions (``environment`` kind): each environment
    gets its own pool, so a slow or stuck reward holds up only its own domain."""
    reward_timeout_s: float = Field(30.0, gt=0, le=600)
    """Bound of one call of an environment's rubric (seconds), counted from when its worker starts it (time
    queued for a worker is not counted); past it the call is an infrastructure error and that worker is killed
    and replaced (the calls of its batch not yet scored go back to the queue)."""
    reward_batch_size: int = Field(64, ge=1, le=4096)
    """Most calls of one environment sent to a worker process in one message. Calls are batched only as far as
    they queue (an idle worker takes an even share of the calls waiting), so a lone call is sent at once; 1
    sends every call on its own (slower for cheap rewards: one round trip per call)."""
    reward_batch_wait_ms: float = Field(0.0, ge=0, le=1000)
    """How long calls that arrive while a worker is idle wait for more before they are sent (milliseconds),
    unless ``reward_batch_size`` of them queue first; 0 sends them at the end of the event loop's step (the
    service scores a poll's records concurrently, so they queue together anyway)."""
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """The judge endpoint used by recipes with a ``judge`` rubric."""
    recipes: dict[str, Recipe] = Field(default_factory=dict)
    """Reward recipe per task domain (a task's own ``verifier.recipe`` wins)."""
    default_recipe: Recipe = Field(default_factory=safe_default_recipe)
    """Recipe of a task whose domain has none here and that carries none of its own, however it came in (REST,
    YAML, generator): correctness, the truncation gate (a completion cut off at its token budget earns 0) and
    ``hack_policy: zero`` (``shared.verifier_specs.safe_default_recipe``). A task opts out with a recipe of its
    own that says why (``recipe: {reason: ...}``)."""
    consumer_group: str = "verifier"
    """Kafka consumer group of flywheel.trajectories (copies with the same group share partitions)."""
    metrics_interval_s: float = Field(10.0, gt=0, le=3600)
    """Seconds between two Metrics snapshots on flywheel.metrics."""


class VerifierSettings(Settings):
    """What the verifier process reads: its section and ``kafka``, ``model``, ``run``."""

    verifier: VerifierConfig = VerifierConfig()
