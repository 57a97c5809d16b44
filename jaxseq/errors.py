"""The one exception type users see: its message is a single line saying what is wrong and how to fix it."""


class JaxseqError(Exception):
    """A problem the user can fix (bad path, bad config, bad flag). Scripts print it as one line."""
