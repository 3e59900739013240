"""The trainer: loop (train(): set up, resume, steps, stop), build (the run's pieces from its config),
state (TrainState: what a checkpoint holds), step (TrainStep, evaluate), graphs (a micro-batch as a
CUDA graph), optim (AdamW, schedules),
checkpoint (atomic save, verified resume, resume rules), metrics (metrics line, metrics.jsonl, wandb),
device and distributed (where each process computes, DDP).

Nothing is imported here: coda_train.config imports the choice lists of optim, metrics and device,
and loop imports coda_train.config."""
