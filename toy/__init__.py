"""The small-budget recipe of the embedded default: its fictional worlds, the oracle, and the
recipe steps train.py calls (each a no-op in the paper preset)."""
