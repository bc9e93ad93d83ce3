"""Keep JAX from probing for a TPU that is not there.

The test extra installs libtpu (for the TPU compile checks), and with libtpu installed JAX tries
to start a TPU on every machine: on a CPU host that prints a screen of libtpu errors before any
output. When no platform is asked for (JAX_PLATFORMS unset), libtpu is installed, this host has
no Google TPU device on its PCI bus (how JAX itself counts TPU chips) and no CUDA plugin is
installed, JAX is told to use the CPU. Anything else is left alone: a TPU VM, a GPU machine, or
an explicit JAX_PLATFORMS.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

GOOGLE_PCI_VENDOR = '0x1ae0'  # TPU chips' PCI vendor id
CUDA_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin')


def has_tpu_chip(pci_root: str = '/sys/bus/pci/devices') -> bool:
  for vendor in glob.glob(os.path.join(pci_root, '*', 'vendor')):
    try:
      with open(vendor) as f:
        if f.read().strip() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def cpu_only_host(environ=os.environ, find_spec=importlib.util.find_spec,
                  pci_root: str = '/sys/bus/pci/devices') -> bool:
  """Whether JAX should be pointed at the CPU (the module docstring's conditions)."""
  return ('JAX_PLATFORMS' not in environ and find_spec('libtpu') is not None and
          not any(find_spec(p) is not None for p in CUDA_PLUGINS) and
          not has_tpu_chip(pci_root))


def skip_absent_tpu() -> None:
  if cpu_only_host():
    os.environ['JAX_PLATFORMS'] = 'cpu'
    config = getattr(sys.modules.get('jax'), 'config', None)
    if config is not None:  # imported already: its config read the environment before
      config.update('jax_platforms', 'cpu')
