"""The embedded default's data: toy worlds (make_toy.py), their oracle (oracle.py), question loading (questions.py)."""
