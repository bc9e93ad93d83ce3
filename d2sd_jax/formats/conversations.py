"""Prompt files for distillation: any JSONL of prompts or conversations, read as user turns.

One JSON object per line (blank lines are skipped), in any of these forms:
  {"prompt": "..."}                                          one user turn; "chat": false makes
                                                              it a plain completion prompt
  {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}     ShareGPT
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   OpenAI
  {"turns": ["...", ...]}                                    DFlash / MT-Bench: the user turns
An optional "id" names the conversation (default: a hash of its turns). A line that fits none
of these is an error naming the file and line.

Multi-turn: the target regenerates EVERY assistant turn, in order, each given the conversation
so far with its own earlier replies (the file's assistant turns are dropped). The drafter then
learns what the target itself says at every turn of such conversations, the way it is served;
the cost is that a later user turn may answer a reply the target did not give. A `turns` file
has no replies at all, so it could not be read any other way.

Training on a file directly (`data.source='conversations'`, `records.ConversationsSource`) keeps
the file's own assistant turns instead (`Conversation.dialogue`): each one is a label sequence,
asked with the conversation before it. That teaches the drafter someone else's replies, so
distilled shards train better drafters; a `turns` or `prompt` line has no reply to learn and
must be distilled first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

SHAREGPT_ROLES = {'system': 'system', 'human': 'user', 'user': 'user', 'gpt': 'assistant',
                  'assistant': 'assistant', 'chatgpt': 'assistant', 'bard': 'assistant',
                  'bing': 'assistant'}
ROLES = ('system', 'user', 'assistant')


@dataclasses.dataclass(frozen=True)
class Conversation:
  """What the target is given: an optional system message and the user turns."""
  id: str
  user_turns: tuple[str, ...]
  system: str | None = None
  chat: bool = True  # False: one plain-text prompt (no chat template)
  style: str = 'prompt'  # the line's format: prompt, sharegpt, messages, turns
  source: str = ''  # file:line
  # The file's messages after the system message, replies included: ((role, text), ...).
  # Distillation ignores the replies; training on the file learns them.
  dialogue: tuple[tuple[str, str], ...] = ()

  def messages(self, replies) -> list[dict]:
    """The chat messages that ask for assistant turn len(replies), given the earlier replies."""
    if len(replies) >= len(self.user_turns):
      raise ValueError(f'conversation {self.id} has {len(self.user_turns)} user turns: no turn '
                       f'{len(replies)}')
    msgs = [{'role': 'system', 'content': self.system}] if self.system is not None else []
    for user, reply in zip(self.user_turns, list(replies) + [None]):
      msgs.append({'role': 'user', 'content': user})
      if reply is not None:
        msgs.append({'role': 'assistant', 'content': reply})
    return msgs

  def reply_prompts(self) -> list[tuple[list[dict], str]]:
    """[(the chat messages before assistant turn k, its text)] for every assistant turn of the
    file: what training on the file's own replies learns (empty for `turns` and `prompt`)."""
    head = [{'role': 'system', 'content': self.system}] if self.system is not None else []
    return [(head + [{'role': r, 'content': t} for r, t in self.dialogue[:j]], text)
            for j, (role, text) in enumerate(self.dialogue) if role == 'assistant']


def _text(value, what: str) -> str:
  """A message's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
  if isinstance(value, list) and all(isinstance(p, dict) and p.get('type') == 'text' and
                                     isinstance(p.get('text'), str) for p in value):
    value = ''.join(p['text'] for p in value)
  if not isinstance(value, str):
    raise ValueError(f'{what} must be a string, not {type(value).__name__}')
  return value


def _roles(items, role_key: str, text_key: str, names: dict, field: str):
  """[(role, text)] of a message list, roles mapped through `names`."""
  if not isinstance(items, list) or not items:
    raise ValueError(f'"{field}" must be a non-empty list of messages')
  out = []
  for k, m in enumerate(items):
    if not isinstance(m, dict) or role_key not in m or text_key not in m:
      raise ValueError(f'{field}[{k}] must be an object with "{role_key}" and "{text_key}"')
    role = names.get(m[role_key]) if isinstance(m[role_key], str) else None
    if role is None:
      raise ValueError(f'{field}[{k}]: unknown {role_key} {m[role_key]!r} (expected one of '
                       f'{sorted(names)})')
    out.append((role, _text(m[text_key], f'{field}[{k}].{text_key}')))
  return out


def parse(obj) -> Conversation:
  """One line's JSON value as a Conversation (ValueError saying what is wrong)."""
  if not isinstance(obj, dict):
    raise ValueError(f'expected a JSON object, got {type(obj).__name__}')
  chat = obj.get('chat', True)
  if not isinstance(chat, bool):
    raise ValueError('"chat" must be true or false')
  if 'prompt' in obj:
    style, turns = 'prompt', [('user', _text(obj['prompt'], '"prompt"'))]
  elif 'conversations' in obj:
    style = 'sharegpt'
    turns = _roles(obj['conversations'], 'from', 'value', SHAREGPT_ROLES, 'conversations')
  elif 'messages' in obj:
    style = 'messages'
    turns = _roles(obj['messages'], 'role', 'content', {r: r for r in ROLES}, 'messages')
  elif 'turns' in obj:
    style, items = 'turns', obj['turns']
    if not isinstance(items, list) or not items:
      raise ValueError('"turns" must be a non-empty list of user messages')
    turns = [('user', _text(t.get('content') if isinstance(t, dict) else t, f'turns[{k}]'))
             for k, t in enumerate(items)]
  else:
    raise ValueError('no "prompt", "conversations", "messages" or "turns" field')
  system = None
  if turns[0][0] == 'system':
    system = turns.pop(0)[1]
  if any(role == 'system' for role, _ in turns):
    raise ValueError('a system message is only supported as the first message')
  users = tuple(text for role, text in turns if role == 'user')
  if not users or any(not u.strip() for u in users):
    raise ValueError('no user turn' if not users else 'an empty user turn')
  if not chat and (style != 'prompt' or system is not None):
    raise ValueError('"chat": false is only for a single "prompt"')
  content = json.dumps([system, users, chat])
  conv_id = obj.get('id', hashlib.sha256(content.encode()).hexdigest()[:16])
  return Conversation(id=str(conv_id), user_turns=users, system=system, chat=chat, style=style,
                      dialogue=tuple(turns))


def parse_line(line: bytes, where: str) -> Conversation:
  """One raw line of a JSONL file (ValueError prefixed with `where`, e.g. 'file:12')."""
  try:
    conv = parse(json.loads(line.decode('utf-8')))
  except ValueError as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
    raise ValueError(f'{where}: {e}') from e
  return dataclasses.replace(conv, source=where)


def scan(path: str):
  """(line number, byte offset, byte length, Conversation) of every non-blank line, in file
  order: one pass that validates the whole file and tells where each line is, so a reader can
  come back for a line (os.pread) without keeping the file in memory."""
  try:
    f = open(path, 'rb')  # bytes: a line that is not UTF-8 is reported with its number
  except FileNotFoundError as e:
    raise FileNotFoundError(f'prompt file {path!r} not found') from e
  with f:
    offset = 0
    for n, line in enumerate(f, 1):
      if line.strip():
        yield n, offset, len(line), parse_line(line, f'{path}:{n}')
      offset += len(line)


def read(path: str) -> list[Conversation]:
  """Every conversation of a JSONL prompt file, in file order."""
  convs = [conv for _, _, _, conv in scan(path)]
  if not convs:
    raise ValueError(f'{path}: no prompts')
  return convs
