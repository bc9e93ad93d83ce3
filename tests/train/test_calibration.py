"""Reliability bins, ECE and the fitted confidence temperature."""
import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.train import calibration as C


def test_bins_hold_the_softmax_maximum():
  logits = jnp.log(jnp.asarray([[1.0, 3.0], [1.0, 1.0], [9.0, 1.0]]))  # max probs .75, .5, .9
  stats = np.asarray(C.bin_stats(logits, jnp.asarray([1.0, 0.0, 1.0]), jnp.ones(3),
                                 temperatures=(1.0,)))[0]
  assert stats[0].tolist() == [0, 0, 0, 0, 0, 1, 0, 1, 0, 1]  # bins .5, .7, .9
  np.testing.assert_allclose(stats[1][[5, 7, 9]], [0.5, 0.75, 0.9], rtol=1e-6)
  assert stats[2][[5, 7, 9]].tolist() == [0, 1, 1]


def test_ece_definition():
  # Two bins: 100 at confidence .9 with 60 correct, 100 at .5 with 50 correct.
  stats = np.zeros((3, 10))
  stats[:, 9] = [100, 90, 60]
  stats[:, 5] = [100, 50, 50]
  assert abs(C.ece(stats) - 0.5 * 0.3) < 1e-9
  rows = C.reliability(stats)
  assert [r['bin'] for r in rows] == ['0.5-0.6', '0.9-1.0'] and rows[1]['accuracy'] == 0.6


def test_fitting_a_temperature_fixes_overconfidence():
  """Confident logits whose argmax is right only 55 % of the time: T > 1 lowers the ECE."""
  key1, key2 = jax.random.split(jax.random.PRNGKey(0))
  n, V = 4000, 8
  logits = jax.random.normal(key1, (n, V)) * 0.3
  logits = logits.at[:, 0].add(3.0)  # softmax max ≈ 0.7-0.8
  correct = (jax.random.uniform(key2, (n,)) < 0.55).astype(jnp.float32)
  stats = C.bin_stats(logits, correct, jnp.ones(n))
  temperature, after, before = C.fit_temperature(stats)
  assert temperature > 1.0 and after < before and after < 0.05


def test_reliability_plot_writes_a_png(tmp_path):
  stats = np.array([[10, 0, 5], [1.5, 0, 4.5], [2, 0, 4]], np.float64)  # count, conf sum, correct
  path = C.reliability_plot({'raw': stats}, str(tmp_path / 'r.png'), 'test')
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_lookup_accept_rates_by_hand():
  """[1, 2, 3, 1, 2, 4], prompt of 3: at t = 4 the tail [1] proposes [2, 3]; 2 is accepted,
  3 is not (4 followed): rate 1 / (1 + 1). A fully accepted proposal adds no stop."""
  rates, stops = C.lookup_accept_rates([[1, 2, 3, 1, 2, 4]], [3], gamma=3,
                                                 ngram_max=1)
  assert rates == [0.5] and stops == [1]
  rates, stops = C.lookup_accept_rates([[7, 8, 7, 8, 7, 8]], [2], gamma=3, ngram_max=2)
  # t=2: tail [7, 8]? no earlier match of 2 ending before; tail [8]? no: n = 1 with [7]? seq[:2]
  # = [7, 8]: tail [8] has no earlier 8 -> nothing. t=3: [7, 8, 7]: tail [8, 7]? no; [7] at 0
  # -> [8, 7]; seq[3:] = [8, 7]: both accepted. t=4: [7, 8, 7, 8]: tail [7, 8] at 0 -> [7, 8];
  # seq[4:] = [7, 8]: both accepted.
  assert stops == [0, 0] and rates[0] == 1.0 and rates[1] == 1.0
