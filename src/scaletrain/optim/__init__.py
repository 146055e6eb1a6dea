"""Optimizers and learning-rate schedules: what steps the weights (each named by its entry
in registry.py, built in optimizers.py or a module of its own) and at what rate
(schedule.py). Below the engines, which build the optimizer a config names, and the
training loop, which sets its rate each step."""
