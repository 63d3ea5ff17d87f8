"""The one error type every package of the project raises for bad input (estimator, profiler,
fitting).

Command lines catch it and print its message on one line with exit code 2; nothing else in the
packages prints. Messages are complete sentences a user can act on.
"""


class InputError(ValueError):
    """Invalid input: unknown model or GPU, impossible combination, bad size, malformed file,
    corrupt table or run folder."""
