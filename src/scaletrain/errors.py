"""The one exception type that reaches the user as a clean, one-line message."""


class UserError(Exception):
    """Bad input from the user (config, paths, data): printed as one line, exit code 2.

    The message names the problem and what is accepted; the CLI prints it without a
    traceback. Anything else that escapes is a bug in scaletrain and keeps its traceback.
    """


# Bad input (a UserError): the CLI's exit code, and what a launcher reads as "nothing crashed".
EXIT_USAGE = 2
# Documented in README and docs/checkpointing.md: "stopped on request, checkpoint saved,
# run again to continue" (EX_TEMPFAIL, sysexits.h: try again later).
EXIT_PREEMPTED = 75
# The hang watchdog stopped the job (guards.hang_timeout_s): not bad input (2), not a
# preemption (75); the run was healthy until something stopped making progress.
EXIT_HUNG = 3


class Preempted(Exception):
    """The run stopped on a preemption signal after saving the checkpoint of `step` (resilience/preempt.py)."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"preempted ({signal_name}) at step {step}: checkpoint saved; run the same command again to continue")
        self.step = step


# A rank ran out of device memory and the run continues at a smaller micro-batch after all
# ranks restart (resilience/oom.py); `scaletrain launch` restarts them. Under plain torchrun without
# restarts, running the same command again continues.
EXIT_OOM = 4


class OutOfMemoryRestart(Exception):
    """One process, out of device memory: start again inside it at a smaller micro-batch (resilience/oom.py)."""
