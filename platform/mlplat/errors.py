"""User-facing errors: the CLI prints these as one line, never a traceback."""


class MlplatError(Exception):
    """A problem the user can fix (bad config, bad data, bad path); the message says how."""


class ConfigError(MlplatError):
    """A config file or override that does not validate."""


class DataError(MlplatError):
    """Input data that cannot be read or does not match its schema."""


class CheckpointError(MlplatError):
    """A model directory or registry URI that does not hold a usable checkpoint."""


def exit_on_user_error(command):
    """Run ``command()``; a :class:`MlplatError` prints as one line (``mlplat: error: ...``) and exits 2."""
    import sys

    try:
        return command()
    except MlplatError as err:
        print(f"mlplat: error: {err}", file=sys.stderr)
        sys.exit(2)
