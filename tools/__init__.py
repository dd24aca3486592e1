"""Tools around the paper's path: the model's way in (models.py) and the run infrastructure
(runs.py) that train.py and evaluate.py share; decoding's KV cache written in place (kv_cache.py); the trajectory report and learning-curve plot make
run draws (report.py, plot_curve.py); one trajectory printed (trajectory.py); the memory plan
(memory_plan.py, with memory_gpu.py, memory_host.py and memory_check.py); the one-shot GPU check
(gpu_check.py); and the rehearsal of the README's few-GPU commands (rehearsal.py)."""
