"""d2sd_jax/platforms.py: a CPU host with libtpu installed is not probed for a TPU."""
import os
import subprocess
import sys

from d2sd_jax import platforms


def pci(tmp_path, *vendors):
  for i, v in enumerate(vendors):
    (tmp_path / f'0000:00:0{i}.0').mkdir(parents=True)
    (tmp_path / f'0000:00:0{i}.0' / 'vendor').write_text(v + '\n')
  return str(tmp_path)


def specs(*installed):
  return lambda name: object() if name in installed else None


def test_only_a_cpu_host_with_libtpu_is_pointed_at_the_cpu(tmp_path):
  cpu_box = pci(tmp_path / 'cpu', '0x8086', '0x1af4')
  tpu_vm = pci(tmp_path / 'tpu', '0x8086', '0x1ae0')
  assert not platforms.has_tpu_chip(cpu_box) and platforms.has_tpu_chip(tpu_vm)
  assert platforms.cpu_only_host({}, specs('libtpu'), cpu_box)
  assert not platforms.cpu_only_host({}, specs('libtpu'), tpu_vm)  # a TPU VM keeps its TPU
  assert not platforms.cpu_only_host({'JAX_PLATFORMS': 'tpu'}, specs('libtpu'), cpu_box)
  assert not platforms.cpu_only_host({}, specs('libtpu', 'jax_cuda12_plugin'), cpu_box)  # GPU
  assert not platforms.cpu_only_host({}, specs(), cpu_box)  # no libtpu: nothing to silence


def test_importing_the_package_keeps_libtpu_quiet_on_a_cpu_host():
  """On a CPU host with libtpu (the test extra installs it): JAX starts on the CPU with no
  libtpu message. Anywhere else (a TPU VM, a GPU machine): JAX_PLATFORMS is left unset."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  code = ('import os, d2sd_jax, jax; print(os.environ.get("JAX_PLATFORMS")); '
          'print(jax.default_backend())')
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120, check=True)
  platforms_set, backend = proc.stdout.split()
  if platforms.cpu_only_host(env):
    assert (platforms_set, backend) == ('cpu', 'cpu')
    assert 'libtpu' not in proc.stderr and 'TPU' not in proc.stderr, proc.stderr[-2000:]
  else:
    assert platforms_set == 'None'
