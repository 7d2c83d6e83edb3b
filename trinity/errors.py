"""Errors that are the user's to fix, as opposed to bugs.

The CLI prints a UserError as one clean block and exits with code 2; any other exception is a
bug and shows a traceback only with --debug.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad config, missing or corrupt file, unsupported model).

    The message must be one line (or one line per problem) naming the file or config key.
    """

    exit_code = 2


class ConfigError(UserError):
    """One or more problems in a job config, each as `path.to.key: problem; fix`."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
