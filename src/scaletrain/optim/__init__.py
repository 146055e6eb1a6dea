"""Optimizers and learning-rate schedules: what steps the weights (optimizers.py, muon.py)
and at what rate (schedule.py). Below the engines, which build the optimizer a config names,
and the training loop, which sets its rate each step."""
