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


def partitions_for(topic: str, partitions: int) -> int:
    """Partition count of ``topic`` given the configured count for the partitioned ones.

    flywheel.weights has one partition so every replica reads the versions in order.
    """
    if topic in PARTITIONED:
        return partitions
    if topic == WEIGHTS:
        return 1
    return 2
