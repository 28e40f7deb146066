"""Topic names and their partition layout (DESIGN.md, "Topics and messages")."""

TASKS = "flywheel.tasks"
ROLLOUT_REQUESTS = "flywheel.rollout.requests"
TRAJECTORIES = "flywheel.trajectories"
SCORED = "flywheel.scored"
REWARDS = "flywheel.rewards"
WEIGHTS = "flywheel.weights"
METRICS = "flywheel.metrics"
GROUP_DROPS = "flywheel.group_drops"
ALERTS = "flywheel.alerts"
CONTROL = "flywheel.control"
DLQ = "flywheel.dlq"

#: Topics whose partition count follows ``kafka.partitions`` (keyed by group_id).
PARTITIONED = (ROLLOUT_REQUESTS, TRAJECTORIES, SCORED)
ALL = (TASKS, ROLLOUT_REQUESTS, TRAJECTORIES, SCORED, REWARDS, WEIGHTS, METRICS, GROUP_DROPS, ALERTS, CONTROL, DLQ)


DEFAULT_POOL = "default"
"""The rollout pool of a domain or replica that names none: its requests go to :data:`ROLLOUT_REQUESTS`."""

POOL_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""What a rollout pool name may be (it becomes part of a topic name)."""


def rollout_requests(pool: str = DEFAULT_POOL) -> str:
    """The request topic of rollout ``pool``: :data:`ROLLOUT_REQUESTS` for the default pool, else
    ``flywheel.rollout.requests.<pool>`` (one topic per pool; its replicas share one consumer group on it,
    DESIGN "Pools")."""
    return ROLLOUT_REQUESTS if pool == DEFAULT_POOL else f"{ROLLOUT_REQUESTS}.{pool}"


def partitions_for(topic: str, partitions: int) -> int:
    """Partition count of ``topic`` given the configured count for the partitioned ones (a pool's
    request topic counts as partitioned).

    flywheel.weights has one partition so every replica reads the versions in order.
    """
    if topic in PARTITIONED or topic.startswith(ROLLOUT_REQUESTS + "."):
        return partitions
    if topic == WEIGHTS:
        return 1
    return 2
