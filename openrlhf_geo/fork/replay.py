"""The fork's step records for the tests that replay a real run (OPENRLHF_GEO_DUMP_DIR; never set in a user's run).

`Recorder` is what `hooks.RecordingBatch` adds to `hooks.GeometryBatch`: a record of one rollout step (the pipeline's
state before and after, the inputs and outputs of its curation and of SALT, the multiplicities, the metrics and each
rollout's vLLM-vs-actor log-prob gap), saved as <dump>/stepNNNN.pt. tests/smoke_helpers.py replays each record
through `openrlhf_geo.pipeline` and compares. `hooks.ExperienceGeometry.start_batch` picks the recording batch only
when the variable is set; nothing of it runs otherwise.
"""

import os
from pathlib import Path

import torch

from openrlhf_geo.fork.install import DUMP_ENV


class Recorder:
    """Mixed in before `hooks.GeometryBatch`: records what the batch computes (module docstring)."""

    def _start(self, clean):
        pipeline, experiences = self.owner.pipeline, self.experiences
        self.dump = {"config": pipeline.config, "state": pipeline.state_dict(), "group_ids": self.group_ids}
        self.dump["clean"] = clean
        # the prompts' --data.label_key values in prompt order: what the policy ranks' records name
        # (hooks.record_training_step), so a test can tell which SALT partition each optimizer step trained on
        labels = [None] * len(self.indices)
        for row, label in zip(self.indices.tolist(), (x for exp in experiences for x in exp.labels)):
            labels[row] = label
        self.dump["labels"] = labels
        noisy = super()._start(clean)
        curate, reweight = self.step.curate, self.step.reweight

        def recorded_curate(rewards, hidden):
            out = curate(rewards, hidden)
            self.dump["curate"] = {"rewards": rewards, "hidden": hidden, "out": out}
            return out

        def recorded_reweight(advantages, **inputs):
            self.dump["reweight"] = {"advantages": advantages.clone(), **inputs}
            out = reweight(advantages, **inputs)
            self.dump["reweight"]["out"] = out.clone()
            return out

        self.step.curate, self.step.reweight = recorded_curate, recorded_reweight
        return noisy

    def salt(self, advantages):
        if self.owner.active:
            self.dump["salt_in"] = advantages.reshape(-1).clone()
        return super().salt(advantages)

    def finish(self):
        if self.owner.active:
            self._save()
        super().finish()

    def _save(self):
        _, multiplicity = self.step.rows(torch.zeros(len(self.indices)))
        gaps = None
        if self.experiences[0].rollout_log_probs is not None:
            # per rollout, max |vLLM - actor| log-prob of its sampled tokens; ~0 when vLLM holds the actor weights
            gaps = self._prompt_order(
                torch.cat(
                    [
                        ((e.rollout_log_probs - e.action_log_probs).abs() * e.action_mask).amax(-1)
                        for e in self.experiences
                    ]
                )
            )
        self.dump.update(
            multiplicity=multiplicity,
            metrics={k: v.clone() for k, v in self.step.metrics.items()},
            state_after=self.owner.pipeline.state_dict(),
            logprob_gap=gaps,
        )
        folder = Path(os.environ[DUMP_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.dump, folder / f"step{self.owner.pipeline.steps:04d}.pt")  # continues on resume
