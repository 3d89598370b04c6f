"""The multi-process runtime: devices and meshes, jax.distributed, the launcher and its supervisor, elastic
restarts, the re-plan on a new device count, goodput and the run's JSON-lines files."""
