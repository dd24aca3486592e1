"""Tools around the paper's path: the run infrastructure train.py and evaluate.py share (runs.py), the
trajectory report and learning-curve plot make run draws (report.py, plot_curve.py), the memory plan
(memory_plan.py) and the one-shot GPU check (gpu_check.py)."""
