"""What keeps a run going or stops it cleanly: non-finite steps (nonfinite.py), out-of-memory
recovery (oom.py), preemption (preempt.py), replica groups that outlive a failed one
(replica_groups.py), a rank that stops making progress (watchdog.py), replicas that drift
apart (weights.py), and the fault drills that test all of it (faults.py).
"""
