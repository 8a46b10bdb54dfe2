"""The single-process engine (CPU or one GPU) and its command line, `openrlhf-geo train`.

engine    Trainer: rollout -> reward -> old-policy forward (log-probs, SALT features, hidden states) -> the geometry
          pipeline (noise, GeoAlign, SALT) around group advantages -> clipped surrogate (+ KL) -> AdamW
flags     the command line: upstream's and the fork's flag names, validation, the config a checkpoint stores
training  `openrlhf-geo train`: the one way a run is built and run (also for the demo and the studies)
reward    the math-verify memo and a user's .py reward_func
rundir    the run directory: lock, refusal to overwrite, crash-safe checkpoints, resume-time flag checks
tracking  TensorBoard / wandb loggers with upstream's train/<key>, eval/<key> names
kernels   the pinned CPU kernels of the demo and the studies
"""
