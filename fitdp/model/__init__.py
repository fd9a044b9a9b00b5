"""The facade: ``Model`` (compile / fit / evaluate / predict) with its saving, extras and
summary. ``fitdp.Model`` is ``fitdp.model.facade.Model``."""
