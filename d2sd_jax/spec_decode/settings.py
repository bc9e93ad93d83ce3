"""SpecSettings: everything a speculative decode is compiled for (the method, its block and
tree, the drafters' configurations, the adaptive tree's costs, the sampling), checked when
made. speculative.py runs the cycle these settings describe; it re-exports the class, so
`speculative.SpecSettings` is this one."""
from __future__ import annotations

import dataclasses

from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class SpecSettings:
  """Static settings of a speculative generation program."""
  generation: ar.GenerationSettings
  method: str = 'pld'
  gamma: int = 8  # block length: the anchor + gamma-1 draft tokens per chain
  ngram_max: int = 3  # pld: longest n-gram matched (falls back to shorter ones)
  drafter1: drafter_lib.DrafterConfig | None = None
  drafter2: drafter_lib.DrafterConfig | None = None
  n_branches: int = 4  # K: branches re-drafted from drafter 1's likely rejection points
  steps: int = 1  # diffusion effort: denoising passes per drafted block
  order: str = 'confidence'  # multi-step unmasking order ('confidence' or 'left_to_right')
  tree_budget: int = 0  # nodes verified per cycle incl. the anchor (0 = every candidate)
  leniency: float = 0.0  # λ: verify against (1-λ)p + λq (0 = lossless; > 0 trades fidelity)
  redraft: str = 'exclude'  # a re-draft starting with the chain's token: 'exclude' or 'merge'
  # Re-drafting passes per branch: passes 2..P each see one more re-drafted token and draft the
  # rest again (drafting.redrafts): the continuation conditioned on the branch's first token.
  branch_passes: int = 1
  # d2sd_tree: prompt lookup's per-token acceptance rate after a match of n = 1, 2, ... tokens
  # (the last entry for longer ones): its nodes' estimated probability is a^depth.
  lookup_accept: tuple[float, ...] = (0.4, 0.674, 0.936)  # python scripts/lookup_rates.py
  # Best-first trees (ddtree, d2sd_tree): every cycle, verify only as many of the tree_budget
  # nodes as give the most expected tokens per second: the tree's own estimates (its nodes'
  # scores) against node_costs. Only the chosen verification runs (lax.switch); a batch shares
  # one shape, chosen for its live rows' expected tokens together.
  adaptive: bool = False
  # ((nodes, seconds of a cycle verifying that many), ...): the shapes `adaptive` chooses among
  # and what a cycle of each costs on this machine. decode.py and Decoder.generate measure them
  # (perf.costmodel.measure, cached) when left empty.
  node_costs: tuple[tuple[int, float], ...] = ()
  # Adaptive trees whose pool holds prompt lookup's proposal (d2sd_tree): before drafting, a
  # cycle verifies that proposal alone (gamma nodes, no drafter runs) when its expected tokens
  # per second, at lookup_cost seconds a cycle, beat what the drafted trees have been giving
  # (adaptive.lookup_wins). decode.py and Decoder.generate measure lookup_cost with
  # node_costs. Other methods, and trees that are not adaptive, ignore lookup_cycles.
  lookup_cycles: bool = True
  lookup_cost: float = 0.0
  # Best-first trees: count, per proposer, depth and bin of estimated probability, how many
  # verified nodes were accepted (SpecState.node_tally; scripts/calibrate_nodes.py reads it).
  tally_nodes: bool = False
  # Best-first trees: map each proposer's scores through the reliability curves the drafters
  # carry (DrafterConfig.node_calibration: drafter 1's for its own nodes and prompt lookup's,
  # drafter 2's for its re-drafts); False: the raw estimates (what calibrate_nodes.py fits on).
  calibrated: bool = True
  # Which of those curves: the ones fitted on this kind of request ('plain' completions or
  # 'chat'), where the drafters carry them, else the pooled ones; '' the pooled ones only.
  # decode.py and Decoder.generate set it from the request's `chat` for the trees.
  calibration_kind: str = ''
  # Drafters attend to at most the last W committed tokens (0: all of them). They are trained
  # on windows of seq_len tokens (320 for the shipped ones); W bounds the context they see at
  # decode time to what they learned on. The target always sees everything.
  drafter_window: int = 0

  def __post_init__(self):
    method = drafting.get(self.method)  # raises, naming the known methods
    if self.gamma < 2:
      raise ValueError(f'gamma={self.gamma} must be >= 2 (the anchor plus at least one draft)')
    if self.drafter_window < 0:
      raise ValueError(f'drafter_window={self.drafter_window} must be >= 0 (0: the whole '
                       'context)')
    if self.calibration_kind not in ('',) + tree_lib.CALIBRATION_KINDS:
      raise ValueError(f'calibration_kind={self.calibration_kind!r} must be one of '
                       f"{tree_lib.CALIBRATION_KINDS} or '' (the pooled curves)")
    if self.ngram_max < 1:
      raise ValueError(f'ngram_max={self.ngram_max} must be >= 1')
    for name in method.drafters:
      dcfg = getattr(self, name)
      if dcfg is None:
        raise ValueError(f'method {self.method!r} needs {name}: configure its checkpoint')
      if dcfg.gamma != self.gamma:
        raise ValueError(f'{name} was built for gamma={dcfg.gamma}, the decode config says '
                         f'gamma={self.gamma}: set gamma={dcfg.gamma} (decode.py: '
                         f'--config.spec.gamma={dcfg.gamma}), or leave it unset to follow the '
                         'drafter')
    if method.branched and not 1 <= self.n_branches <= self.gamma - 1:
      raise ValueError(f'n_branches={self.n_branches} must be in 1..gamma-1={self.gamma - 1}')
    if self.steps < 1:
      raise ValueError(f'steps={self.steps} must be >= 1 (denoising passes per block)')
    if self.order not in ('confidence', 'left_to_right'):
      raise ValueError(f"order={self.order!r}: use 'confidence' or 'left_to_right'")
    if self.redraft not in ('exclude', 'merge'):
      raise ValueError(f"redraft={self.redraft!r}: use 'exclude' (forbid the chain's token at a "
                       "branch's first position) or 'merge' (a branch follows the chain while "
                       'it agrees)')
    if not 1 <= self.branch_passes <= self.gamma - 1:
      raise ValueError(f'branch_passes={self.branch_passes} must be in 1..gamma-1='
                       f'{self.gamma - 1} (re-drafting passes per branch)')
    if self.branch_passes > 1 and not method.redrafter:
      raise ValueError(f'branch_passes={self.branch_passes}: method {self.method!r} re-drafts '
                       'no branches (use dflash_dflash, d2sd, d2sd_tree or d2sd_pld, or '
                       'branch_passes=1)')
    if not 0.0 <= self.leniency <= 1.0:
      raise ValueError(f'leniency={self.leniency} must be in [0, 1] (0 = lossless)')
    if not self.lookup_accept or not all(0.0 < a < 1.0 for a in self.lookup_accept):
      raise ValueError(f'lookup_accept={self.lookup_accept} must be acceptance rates in (0, 1)')
    if self.adaptive:
      sizes = [n for n, _ in self.node_costs]
      if not method.budgeted:
        raise ValueError(f'adaptive=True chooses a best-first tree\'s size: method '
                         f'{self.method!r} has a fixed tree (use ddtree or d2sd_tree)')
      if not sizes or any(not 2 <= n <= self.tree_size for n in sizes) or len(set(sizes)) < len(
          sizes) or any(c <= 0 for _, c in self.node_costs):
        raise ValueError(f'node_costs={self.node_costs} must pair distinct tree sizes in '
                         f'2..{self.tree_size} (the tree budget) with positive cycle costs; '
                         'leave it empty in decode.py or Decoder.generate to measure them')
    elif self.node_costs:
      raise ValueError('node_costs are the adaptive tree\'s: set adaptive=True or drop them')
    if self.takes_lookup_cycles:
      if not self.lookup_cost > 0:
        raise ValueError(f'lookup_cost={self.lookup_cost} must be the positive seconds of a '
                         'lookup-only cycle (or set lookup_cycles=False); leave it unset in '
                         'decode.py or Decoder.generate to measure it')
    elif self.lookup_cost:
      raise ValueError(f'lookup_cost is the lookup-only cycle\'s, which method '
                       f'{self.method!r} with adaptive={self.adaptive} and lookup_cycles='
                       f'{self.lookup_cycles} never runs: drop it (lookup-only cycles are '
                       'for adaptive trees whose pool holds prompt lookup: d2sd_tree)')
    if self.tally_nodes and not method.budgeted:
      raise ValueError(f'tally_nodes=True counts a best-first tree\'s scored nodes: method '
                       f'{self.method!r} scores none (use ddtree or d2sd_tree)')
    if method.budgeted:
      if self.tree_budget == 1:
        raise ValueError(f'tree_budget=1 leaves {self.method!r} no draft node: use 0 (as many '
                         'nodes as the full D2SD tree) or >= 2')
    elif self.tree_budget and self.tree_budget < self.gamma:
      raise ValueError(f'tree_budget={self.tree_budget} must be 0 (no limit) or >= gamma='
                       f'{self.gamma} (the drafter-1 chain always fits)')

  @property
  def takes_lookup_cycles(self) -> bool:
    """Whether a cycle may verify prompt lookup's proposal alone (`lookup_cycles`)."""
    return self.adaptive and self.lookup_cycles and drafting.get(self.method).lookup

  @property
  def drafters(self) -> tuple[str, ...]:
    return drafting.get(self.method).drafters

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """Target hidden states any drafter of this method reads."""
    return tuple(sorted({i for n in self.drafters for i in getattr(self, n).feature_layers}))

  @property
  def tree_size(self) -> int:
    """Nodes verified per cycle, the anchor included."""
    full = drafting.get(self.method).nodes(self)
    return min(full, self.tree_budget) if self.tree_budget else full

  @property
  def node_calibration(self) -> tuple:
    """tree.calibrate's table, ((proposer, curves), ...), from the drafters this method uses
    (empty when not `calibrated` or when they carry none). A drafter may carry curves fitted at
    several sampling temperatures ('lookup' at T = 0, 'lookup@0.7' at T = 0.7) and on one kind
    of request ('lookup:chat'; tree.curve_label): each proposer takes those fitted nearest this
    program's temperature, of its calibration_kind where there are such, else pooled ones."""
    if not self.calibrated:
      return ()
    own = {'drafter1': ('drafter1', 'lookup'), 'drafter2': ('drafter2',)}
    temperature = self.generation.sampling.temperature
    best = {}  # proposer -> ((distance in temperature, not of the kind), curves)
    for name in self.drafters:
      for label, curves in getattr(self, name).node_calibration:
        source, fitted_at, kind = tree_lib.parse_curve_label(label)
        if source not in own[name] or kind not in ('', self.calibration_kind):
          continue
        rank = (abs(fitted_at - temperature), kind != self.calibration_kind)
        if source not in best or rank < best[source][0]:
          best[source] = (rank, curves)
    return tuple((source, curves) for source, (_, curves) in best.items())

  @property
  def max_commit(self) -> int:
    return self.gamma  # at most gamma-1 accepted draft tokens + the bonus token
