"""Files written whole or not at all: a reader (a resumed run, another process, a crash's
survivor) never sees half of one."""
from __future__ import annotations

import contextlib
import json
import os


@contextlib.contextmanager
def replaced(path: str, suffix: str = ''):
  """Yields a temporary path beside `path` (ending in `suffix`, for writers that add one, such
  as numpy's); once the block succeeds the file is renamed onto `path` in one step, and if it
  fails the temporary file is removed and `path` is left as it was."""
  tmp = f'{path}.{os.getpid()}.tmp{suffix}'
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_json(path: str, obj) -> None:
  """`obj` as indented JSON at `path`, written whole (its folder made if need be)."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with replaced(path) as tmp, open(tmp, 'w') as f:
    json.dump(obj, f, indent=1)


def replace_block(path: str, begin: str, end: str, text: str) -> None:
  """Puts `text` (ending in a newline) between the page's one `begin` and one `end` marker,
  leaving the rest of the page as it was; written whole. A page without exactly one pair of
  markers is refused with a message naming them."""
  with open(path) as f:
    page = f.read()
  if page.count(begin) != 1 or page.count(end) != 1:
    raise SystemExit(f'{path} needs one {begin} ... {end} block: add the markers where the '
                     'generated text goes')
  head, rest = page.split(begin)
  _, tail = rest.split(end)
  with replaced(path) as tmp, open(tmp, 'w') as f:
    f.write(head + begin + '\n' + text + end + tail)
