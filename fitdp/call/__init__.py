"""One call of ``fit`` / ``evaluate`` / ``predict``: its plan (arguments checked), its
session (the steps, logs and rollback), the batch loop, the run state kept between calls,
the replicas it drives, what a custom step sees of the other replicas (``gather``) and the
``Monitor`` a call installs on them."""
