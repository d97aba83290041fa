"""The paper: figures, tables and provenance from the cached results of every run (never a retraining)."""
