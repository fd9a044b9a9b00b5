"""Data: ``DataBatch``/``DataDesc``, the ``DataSource`` protocol and its sources, and
bucketing for variable-length data."""
