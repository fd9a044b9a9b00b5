"""Data sources: every form fit/evaluate/predict accept, behind one interface."""
