"""The fork at the shape users run it: several policy ranks, reference ranks and vLLM engines, two Ray nodes, jobs.

The smoke's multi-rank checks (examples/scripts/smoke_cpu.py `check_ranks`, `check_workers`) read what a run records
with OPENRLHF_GEO_DUMP_DIR: each policy rank's optimizer steps (fork_hooks.record_training_step, called by the
patched ppo_train), the experience maker's prompt order, the engines' reward calls, every worker's import. Here
first, without engines: those records come from the real patched training loop, and each check fails on the fault
it is for. Then (marked `engines`) the smoke's `multirank` condition for real: 2 policy ranks (ZeRO-2 over gloo),
2 reference ranks, 2 vLLM engines, SALT + GeoAlign under flipped rewards; with OPENRLHF_GEO_SMOKE=full also
`two_node_job` (two Ray nodes, three `ray job submit` jobs: a run, a resume stopped mid-step, the resume to the end).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from fork_helpers import parse
from smoke_helpers import SCRIPT, _engines_missing, assert_steps_replay

from openrlhf_geo.fork import hooks as fork_hooks
from openrlhf_geo.fork import install as fork

REPO = Path(__file__).resolve().parents[1]
N_PER_PROMPT = 4  # fork_helpers' BASE_ARGV


# ── the records, from the real patched training loop (no engines) ──


def labelled_rollouts(up, n_prompts):
    """Single-sample Experiences of n_prompts prompts x N_PER_PROMPT, labelled p00, p01, ... in prompt order, in the
    experience maker's shuffled micro-batch order (`index`: prompt-order position)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for k in torch.randperm(n_prompts * N_PER_PROMPT, generator=g).tolist():
        length = int(torch.randint(4, 9, (1,), generator=g))
        action = torch.ones(1, length - 1, dtype=torch.long)
        out.append(
            up.experience.Experience(
                sequences=torch.randint(1, 40, (1, length), generator=g),
                attention_mask=torch.ones(1, length, dtype=torch.long),
                action_mask=action,
                action_log_probs=torch.zeros(1, length - 1),
                advantages=torch.zeros(1, length - 1),
                rewards=torch.tensor([1.0]),
                total_length=torch.tensor([float(length)]),
                index=[k],
                prompts=[f"prompt {k // N_PER_PROMPT}"],
                labels=[f"p{k // N_PER_PROMPT:02d}"],
                info={},
            )
        )
    return out


def train_rank(up, monkeypatch, args, batch, rank, world, dump):
    """One data-parallel rank: the patched ActorPPOTrainer.ppo_train over a real replay buffer holding `batch`, its
    training_step an optimizer step on a tiny module at each window's end (the same on every rank, as DeepSpeed's
    all-reduced step), with OPENRLHF_GEO_DUMP_DIR=dump."""
    import openrlhf.trainer.ppo_utils.replay_buffer as replay_buffer
    import ray

    monkeypatch.setenv(fork.DUMP_ENV, str(dump))
    monkeypatch.setattr(up.ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the replay buffer names its (unused) device
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: NS(get_node_id=lambda: f"node-{rank}"))
    reduce = NS(get_world_size=lambda group=None: world, all_reduce=lambda *a, **k: None, ReduceOp=NS(MIN=0, SUM=1))
    monkeypatch.setattr(replay_buffer, "dist", reduce)
    micro = args.train.micro_batch_size
    trainer = up.ppo_actor.ActorPPOTrainer(NS(args=args), None, None, None, None, micro_train_batch_size=micro)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    window = args.train.batch_size // micro // world
    trainer.strategy = NS(
        args=args,
        ring_attn_group=None,
        accumulated_gradient=window,
        ds_device_mesh={"dp": NS(get_group=lambda: None)},
        is_rank_0=lambda: True,
        all_reduce=lambda data, op="mean": data,
    )
    torch.manual_seed(0)
    trainer.actor = NS(model=NS(module=torch.nn.Linear(3, 2), global_steps=0))

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        if (step + 1) % window == 0:
            engine = trainer.actor.model
            engine.global_steps += 1
            with torch.no_grad():
                engine.module.weight.add_(engine.global_steps)
        return {"metrics": {"policy_loss": 0.0}, "weights": {"policy_loss": None}, "num_action_tokens": 1,
                "num_samples": 1}  # fmt: skip

    trainer.training_step = training_step
    trainer.replay_buffer.append(batch)
    trainer.ppo_train(0.0)


def write_dump(dump, labels, partition_prompts, gaps):
    """The experience maker's step0001.pt, as far as check_ranks reads it."""
    dump.mkdir(parents=True, exist_ok=True)
    record = {
        "labels": labels,
        "group_ids": torch.arange(len(labels)) // N_PER_PROMPT,
        "advantage": {"inputs": {"partition_prompts": partition_prompts}},
        "logprob_gap": torch.tensor(gaps),
    }
    torch.save(record, dump / "step0001.pt")


@pytest.fixture
def two_ranks(up, monkeypatch, tmp_path):
    """Two ranks trained on one rollout step of 8 prompts (4 SALT partitions of 2 prompts), 2 epochs, through the
    fork's rank_batches and the patched ppo_train; the rollouts' prompts scored by two engines. -> the dump folder."""
    argv = ["--advantage_estimator", "salt", "--rollout.batch_size", "8", "--train.batch_size", "8",
            "--train.micro_batch_size", "1", "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2",
            "--train.max_epochs", "2"]  # fmt: skip
    args = parse(up, monkeypatch, argv)
    dump = tmp_path / "dump"
    trainer = NS(args=args, experience_maker=NS(geometry=NS(pipeline=NS(steps=1))))
    batches = fork_hooks.rank_batches(trainer, labelled_rollouts(up, 8))
    for rank, batch in enumerate(batches):
        with monkeypatch.context() as m:
            train_rank(up, m, args, batch, rank, 2, dump)
    labels = [f"p{k // N_PER_PROMPT:02d}" for k in range(32)]
    write_dump(dump, labels, 2, [0.004] * 32)
    rewards = [{"pid": 100 + p % 2, "node": f"node-{p % 2}", "labels": [f"p{p:02d}"] * N_PER_PROMPT} for p in range(8)]
    (dump / "rewards.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rewards))
    return dump


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_each_rank_records_what_each_optimizer_step_trained_on_and_the_weights_after_it(two_ranks):
    ranks = [read(two_ranks / f"rank{r}.jsonl") for r in range(2)]
    assert [len(r) for r in ranks] == [8, 8]  # 4 partitions x 2 epochs, one line per optimizer step
    for r, records in enumerate(ranks):
        assert [x["global_step"] for x in records] == list(range(1, 9))
        assert {x["rank"] for x in records} == {r} and {x["node"] for x in records} == {f"node-{r}"}
        assert all(len(x["labels"]) == 4 for x in records)  # 8 rollouts per partition, half on each rank
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)  # train_rank's module after its first step, hashed here
    with torch.no_grad():
        module.weight.add_(1)
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(torch.uint8).numpy())
    assert ranks[0][0]["weights"] == ranks[1][0]["weights"] == digest.hexdigest()
    assert len({x["weights"] for x in ranks[0]}) == 8  # every step moved them


def test_the_rank_checks_pass_on_the_real_loops_records(two_ranks):
    problems, numbers = SCRIPT.check_ranks(two_ranks, 2, 2)
    assert problems == []
    order = numbers["partition_order"][1]
    assert sorted(order[:4]) == sorted(order[4:]) == [0, 1, 2, 3]
    assert numbers["rank_nodes"] == ["node-0", "node-1"]
    assert numbers["engine_gap"] == {1: {"100": 0.004, "101": 0.004}}


def rewrite(path, change):
    records = read(path)
    change(records)
    path.write_text("".join(json.dumps(x) + "\n" for x in records))


def test_a_rank_training_on_another_partition_is_reported(two_ranks):
    def swap(records):  # rank 1's first two optimizer steps trade one rollout: both steps mix two partitions
        records[0]["labels"][0], records[1]["labels"][0] = records[1]["labels"][0], records[0]["labels"][0]

    rewrite(two_ranks / "rank1.jsonl", swap)
    problems, _ = SCRIPT.check_ranks(two_ranks, 2, 2)
    assert len([p for p in problems if "not one SALT partition" in p]) == 2, problems
    assert any("an epoch trained on partitions" in p for p in problems)


def test_ranks_whose_weights_diverge_are_reported(two_ranks):
    rewrite(two_ranks / "rank0.jsonl", lambda records: records[5].update(weights="0" * 64))
    problems, _ = SCRIPT.check_ranks(two_ranks, 2, 2)
    assert problems == ["rollout step 1, optimizer step 6: the ranks' weights differ after it"]


def test_a_skipped_deepspeed_step_is_reported(two_ranks):
    rewrite(two_ranks / "rank1.jsonl", lambda records: records[3].update(global_step=3))
    problems, _ = SCRIPT.check_ranks(two_ranks, 2, 2)
    assert len(problems) == 1 and problems[0].startswith("rank 1: DeepSpeed's global steps [1, 2, 3, 3, 5")


def test_an_unsynced_or_idle_engine_is_reported(two_ranks):
    labels = [f"p{k // N_PER_PROMPT:02d}" for k in range(32)]
    gaps = [0.004] * 32
    gaps[N_PER_PROMPT * 3 + 1] = 0.5  # a rollout of p03, which engine 101 generated
    write_dump(two_ranks, labels, 2, gaps)
    problems, _ = SCRIPT.check_ranks(two_ranks, 2, 2)
    assert problems == ["rollout step 1: engines' log-probs differ from the actor's: {101: 0.5}"]
    rewrite(two_ranks / "rewards.jsonl", lambda records: [x.update(pid=100) for x in records])
    problems, _ = SCRIPT.check_ranks(two_ranks, 2, 2)
    assert problems[0] == "1 vLLM engines scored rollouts, not 2"


def test_missing_records_are_one_problem(tmp_path):
    problems, numbers = SCRIPT.check_ranks(tmp_path, 2, 2)
    assert problems == [f"0 rollout steps dumped, optimizer steps recorded per rank [0, 0] (in {tmp_path})"]


def test_no_records_are_written_without_the_dump_folder(up, monkeypatch, tmp_path):
    monkeypatch.delenv(fork.DUMP_ENV, raising=False)
    fork_hooks.record_training_step(None, None, 0)  # returns before touching its arguments
    assert not any(tmp_path.iterdir())


def test_the_worker_check_flags_a_pristine_openrlhf_on_the_node(tmp_path):
    shipped = "/tmp/ray/session/runtime_resources/py_modules_files/_ray_pkg_1/openrlhf"
    rows = [
        {"pid": 1, "node": "b", "fork_id": fork.FORK_ID, "openrlhf": shipped},
        {"pid": 2, "node": "a", "fork_id": None, "openrlhf": "/venv/site-packages/openrlhf"},  # the head: not read
    ]
    (tmp_path / "workers.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert SCRIPT.check_workers(tmp_path, "b") == []
    assert SCRIPT.check_workers(tmp_path, "c") == ["no worker recorded its import on node c"]
    assert SCRIPT.check_workers(tmp_path, "a") == [
        "worker pid 2 on node a imported /venv/site-packages/openrlhf (fork id None)"
    ]


def test_the_workers_start_up_check_records_its_import_before_refusing_it(monkeypatch, tmp_path):
    """check_worker in a worker that imported a pristine openrlhf: the record first, then the ForkError."""
    import openrlhf
    import ray

    monkeypatch.setenv(fork.DUMP_ENV, str(tmp_path))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: NS(get_node_id=lambda: "n2"))
    monkeypatch.delattr(openrlhf, "__openrlhf_geo_fork__", raising=False)
    with pytest.raises(fork.ForkError, match="which is not the openrlhf-geo fork"):
        fork.check_worker()
    (record,) = read(tmp_path / "workers.jsonl")
    assert record["node"] == "n2" and record["fork_id"] is None and record["pid"] == os.getpid()
    assert record["openrlhf"] == str(Path(openrlhf.__file__).parent)


def test_multirank_prompts_are_labelled_by_id_and_the_reward_records_its_engine(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "Q: 1 + 2 = ? A:", "label": "3"}\n{"input": "Q: 1 + 2 = ? A:", "label": "3"}\n')
    path = SCRIPT.labelled_prompts(prompts, tmp_path)
    assert read(path) == [{"input": "Q: 1 + 2 = ? A:", "label": "p00"}, {"input": "Q: 1 + 2 = ? A:", "label": "p01"}]
    import ray

    namespace = {}
    exec(SCRIPT.REWARD_FUNC, namespace)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: NS(get_node_id=lambda: "n1"))
    monkeypatch.setenv(fork.DUMP_ENV, str(tmp_path / "dump"))
    out = namespace["reward_func"](["Q: A: 3"], ["Q: A:"], ["p00"])
    assert out["rewards"].tolist() == [float(sum(map(ord, " 3")) % 2)]
    assert read(tmp_path / "dump" / "rewards.jsonl") == [{"pid": os.getpid(), "node": "n1", "labels": ["p00"]}]


# ── the smoke's multi-rank conditions, for real (Ray + vLLM + DeepSpeed on CPU) ──

FULL = os.environ.get("OPENRLHF_GEO_SMOKE") == "full"
RUN = ["multirank", "two_node_job"] if FULL else ["multirank"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    missing = _engines_missing()
    if missing and not os.environ.get("CI"):
        pytest.skip(f"the CPU engines are not installed ({', '.join(missing)}): bash scripts/setup_cpu.sh test")
    out = tmp_path_factory.mktemp("smoke_multirank")
    done = subprocess.run(
        [sys.executable, str(REPO / "examples/scripts/smoke_cpu.py"), str(out), "--conditions", ",".join(RUN)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    summary_path = out / "summary.json"
    assert summary_path.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads(summary_path.read_text()), done


def _dumps(folder):
    return {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted(folder.glob("step*.pt"))}


@pytest.mark.fork
@pytest.mark.slow
@pytest.mark.engines
def test_two_ranks_two_engines_each_step_one_partition_same_weights_synced_engines(smoke):
    out, summary, done = smoke
    result = summary["multirank"]
    assert result["ok"], result["problems"]
    assert done.returncode == 0 or not FULL
    assert result["steps"] == 2 and result["weight_change"] > 0
    ranks = result["ranks"]
    assert ranks["optimizer_steps_per_rollout_step"] == 4  # 2 partitions x 2 epochs
    assert all(sorted(order[:2]) == sorted(order[2:]) == [0, 1] for order in ranks["partition_order"].values())
    assert all(len(gaps) == 2 for gaps in ranks["engine_gap"].values())  # both engines, every step
    dumps = _dumps(out / "multirank" / "dump")
    # SALT's Grams came from the ranks (the replay checks them against the features the ranks kept)
    assert dumps and all("features" in dump for dump in dumps.values())
    assert_steps_replay("multirank", dumps)


@pytest.mark.fork
@pytest.mark.slow
@pytest.mark.engines
def test_two_nodes_as_ray_jobs_the_shipped_copy_a_stop_mid_step_and_the_resume(smoke):
    if not FULL:
        pytest.skip("the two-node job runs with OPENRLHF_GEO_SMOKE=full (bash examples/scripts/smoke_cpu.sh)")
    out, summary, _ = smoke
    result = summary["two_node_job"]
    assert result["ok"], result["problems"]
    jobs = result["jobs"]
    assert [jobs[j]["status"] for j in ("job1", "job2", "job3")] == ["SUCCEEDED", "STOPPED", "SUCCEEDED"]
    assert jobs["job3"]["first_step"] == int(jobs["job2"]["latest"].removeprefix("global_step")) + 1
    bare = result["probe"]["bare"]  # refused: the task's worker died at its start-up check, which recorded why
    assert "imported" not in bare and bare["workers"]
    assert all("(fork id None)" in problem for problem in bare["workers"])
    for job in ("job1", "job3"):
        assert_steps_replay(job, _dumps(out / "two_node_job" / job / "dump"))


def test_the_multirank_flags_pass_the_fork_parser_with_two_ranks_of_each_kind(up, monkeypatch, tmp_path):
    command = SCRIPT.train_command(tmp_path, tmp_path / "ckpt", SCRIPT.MULTIRANK, tmp_path, tmp_path / "p.jsonl", "r")
    (tmp_path / "p.jsonl").write_text('{"input": "Q", "label": "p00"}\n')
    args = parse(up, monkeypatch, [f for f in command[4:] if f not in ("--fork.device", "cpu")])
    assert (args.actor.num_gpus_per_node, args.ref.num_gpus_per_node, args.vllm.num_engines) == (2, 2, 2)
    assert args.algo.kl.init_coef > 0  # the reference ranks exist only with a KL term
    assert fork_hooks.aligned_partitions(args) == 4  # prompts per SALT partition = per optimizer step
    assert args.train.batch_size // args.train.micro_batch_size // 2 == 2  # micro-batches per step and rank


def test_a_job_goes_through_common_shs_submit_train_with_working_dir_and_env_vars_only(tmp_path, monkeypatch):
    """SUBMIT as the cluster condition runs it, with `ray` a stub recording its argv (nothing starts)."""
    stub = tmp_path / "bin" / "ray"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$STUB_OUT"\n')
    stub.chmod(0o755)
    runtime_env = {"working_dir": str(REPO), "env_vars": {fork.DUMP_ENV: "/d"}}
    env = dict(os.environ, PATH=f"{stub.parent}:{os.environ['PATH']}", STUB_OUT=str(tmp_path / "argv"),
               RAY_ADDRESS="http://127.0.0.1:1", SMOKE_RUNTIME_ENV=json.dumps(runtime_env))  # fmt: skip
    subprocess.run(
        ["bash", "-c", SCRIPT.SUBMIT, "x", str(REPO / "examples/scripts"), "--a", "b c"], env=env, check=True
    )
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:3] == ["job", "submit", "--address=http://127.0.0.1:1"]
    assert json.loads(argv[3].removeprefix("--runtime-env-json=")) == runtime_env
    assert argv[4:] == ["--", "python3", "-m", "openrlhf_geo.cli", "train-ppo-ray", "--a", "b c"]
