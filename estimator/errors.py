"""The one error type the estimator raises for bad input.

Command lines catch it and print its message on one line with exit code 2; nothing else in the
package prints. Messages are complete sentences a user can act on.
"""


class EstimatorError(ValueError):
    """Invalid input: unknown model or GPU, impossible combination, bad size, malformed file."""
