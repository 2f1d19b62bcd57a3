"""The one error `pagoda analyze` reports to the user: a message, no traceback."""


class AnalyzeError(Exception):
    """The analysis cannot go on; the message says why and what to do."""
