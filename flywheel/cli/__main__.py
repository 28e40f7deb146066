"""``python -m flywheel.cli``: the ``flywheel`` command."""

from flywheel.cli import app

app()
