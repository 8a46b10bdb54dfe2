import os

import torch
from hypothesis import HealthCheck, settings

# Property tests are derandomized so CI is reproducible; `HYPOTHESIS_PROFILE=dev` explores new examples.
settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Two CI cores are shared by two xdist workers.
torch.set_num_threads(1)
