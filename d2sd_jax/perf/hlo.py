"""What the compiler says of a compiled program: its figures per device (`figures`: the cost
analysis's flops and bytes accessed, the memory analysis, the collectives in its partitioned HLO
and a time estimate) and the collectives themselves (`collectives`, read from the HLO text).

The time estimate is the compiler's own `optimal_seconds` on one chip; on several it comes back
negative, so there the roofline max(flops / peak, bytes / HBM bandwidth) + collective bytes / ICI
bandwidth, from the chip's vendor figures (perf/compiled.py's `TPU_CHIPS`).
"""
from __future__ import annotations

import math
import re


_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4,
                's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
_SHAPE = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\]')
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$')


def _type_bytes(text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(',') if d) * _DTYPE_BYTES[dt]
             for dt, dims in _SHAPE.findall(text))


_LAYOUT_OPS = ('bitcast', 'copy', 'convert', 'reshape', 'transpose', 'copy-start', 'copy-done',
               'slice', 'dynamic-slice', 'get-tuple-element', 'parameter', 'constant', 'tuple')


def collectives(hlo: str) -> dict:
  """The collectives of a compiled (partitioned) HLO module: {'count', 'bytes', 'by_kind':
  {kind: {'count', 'bytes'}}, 'weight_gathers': [all-gathers / all-to-alls whose operand is a
  weight parameter, through layout ops and fusions of layout ops only: a weight moved, not an
  activation computed from it]}. Bytes are each collective's result (an async '-start' counted
  once)."""
  defs = {}  # instruction name -> (opcode, operand names, fused computation)
  params = {}
  fused_ops = {}  # computation name -> opcodes in it
  ops = []
  computation = None
  for line in hlo.split('\n'):
    head = re.match(r'^(?:ENTRY )?%([\w.\-]+) \(.*\{$', line)
    if head:
      computation = head.group(1)
      fused_ops[computation] = set()
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, type_text, opcode, rest = m.groups()
    if computation is not None:
      fused_ops[computation].add(opcode)
    operands = re.findall(r'%([\w.\-]+)', rest.split('),')[0])
    calls = re.search(r'calls=%([\w.\-]+)', rest)
    defs[name] = (opcode, operands, calls.group(1) if calls else None)
    if opcode == 'parameter':
      params[name] = line
    kind = opcode[:-len('-start')] if opcode.endswith('-start') else opcode
    if kind in COLLECTIVES:
      # an async start's type is (operands..., results...): count the results' half
      nbytes = _type_bytes(type_text)
      if opcode.endswith('-start') and type_text.startswith('('):
        nbytes //= 2
      ops.append((kind, name, nbytes))

  def reaches_weight(name, depth=0):
    if name in params:
      return re.search(r'op_name="params', params[name]) is not None
    opcode, operands, called = defs.get(name, ('', [], None))
    if depth > 8:
      return False
    if opcode == 'fusion':
      if not fused_ops.get(called, {'?'}) <= set(_LAYOUT_OPS):
        return False
    elif opcode not in _LAYOUT_OPS:
      return False
    return any(reaches_weight(o, depth + 1) for o in operands)

  by_kind = {}
  gathers = []
  for kind, name, nbytes in ops:
    entry = by_kind.setdefault(kind, {'count': 0, 'bytes': 0})
    entry['count'] += 1
    entry['bytes'] += nbytes
    if kind in ('all-gather', 'all-to-all') and any(reaches_weight(o) for o in defs[name][1]):
      gathers.append(name)
  return {'count': len(ops), 'bytes': sum(b for _, _, b in ops), 'by_kind': by_kind,
          'weight_gathers': gathers}


def cost_analysis(compiled) -> dict:
  """The compiler's cost analysis of a compiled program, as one dict."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return dict(cost or {})


def figures(compiled, chip, n_devices: int) -> dict:
  """Per-device figures of a compiled program (module docstring); `chip`: a
  perf.compiled.TpuChip, whose vendor figures price the roofline."""
  cost = cost_analysis(compiled)
  mem = compiled.memory_analysis()
  coll = collectives(compiled.as_text())
  flops = float(cost.get('flops', 0.0))
  nbytes = float(cost.get('bytes accessed', 0.0))
  optimal = float(cost.get('optimal_seconds', -1.0))
  roofline = max(flops / chip.peak_flops, nbytes / chip.hbm_bandwidth) + (
      coll['bytes'] / chip.ici_bandwidth)
  use_compiler = n_devices == 1 and optimal > 0
  memory = {'arguments': int(mem.argument_size_in_bytes),
            'temporaries': int(mem.temp_size_in_bytes),
            'outputs': int(mem.output_size_in_bytes),
            'aliased': int(mem.alias_size_in_bytes)}
  total = memory['arguments'] + memory['temporaries'] + memory['outputs']
  return {
      'flops_per_device': flops, 'bytes_per_device': nbytes,
      'memory': memory, 'memory_bytes_per_device': total,
      'fits': total <= chip.hbm_bytes, 'hbm_bytes': chip.hbm_bytes,
      'collectives': coll,
      'optimal_seconds': optimal if optimal > 0 else None,
      'roofline_s': roofline,
      'estimate_s': optimal if use_compiler else roofline,
      'estimate_source': 'compiler' if use_compiler else 'roofline',
  }
