"""The fork: upstream openrlhf==0.11.2 plus the diffs of patches/, which only wire calls into this package.

install  build, check and activate the patched copy; make every Ray worker import it; `openrlhf-geo fork verify|path`
launch   `openrlhf-geo train-ppo-ray`: upstream's train_ppo_ray on the patched copy, with the actor watchdog
hooks    what the diffs call: flags checked before Ray starts, the geometry of each experience batch through the
         pipeline, the baselines' policy loss, SALT's partitions, the pipeline state in checkpoints
cpu      the CPU overlay's replacements (patches/cpu/): flash-attn's padding helpers, the gloo weight sync
"""
