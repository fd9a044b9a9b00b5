"""What ``Model.compile`` builds: losses, metrics, optimizers and their schedule, the
precision (``setup.Compiled``)."""
