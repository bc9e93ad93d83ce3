"""The models as pure JAX functions over explicit parameter pytrees: the target LM (`target`),
the diffusion drafter (`drafter`), sampling transforms (`sampling`) and sharding rules
(`sharding`). Imports only `kernels` (the target's Pallas layers on TPUs)."""
