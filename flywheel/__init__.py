"""Flywheel's driver: the ``flywheel`` CLI, the launcher of a local system, the embedded broker, the
task generators and shipped domains, the run report, and the root config that composes every
service's section. It sits on top: it imports the services and ``shared``; neither imports it."""
