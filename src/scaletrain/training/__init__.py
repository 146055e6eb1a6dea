"""One training run: the loop (trainer.py), what it decides before it allocates (preflight.py,
defaults.py), its optimizer and schedule (optim.py), its checkpoints (saves.py), evaluation
(evaluation.py, eval_checkpoint.py) and its directory (rundir.py, paths.py).
"""
