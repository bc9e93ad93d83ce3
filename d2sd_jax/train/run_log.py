"""What a training run writes and says: its metrics (metrics.jsonl and TensorBoard event files
in the workdir) and, at the end, where its checkpoint is and the commands that follow."""
from __future__ import annotations

import json
import os


def next_steps(config, checkpoint: str, dflash: bool = False) -> str:
  """What a finished run prints: where its checkpoint is and the commands that follow
  (`dflash`: the drafter started from a DFlash one, and exports as one again)."""
  workdir, target = config.workdir, config.target
  tflag = '' if target == 'smollm2' else f' --config.target={target}'
  data = '' if config.data.path == 'data/distill' else f' --config.data.path={config.data.path}'
  lines = [f'checkpoint: {checkpoint}', 'next:']
  if config.kind == 'drafter1':
    lines += [f'  python train.py --config configs/drafter2.py{tflag}{data} '
              f'--config.init_from={workdir}   # drafter 2, from this one',
              f'  python decode.py --config configs/smollm2.py{tflag} --config.method=dflash '
              f'--config.drafter1={workdir}']
  else:
    lines += [f'  python decode.py --config configs/smollm2.py{tflag} --config.method=d2sd '
              f'--config.drafter1={config.get("init_from") or "DRAFTER1"} '
              f'--config.drafter2={workdir}']
  lines.append(f'  python scripts/export_drafter.py {workdir} OUT   # bfloat16, as drafters/ '
               'ships them')
  if dflash:
    lines.append(f'  python scripts/dflash.py export {workdir} OUT   # as a DFlash folder')
  return '\n'.join(lines)


class MetricsLog:
  """Metrics as JSON lines (metrics.jsonl) and TensorBoard event files (tb/) in the workdir."""

  def __init__(self, workdir: str, enabled: bool = True):
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb = SummaryWriter(os.path.join(workdir, 'tb')) if enabled else None

  def write(self, step: int, record: dict, scalars: dict):
    if not self.enabled:
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    for name, value in scalars.items():
      self.tb.add_scalar(name, value, step)
    self.tb.flush()

  def close(self):
    if self.tb is not None:
      self.tb.close()
