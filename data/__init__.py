"""The data: question loading (questions.py), the paper's data from the hub (download.py), and the
embedded default's toy worlds as files (toy/, toy_seed1/; made by toy/make_toy.py)."""
