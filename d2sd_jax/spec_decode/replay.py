"""Prompt lookup replayed on the host, in plain Python: what drafting.pld proposes after a
sequence, and how many cycles it takes to produce a completion. Every method's greedy output is
the target's own, so a completion decoded by any method says what prompt lookup would have done
on it: auto predicts prompt lookup from it (decode/autoconfig.py), and calibration measures its
acceptance rates on records (train/calibration.py)."""
from __future__ import annotations


def lookup_proposal(seq: list[int], gamma: int, ngram_max: int) -> tuple[list[int], int]:
  """Prompt lookup's proposal after `seq` (drafting.pld's rule, in plain Python): the tokens that
  followed the latest earlier occurrence of the longest matching tail n-gram (n <= ngram_max)
  whose continuation is longest (up to gamma - 1 tokens). Returns (tokens, n); n = 0: none."""
  L, N = len(seq), gamma - 1
  for n in range(min(ngram_max, L - 1), 0, -1):
    tail = seq[L - n:]
    best = None
    for j in range(0, L - n):  # a match seq[j:j+n] ending before the tail's last token
      if j + n <= L - 1 and seq[j:j + n] == tail:
        follow = min(L - (j + n), N)
        if best is None or (follow, j) > best:
          best = (follow, j)
    if best is not None:
      start = best[1] + n
      return seq[start:start + N], n
  return [], 0


def lookup_cycles(prompt: list[int], completion: list[int], gamma: int, ngram_max: int) -> int:
  """The cycles prompt lookup (drafting.pld, greedy) takes to produce `completion` after
  `prompt`: every output equals the target's greedy one whatever the method, so a completion
  decoded by any method says what pld would have done on it. A cycle accepts its proposal's
  tokens while they equal the completion's, then the target's own token, up to the
  completion's end (its first token is the prefill's)."""
  done, cycles = 1, 0
  while done < len(completion):
    proposal, _ = lookup_proposal(list(prompt) + list(completion[:done]), gamma, ngram_max)
    room = len(completion) - done
    k = 0
    while k < min(len(proposal), room) and proposal[k] == completion[done + k]:
      k += 1
    done += min(k + 1, room)
    cycles += 1
  return cycles
