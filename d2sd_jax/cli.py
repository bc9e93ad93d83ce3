"""decode.py and train.py as absl programs whose user errors read as one line.

A bad flag, a bad config value, a missing file: `error: <message>` on stderr and exit status 2,
not a 20-line traceback. ValueError and OSError (FileNotFoundError: a missing checkpoint, prompts
or config file) are what the library raises for bad input; any other exception is a bug and
keeps its traceback (so does every error with D2SD_TRACEBACK=1 in the environment).
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

USER_ERRORS = (ValueError, OSError)
EXIT_USER_ERROR = 2


def _one_line(e: BaseException) -> str:
  while e.args and isinstance(e.args[0], BaseException):  # config_flags wraps KeyErrors
    e = e.args[0]
  text = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
  return ' '.join(text.split())


def fail(e: BaseException, context: str = ''):
  print(f'error: {context}{_one_line(e)}', file=sys.stderr, flush=True)
  sys.exit(EXIT_USER_ERROR)


def _parse_flags(argv):
  """absl's flag parsing; a bad --config override (unknown field, wrong type, missing config
  file) is a user error too (config_flags raises KeyError / AttributeError / TypeError)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # names the flag itself
    _fail_unless_traceback(e)
  except (AttributeError, KeyError, TypeError, *USER_ERRORS) as e:
    _fail_unless_traceback(e, 'bad command line: ')


def _fail_unless_traceback(e: BaseException, context: str = ''):
  if os.environ.get('D2SD_TRACEBACK'):
    raise e
  fail(e, context)


def run(main) -> None:
  """app.run(main) with user errors as one line on stderr and exit status 2."""

  def guarded(argv):
    try:
      main(argv)
    except USER_ERRORS as e:
      _fail_unless_traceback(e)

  app.run(guarded, flags_parser=_parse_flags)
