"""One training run: the loop (trainer.py), what it decides before it allocates (preflight.py,
defaults.py), its checkpoints (saves.py), evaluation (evaluation.py, eval_checkpoint.py), its
directory (rundir.py, paths.py) and the plan of it `scaletrain plan` shows (planned.py).
"""
