"""The error every user-facing failure is raised as, so front ends can print it without a traceback."""


class StrataError(Exception):
    """A problem with the user's input (model files, config, request) that strata explains in its message."""
