"""One router per resource: tasks, evals, status (status, metrics history, health)."""
