"""Training the drafters: record sources (`records`, `tfds_data`), training windows (`data`),
the per-host pipeline (`grain_data`), distillation (`distill`, with continuous batching in
`batching`), teacher-forced corpora (`corpus`), losses (`losses`), calibration (`calibration`),
the optax loop (`training`) and a run's memory per chip (`memory`)."""
