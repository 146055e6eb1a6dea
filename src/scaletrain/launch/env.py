"""The environment variables a launcher sets for its ranks: the one place their names live,
so the side that sets one and the side that reads it cannot drift apart."""

# Restarts `scaletrain launch` made itself after an out-of-memory error (launch/torchrun.py);
# with torchrun's TORCHELASTIC_RESTART_COUNT, which attempt this is (resilience/faults.py).
RELAUNCH_ENV = "SCALETRAIN_RELAUNCH"
# Where each rank writes the one line of a fatal error for the launcher to print.
ERROR_DIR_ENV = "SCALETRAIN_ERROR_DIR"
# A replica group's index, 0..groups-1 (`launch --ft-groups`; resilience/replica_groups.py).
GROUP_ENV = "SCALETRAIN_FT_GROUP"
# torchft's lighthouse address, and the launcher's start barrier (launch/groups.py).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
START_ENV = "SCALETRAIN_FT_START"
