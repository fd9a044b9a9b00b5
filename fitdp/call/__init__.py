"""One call of ``fit`` / ``evaluate`` / ``predict``: its plan (arguments checked), its
session (the steps, logs and rollback), the batch loop, the run state kept between calls and
the replicas it drives."""
