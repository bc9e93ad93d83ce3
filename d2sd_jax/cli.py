"""decode.py and train.py as absl programs whose user errors read as one line.

A bad flag, a bad config value, a missing file: `error: <message>` on stderr and exit status 2,
not a 20-line traceback. ValueError and OSError (FileNotFoundError: a missing checkpoint, prompts
or config file) are what the library raises for bad input; any other exception is a bug and
keeps its traceback (so does every error with D2SD_TRACEBACK=1 in the environment).
"""
from __future__ import annotations

import os
import re
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


def _parse_flags(argv, meant=None):
  """absl's flag parsing; a bad --config override (unknown field, wrong type, missing config
  file) is a user error too (config_flags raises KeyError / AttributeError / TypeError). An
  unknown field is named with the flag and the field `meant(field)` says it likely means."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # names the flag itself
    _fail_unless_traceback(e)
  except (AttributeError, KeyError) as e:
    _fail_unless_traceback(_unknown_field(e, argv, meant), 'bad command line: ')
  except (TypeError, *USER_ERRORS) as e:
    _fail_unless_traceback(e, 'bad command line: ')


def _unknown_field(e: BaseException, argv, meant) -> BaseException:
  """`--config.gamma=16: the config has no field gamma (did you mean --config.spec.gamma?)`
  for config_flags' bare "'gamma'"."""
  quoted = re.search(r"'([^']+)'", _one_line(e))
  if not quoted:
    return e
  bad = quoted.group(1)
  for arg in argv[1:]:
    path = arg.removeprefix('--').split('=', 1)[0]
    if path.startswith('config.') and bad in path.split('.')[1:]:
      field = path.removeprefix('config.')
      known = meant(field) if meant else None
      return ValueError(f'--{arg.removeprefix("--")}: the config has no field {field}' +
                        (f' (did you mean --config.{known}?)' if known else ''))
  return e


def _fail_unless_traceback(e: BaseException, context: str = ''):
  if os.environ.get('D2SD_TRACEBACK'):
    raise e
  fail(e, context)


def run_script(main) -> None:
  """main() of an argparse script, its user errors as one line on stderr and exit status 2."""
  try:
    main()
  except USER_ERRORS as e:
    _fail_unless_traceback(e)


def run(main, meant=None) -> None:
  """app.run(main) with user errors as one line on stderr and exit status 2; `meant(field)`:
  the config field an unknown one likely means, or None (config_check.closest)."""

  def guarded(argv):
    try:
      main(argv)
    except USER_ERRORS as e:
      _fail_unless_traceback(e)

  app.run(guarded, flags_parser=lambda argv: _parse_flags(argv, meant))
