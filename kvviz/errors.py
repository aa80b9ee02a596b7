"""One exception type for everything a user can get wrong.

The CLI and the app catch ``KVVizError`` and show its message; anything else is a bug.
"""


class KVVizError(ValueError):
    """Bad input (prompt, numbers, model folder, checkpoint): the message is for the user."""
