"""One exception type for everything a user can get wrong.

The CLI and the app catch ``KVVizError`` and show its message; anything else is a bug.
"""


class KVVizError(ValueError):
    """Bad input (prompt, numbers, model folder, checkpoint): the message is for the user."""


class ResultsNotSaved(KVVizError):
    """The work finished but its result file could not be written: ``text`` holds the results, which
    the CLI prints on stdout so that minutes of measuring are not thrown away."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        self.text = text
