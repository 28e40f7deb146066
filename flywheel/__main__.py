"""``python -m flywheel``: the ``flywheel`` CLI."""

from flywheel.cli import app

if __name__ == "__main__":
    app()
