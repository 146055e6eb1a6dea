"""From one command line to ranks in a process group: the torchrun / deepspeed command
(torchrun.py), replica groups on one machine (groups.py), batch scripts and manifests for
Slurm and Kubernetes (cluster.py, cluster_groups.py), the environment names a launcher
passes to its ranks (env.py), and each rank's side: its process group (distributed.py).
"""
