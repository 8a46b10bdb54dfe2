"""The fork's step records for the tests that replay a real run (OPENRLHF_GEO_DUMP_DIR; never set in a user's run).

`record_training_step` (called by the ppo_actor diff as `fork_hooks.record_training_step`) writes what each policy
rank trained on at each optimizer step; a run without the variable returns at its first line.

`Recorder` is what `hooks.RecordingBatch` adds to `hooks.GeometryBatch`: a record of one rollout step (the pipeline's
state before and after, the inputs and outputs of its curation and of its advantage adjustments (SALT; where the
policy ranks formed SALT's Grams, also the features they kept), the multiplicities, the metrics and each rollout's
vLLM-vs-actor log-prob gap), saved as <dump>/stepNNNN.pt. tests/smoke_helpers.py replays each record through
`openrlhf_geo.pipeline` and compares.
`hooks.ExperienceGeometry.start_batch` picks the recording batch only when the variable is set; nothing of it runs
otherwise.
"""

import hashlib
import itertools
import json
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
        # (record_training_step), so a test can tell which SALT partition each optimizer step trained on
        labels = [None] * len(self.indices)
        for row, label in zip(self.indices.tolist(), (x for exp in experiences for x in exp.labels)):
            labels[row] = label
        self.dump["labels"] = labels
        noisy = super()._start(clean)
        self.dump["actions"] = self.actions
        # each rollout's action spans (maximal runs of action tokens): a multi-turn agent's turns
        starts = [m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1] for m in (e.action_mask.bool() for e in experiences)]
        self.dump["spans"] = self._prompt_order(torch.cat([s.sum(-1) for s in starts]))
        curate, adjust = self.step.curate, self.step.adjust

        def recorded_curate(rewards, hidden):
            out = curate(rewards, hidden)
            self.dump["curate"] = {"rewards": rewards, "hidden": hidden, "out": out}
            return out

        def recorded_adjust(stage, values, **inputs):
            if stage != "advantage":
                return adjust(stage, values, **inputs)
            # the inputs the active stages read, evaluated (the verifier is the run's: a replay uses its own)
            names = {name for entry in self.owner.pipeline.adjustments[stage] for name in entry.inputs}
            read = {name: inputs[name]() for name in sorted(names - {"verifier"}) if name in inputs}
            self.dump["advantage"] = {"advantages": values.clone(), "inputs": read}
            out = adjust(stage, values, **inputs)
            self.dump["advantage"]["out"] = out.clone()
            return out

        self.step.curate, self.step.adjust = recorded_curate, recorded_adjust
        return noisy

    def _features(self):
        features = super()._features()
        if isinstance(features, torch.Tensor):
            return features
        if "features" not in self.dump:
            # the features the ranks kept (hooks.RankGrams' micro-batches), fetched here in prompt order: the replay
            # checks the ranks' Grams against them
            import ray

            parts = ray.get(features.refs)
            first_rows = torch.tensor([0, *itertools.accumulate(len(part) for part in parts)])
            self.dump["features"] = torch.cat(parts)[first_rows[features.where[:, 0]] + features.where[:, 1]]
            self.served = ServedGrams(features)  # one per step: the record holds what SALT was answered
        return self.served

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


def record_training_step(actor_trainer, experience, step) -> None:
    """ActorPPOTrainer.ppo_train after each micro-batch's training_step (`step`: its index in the epoch), only with
    OPENRLHF_GEO_DUMP_DIR set: at the end of each optimizer step, one JSON line in <dump>/rank<r>.jsonl with the
    labels (--data.label_key) of the rollouts this rank trained on in it, DeepSpeed's global step after it, and the
    sha256 of this rank's weights after it (None under ZeRO-3, whose ranks hold shards). A multi-rank test reads
    them across ranks: the same step on every rank trained on one whole SALT partition and left the same weights."""
    folder = os.environ.get(DUMP_ENV)
    if not folder:
        return
    labels = actor_trainer.__dict__.setdefault("openrlhf_geo_step_labels", [])
    labels.extend(experience.labels)
    args = actor_trainer.args
    if args.train.dynamic_batch_enable:
        last = actor_trainer.replay_buffer.dynamic_optimizer_step[step]
    else:  # upstream's own window (iter_grad_accum_global_norm)
        last = (step + 1) % actor_trainer.strategy.accumulated_gradient == 0
    if not last:
        return
    import ray

    engine = actor_trainer.actor.model
    digest = None
    if args.ds.zero_stage != 3:
        digest = hashlib.sha256()
        for name, param in engine.module.named_parameters():
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy())
        digest = digest.hexdigest()
    record = {
        "rank": torch.distributed.get_rank(),
        "pid": os.getpid(),
        "node": ray.get_runtime_context().get_node_id(),
        "global_step": engine.global_steps,
        "labels": list(labels),
        "weights": digest,
    }
    labels.clear()
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder, f"rank{record['rank']}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


class ServedGrams:
    """A `salt_stage.GramSource` that passes the ranks' answers through (source: `hooks.RankGrams`) and keeps them, so
    that a recorded step replays on exactly the Grams and eigendecompositions SALT was given (saved without source)."""

    def __init__(self, source):
        self.source, self.rows, self.answers = source, None, None

    def grams(self, rows):
        if self.source is not None:
            self.rows, self.answers = [r.clone() for r in rows], self.source.grams(rows)
        elif len(rows) != len(self.rows) or not all(torch.equal(a, b) for a, b in zip(rows, self.rows)):
            raise AssertionError("the replay asks for other rows than the recorded step's SALT did")
        return self.answers

    def __getstate__(self):
        return {"source": None, "rows": self.rows, "answers": self.answers}
